"""The studies' harness (conveyor/bench/study.py) and the studies themselves (benchmarks/): one result format,
one way to run them, and no script keeping a private copy of what the harness owns."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conveyor.bench import cli, study
from conveyor.bench.stats import percentile

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


# --- the result format ---------------------------------------------------------------------------------------
def test_result_round_trips_with_its_command_and_machine(tmp_path: Path) -> None:
    argv = ["python", "benchmarks/vs_vllm.py", "--models", "smollm2 x"]
    s = study.Study("vs_vllm", argv=argv)
    payload = {"runs": {"a|b": {"output_throughput": 573.5}}, "cpu": "x", "rows": [1, 2.5, None]}
    path = s.write(tmp_path / "deep" / "r.json", payload, final=False)
    doc = json.loads(path.read_text())
    assert list(doc) == ["study", "command", "machine", "started", "finished", "results"]
    assert doc["study"] == "vs_vllm" and doc["command"] == argv and doc["finished"] is None
    assert UTC.match(doc["started"])
    m = doc["machine"]
    assert m["cpu"] and m["cores"] == os.cpu_count() and m["ram_gib"] > 0
    assert set(m["cpu_flags"]) <= set(study.FLAGS_OF_INTEREST)
    assert m["torch"] and m["python"] and len(m["load_avg"]) == 3
    assert m["git_commit"] is None or re.match(r"^[0-9a-f]{40}(\+dirty)?$", m["git_commit"])
    assert study.read_result(path) == payload
    s.write(path, payload)  # the last write: finished
    doc = json.loads(path.read_text())
    assert UTC.match(doc["finished"]) and doc["finished"] >= doc["started"]
    assert not list(tmp_path.glob("deep/*.tmp"))
    assert s.command_line == "python benchmarks/vs_vllm.py --models 'smollm2 x'"


def test_a_file_from_before_the_format_reads_as_its_payload(tmp_path: Path) -> None:
    legacy = {"cpu": "AMD EPYC", "runs": {}, "command": "python benchmarks/vs_vllm.py"}
    (tmp_path / "old.json").write_text(json.dumps(legacy))
    assert study.read_result(tmp_path / "old.json") == legacy


def test_the_command_is_the_processes_argv_or_what_bench_study_was_given(monkeypatch) -> None:
    monkeypatch.setattr(study, "_TYPED_ARGV", None)
    assert study.Study().command == list(sys.orig_argv)
    monkeypatch.setattr(study, "_TYPED_ARGV", json.dumps(["conveyor", "bench", "study", "kv_disk", "all"]))
    s = study.Study()
    assert s.command == ["conveyor", "bench", "study", "kv_disk", "all"]
    assert s.name == Path(sys.argv[0]).stem


def test_a_study_takes_the_typed_command_for_itself_not_its_children() -> None:
    child = f"import os; print(os.environ.get({study.STUDY_ARGV_ENV!r}))"
    code = ("import json, subprocess, sys; from conveyor.bench import study; "
            f"child = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True); "
            "print(json.dumps([study.Study('x').command, child.stdout.strip()]))")
    env = {**os.environ, study.STUDY_ARGV_ENV: json.dumps(["conveyor", "bench", "study", "x", "--a"])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["conveyor", "bench", "study", "x", "--a"], "None"]


# --- numbers -------------------------------------------------------------------------------------------------
def test_pct_is_the_studies_percentile_a_sample_at_rank_floor_q_n() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 10, 99, 100, 101, 1000):
        xs = [rng.random() for _ in range(n)]
        srt = sorted(xs)
        for q in (50, 90, 99):
            # what the five copies the scripts had computed (q as a fraction), number for number
            assert study.pct(xs, q) == srt[min(n - 1, int(q / 100 * n))]
            assert study.pct(xs, q) in xs
    assert study.pct([3.0, 1.0, 2.0, 4.0], 50) == 3.0  # not 2.5: nothing interpolated
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert study.pct([], 99) is None
    with pytest.raises(ValueError):
        percentile([1.0], 50, "nearest")


def test_best_ms_is_the_fastest_call() -> None:
    delays = iter([0.0] + [0.02, 0.001, 0.02])  # the warm-up call, then three timed
    assert study.best_ms(lambda: time.sleep(next(delays)), n=3) < 15


# --- servers -------------------------------------------------------------------------------------------------
# a server that says where it listens as `conveyor serve --port 0` does, answers /health 503 twice then 200, and
# has a child (an "engine") that ignores SIGTERM, so only the tree kill ends it
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('engine', flush=True); time.sleep(600)"])
    seen = []
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            code = 200 if len(seen) > 2 else 503
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}' if code == 200 else b'{"status": "loading", "phase": "weights"}')
        def log_message(self, *a):
            pass
    s = http.server.HTTPServer(("127.0.0.1", 0), H)
    print(f"bound 127.0.0.1:{s.server_address[1]}; serving there", flush=True)
    s.serve_forever()
""")


