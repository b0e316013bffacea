"""The compute thread count follows the cores nobody else is using (conveyor/runner/cores.py), and changing
it while requests run changes no token."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.runner.cores import CoreGovernor, Usable, cgroup_cpu_limit, physical_cores

TWO = Usable(frozenset({0, 1}), 2)


@pytest.mark.parametrize(("others", "threads"), [(0.0, 2), (0.3, 2), (0.6, 2), (0.7, 1), (1.0, 1), (2.0, 1)])
def test_a_core_is_given_up_once_others_keep_most_of_it_busy(others, threads):
    assert CoreGovernor.decide(TWO, others) == threads


def test_decide_never_exceeds_the_usable_cores():
    four_cpus_two_cores = Usable(frozenset(range(4)), 2)  # hyperthread siblings count once
    assert CoreGovernor.decide(four_cpus_two_cores, 0.0) == 2
    assert CoreGovernor.decide(Usable(frozenset(range(8)), 8), 2.9) == 5


class Fake:
    """Counters the governor reads, moved by hand: busy ticks of the CPUs and this process's own ticks."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0
        self.own = 0
        self.threads = 2
        self.set_calls: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.set_calls.append(n)

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += round(own_cores * seconds * 100)
        self.busy += round((own_cores + other_cores) * seconds * 100)

    def governor(self) -> CoreGovernor:
        return CoreGovernor(self.set_threads, lambda: self.threads, interval_s=0.5, usable=lambda: TWO,
                            busy_ticks=lambda cpus: self.busy, process_ticks=lambda pid: self.own,
                            clock=lambda: self.t, ticks_per_s=100)


def test_a_neighbour_takes_a_thread_after_two_intervals_and_gives_it_back(caplog):
    f = Fake()
    g = f.governor()
    f.advance(0.5, own_cores=2.0, other_cores=0.0)
    assert g.tick() == 2 and f.set_calls == []
    f.advance(0.2, own_cores=1.0, other_cores=1.0)
    assert g.tick() == 2, "looked again before the interval passed"
    f.advance(0.3, own_cores=1.0, other_cores=1.0)
    with caplog.at_level(logging.WARNING, logger="conveyor.runner"):
        assert g.tick() == 2, "one interval's burst must not change the count"
        f.advance(0.5, own_cores=1.0, other_cores=1.0)
        assert g.tick() == 1 and f.set_calls == [1]
    assert g.sharing and abs(g.others - 1.0) < 0.05
    assert any("sharing the CPU" in r.message for r in caplog.records)
    f.advance(0.5, own_cores=1.0, other_cores=1.0)  # the neighbour keeps its core: nothing changes
    assert g.tick() == 1 and f.set_calls == [1]
    f.advance(0.5, own_cores=1.0, other_cores=0.0)
    g.tick()
    f.advance(0.5, own_cores=1.0, other_cores=0.0)
    assert g.tick() == 2 and f.set_calls == [1, 2] and not g.sharing


def test_a_light_neighbour_leaves_both_threads():
    f = Fake()
    g = f.governor()
    for _ in range(6):
        f.advance(0.5, own_cores=1.8, other_cores=0.4)
        assert g.tick() == 2
    assert f.set_calls == []


def test_physical_cores_count_hyperthread_siblings_once(tmp_path):
    for cpu, core in enumerate([0, 1, 0, 1]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({0, 2}, tmp_path) == 1
    assert physical_cores({0, 1}, tmp_path) == 2


def test_cgroup_quota_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "svc").mkdir(parents=True)
    (v2 / "svc" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cg2").write_text("0::/svc\n")
    assert cgroup_cpu_limit(v2, tmp_path / "cg2") == 1.5
    (v2 / "svc" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2, tmp_path / "cg2") is None
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cg1").write_text("4:cpu,cpuacct:/job\n3:memory:/job\n")
    assert cgroup_cpu_limit(tmp_path / "v1", tmp_path / "cg1") == 1.0
    (tmp_path / "none").write_text("")
    assert cgroup_cpu_limit(tmp_path / "v1", tmp_path / "none") is None


@pytest.mark.skipif(not Path("/proc/stat").exists() or len(os.sched_getaffinity(0)) != 2,
                    reason="reads /proc/stat; written for the 2-CPU machines CI runs on")
def test_two_busy_processes_are_seen_and_one_thread_is_left():
    """Real counters: two CPU-bound processes on two CPUs leave this engine one thread."""
    calls: list[int] = []
    g = CoreGovernor(calls.append, lambda: 2, interval_s=0.3)
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 20\nwhile time.time() < t: pass"])
            for _ in range(2)]
    try:
        time.sleep(0.3)
        g.tick(force=True)
        for _ in range(3):
            time.sleep(0.35)
            g.tick()
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert g.others > 1.2, f"two busy processes on two CPUs measured as {g.others:.2f} busy cores"
    assert g.threads == 1 and calls == [1]


def test_an_engine_process_from_a_forkserver_counts_the_server_that_started_it(tmp_path):
    """The engine process is forked from a forkserver (engine/clients.process_context), whose pid is the child's
    os.getppid(): the HTTP server's CPU time must still count as the engine's own work, not a neighbour's.
    Run in a fresh interpreter, so the test process starts no forkserver of its own."""
    code = ("import multiprocessing as mp, os\n"
            "from conveyor.runner.cores import engine_pids\n"
            "def child(conn):\n"
            "    conn.send((engine_pids(), os.getppid()))\n"
            "if __name__ == '__main__':\n"
            "    ctx = mp.get_context('forkserver')\n"
            "    a, b = ctx.Pipe()\n"
            "    p = ctx.Process(target=child, args=(b,))\n"
            "    p.start()\n"
            "    pids, ppid = a.recv()\n"
            "    p.join(30)\n"
            "    assert ppid != os.getpid(), 'not forked from a forkserver'\n"
            "    assert pids == (p.pid, os.getpid()), (pids, p.pid, os.getpid())\n"
            "    assert engine_pids() == (os.getpid(),)\n")
    script = tmp_path / "probe.py"  # a file: the forkserver's child finds `child` by importing the main module
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