def test_server_finds_its_port_waits_for_200_and_ends_its_whole_tree(tmp_path: Path) -> None:
    answers = []
    server = study.Server([sys.executable, "-c", FAKE_SERVER], 0, poll_s=0.02, stop_timeout=1, ready_timeout=60)
    server.start()
    try:
        ready = server.wait_ready(on_answer=lambda r: answers.append(r.status_code))
        assert server.port and server.url == f"http://127.0.0.1:{server.port}"
        assert 0 < server.bound_s <= ready == server.ready_s
        assert answers == [503, 503, 200]
        tree = psutil.Process(server.pid).children(recursive=True)
        assert len(tree) == 1 and tree[0].is_running()
    finally:
        server.stop()
    assert server.proc.poll() is not None

    def alive() -> list:
        out = []
        for p in tree:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:  # SIGKILL is delivered, not necessarily acted on, at once
        time.sleep(0.01)
    assert not alive()
    assert "engine" in Path(server.log_path).read_text()
    os.unlink(server.log_path)


def test_a_server_that_exits_fails_its_start_naming_its_log() -> None:
    cmd = [sys.executable, "-c", "import sys; print('no weights here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3 .*server's log: (\S+), its end:\nno weights here") as e:
        with study.Server(cmd, study.free_port(), poll_s=0.02):
            pass
    os.unlink(re.search(r"server's log: (\S+),", str(e.value)).group(1))


def test_tree_memory_counts_this_process() -> None:
    rss, pss = study.tree_memory(os.getpid())
    assert rss == pss > 10 * 2**20
    mem = study.TreeMemory(os.getpid(), every=0.01, pss=False)
    time.sleep(0.05)
    mem.ready()
    out = mem.result()
    assert mem.last_rss > 0 and mem.peak_rss >= mem.last_rss and out["peak_rss_loading_gib"] > 0


def test_tree_memory_reads_pss_rarely(monkeypatch) -> None:
    """The PSS walks every page of the tree (46-67 ms a call at the 1B shape): at most once per `pss_every` while
    sampling, once more as loading ends (its peak: the PSS grows while loading) and once at the end; the RSS
    every `every`."""
    calls = {True: 0, False: 0}
    pss_mib = [20]  # the tree's PSS now: it grows while the weights load

    def fake(pid: int, pss: bool = False) -> tuple[int, int]:
        calls[pss] += 1
        return 100 * 2**20, (pss_mib[0] if pss else 100) * 2**20

    monkeypatch.setattr(study, "tree_memory", fake)
    mem = study.TreeMemory(os.getpid(), every=0.005, pss=True, pss_every=3600)
    time.sleep(0.05)
    pss_mib[0] = 60
    mem.ready()
    time.sleep(0.2)
    pss_mib[0] = 70
    out = mem.result()
    assert calls[True] == 3 and calls[False] >= 10
    assert out["peak_pss_loading_gib"] == round(60 / 1024, 2)
    assert out["peak_pss_serving_gib"] == round(70 / 1024, 2) and out["peak_rss_serving_gib"] == round(100 / 1024, 2)


def test_tree_memory_reports_an_unread_peak_as_none(monkeypatch) -> None:
    """A tree gone before its PSS could be read has no PSS peak: None in the result, not 0 GiB."""
    def gone(pid: int, pss: bool = False) -> tuple[int, int]:
        raise study.psutil.NoSuchProcess(pid)

    monkeypatch.setattr(study, "tree_memory", gone)
    mem = study.TreeMemory(os.getpid(), every=0.005, pss=True)
    mem.ready()
    out = mem.result()
    assert out["peak_pss_loading_gib"] is None and out["peak_rss_serving_gib"] is None


# --- the studies ---------------------------------------------------------------------------------------------
def scripts() -> list[Path]:
    return sorted(BENCHMARKS.glob("*.py"))


def test_bench_study_lists_every_script(capsys) -> None:
    assert cli.main(["study"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    on_disk = {p.stem for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    assert listed == on_disk and len(on_disk) > 20
    assert re.search(r"^  vs_vllm +conveyor against vLLM's CPU backend", out, re.M)


def test_bench_study_refuses_an_unknown_name_and_a_missing_folder(capsys, monkeypatch, tmp_path: Path) -> None:
    assert cli.main(["study", "no_such_study"]) == 2
    assert "no study 'no_such_study'" in capsys.readouterr().err
    monkeypatch.setattr(study, "STUDIES", tmp_path / "benchmarks")
    assert cli.main(["study"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_bench_study_runs_the_script_with_its_args_and_names_the_command(monkeypatch) -> None:
    calls = []

    class Exec(Exception):
        pass

    def execve(path, argv, env):  # the study would replace this process: record what it would have been
        calls.append((path, argv, env))
        raise Exec

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/conveyor", "bench", "study", "kv_disk",
                                           "costs", "--quick"])
    with pytest.raises(Exec):
        cli.main(["study", "kv_disk", "costs", "--quick"])
    path, argv, env = calls[0]
    assert path == sys.executable and argv == [sys.executable, str(BENCHMARKS / "kv_disk.py"), "costs", "--quick"]
    assert json.loads(env[study.STUDY_ARGV_ENV]) == ["conveyor", "bench", "study", "kv_disk", "costs", "--quick"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_bench_study_passes_its_args_through() -> None:
    """The real thing once: `conveyor bench study NAME --help` is the script's own --help."""
    out = subprocess.run([sys.executable, "-m", "conveyor", "bench", "study", "noisy_neighbour_sim", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: noisy_neighbour_sim.py") and "--quiet-rate" in out.stdout


HELP_ALL = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = {}
    sys.path.insert(0, sys.argv[1])  # as `python benchmarks/x.py` has: the scripts' folder first
    for path in sys.argv[2:]:
        sys.argv = [path, "--help"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                runpy.run_path(path, run_name="__main__")
            code = "returned without exiting"
        except SystemExit as e:
            code = e.code or 0
        except BaseException as e:
            code = repr(e)
        results[path] = [code, out.getvalue()[:200]]
    print(json.dumps(results))
""")


def test_every_script_imports_and_answers_help() -> None:
    """All of benchmarks/*.py in one interpreter (torch imported once): each imports and its --help exits 0."""
    paths = [str(p) for p in scripts()]
    out = subprocess.run([sys.executable, "-c", HELP_ALL, str(BENCHMARKS), *paths], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    bad = {Path(p).name: r for p, r in results.items() if r[0] != 0 or f"usage: {Path(p).name}" not in r[1]}
    assert not bad, bad
    assert len(results) == len(paths)


# --- no private copies ---------------------------------------------------------------------------------------
# the harness's own names, and those the scripts' copies went by
OWNED = set(study.__all__) | {"pct", "percentile", "free_port", "wait_health", "wait_ready", "start_server",
                              "stop_server", "stop", "tree_rss", "rss_tree", "cpu_model", "cpu_flags_of_interest",
                              "Sampler", "machine", "write_result"}
# paths of polling a server's health and reading the CPU (as a string starts: a message may name them)
LITERALS = ("/health", "/proc/cpuinfo")


def private_copies(source: str) -> list[str]:
    """What in a script's source belongs to the harness: a function or class by one of its names, a literal it
    owns (docstrings aside), a socket bound by hand."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in OWNED:
            found.append(f"line {node.lineno}: defines {node.name}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and node.value.startswith(LITERALS)):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "bind":
            found.append(f"line {node.lineno}: binds a socket")
    return found


def test_the_check_catches_a_private_copy() -> None:
    bad = textwrap.dedent('''
        """A study. It polls /health (a docstring may say so)."""
        HELP = "seconds to wait for /health 200"
        import socket
        def pct(xs, q):
            return sorted(xs)[int(q * len(xs))]
        class TreeMemory:
            pass
        def ready(url):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
            return httpx.get(url + "/health")
        CPU = open("/proc/cpuinfo").read()
    ''')
    found = private_copies(bad)
    assert [f.split(": ", 1)[1] for f in found] == ["defines pct", "defines TreeMemory", "binds a socket",
                                                      "'/health'", "'/proc/cpuinfo'"], found
    assert private_copies('"""Polls /health."""\nfrom conveyor.bench.study import pct\nx = pct([1], 50)\n') == []


def test_no_script_keeps_a_private_copy_of_the_harness() -> None:
    found = {p.name: f for p in scripts() if (f := private_copies(p.read_text()))}
    assert not found, f"use conveyor.bench.study instead: {found}"
