"""The studies' harness: what every script in benchmarks/ shares, written once.

A *study* is a runnable script in `benchmarks/` beside this package (`conveyor bench study` lists them,
`conveyor bench study NAME [ARGS...]` runs one; `python benchmarks/NAME.py` is the same). The lab's library is
`conveyor/bench/`; this module is the part of it the studies stand on:

- `pct`: the percentile the studies report (`stats.percentile`'s `rank` method: a sample that occurred);
- `free_port`, `wait_health` and `Server`: a server subprocess (conveyor's, vLLM's, llama.cpp's) as a context
  manager that waits for `GET /health` 200 and ends its whole process tree on exit;
- `lab_run`: the lab's HTTP client (`conveyor bench run --url`) as a process of its own, its result read back;
- `Neighbours`: CPU-bound processes beside a measurement, a busy machine on purpose;
- `TreeMemory`: the resident memory of a process tree, sampled in a thread;
- `best_ms`: a callable's best time;
- `machine()`: what the numbers were measured on (CPU model and the flags that decide the kernels, cores,
  RAM, load, torch's version, the checkout's commit);
- `Study`: the one result format, a JSON document written by `Study.write`:

      {"study": NAME, "command": [the exact argv that ran it], "machine": {...},
       "started": UTC, "finished": UTC (null while a study is still writing partial results),
       "results": the study's own payload}

  and `read_result`, which gives a result file's payload back (a file written before this format: the whole
  file), so a study that re-reads its output (`--report-only`) takes both.

Nothing here imports torch: `--help` of every study stays fast.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from conveyor.bench.stats import percentile
from conveyor.kernels.decisions import FLAGS_OF_INTEREST
from conveyor.kernels.variants import cpu_info, cpu_name

__all__ = ["STUDIES", "STUDY_ARGV_ENV", "Neighbours", "Server", "Study", "TreeMemory", "best_ms", "cpu_flags",
           "cpu_name", "describe", "free_port", "git_commit", "is_result", "lab_run", "lab_run_command", "load_avg",
           "machine", "pct", "read_result", "studies", "tree_memory", "utc_now", "wait_health"]

GiB = 2**30
# set by `conveyor bench study` for the study it starts: the command the user typed, which the result records.
# Taken out of the environment on import, so the processes a study starts do not inherit it as theirs.
STUDY_ARGV_ENV = "CONVEYOR_STUDY_ARGV"
_TYPED_ARGV = os.environ.pop(STUDY_ARGV_ENV, None)
REPO = Path(__file__).resolve().parents[2]


# --- numbers -------------------------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float | None:
    """The studies' percentile, q in percent: the sorted samples' element at index floor(q/100 * n), None for
    none (`stats.percentile(values, q, "rank")`)."""
    return percentile(values, q, "rank")


def best_ms(fn: Callable[[], object], n: int = 20, calls: int = 1) -> float:
    """Milliseconds per call of `fn`: the best of `n` rounds of `calls` calls, after one warm-up call (a
    shared machine's noise only ever slows a call down)."""
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


# --- the machine ---------------------------------------------------------------------------------------------
def cpu_flags(names: Sequence[str] = FLAGS_OF_INTEREST) -> list[str]:
    """The CPU's flags among `names` (default: those that decide which kernels run fast here), in
    /proc/cpuinfo's order."""
    wanted = set(names)
    return [f for f in cpu_info().flags if f in wanted]


def load_avg() -> list[float]:
    return list(os.getloadavg())


def git_commit(repo: Path = REPO) -> str | None:
    """The checkout's commit, with `+dirty` when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _torch_version() -> str | None:
    """torch's version without importing it (importing takes seconds)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What a result was measured on: the CPU, its kernel-deciding flags, cores, RAM, the load, the software."""
    import platform

    mem = psutil.virtual_memory()
    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "ram_gib": round(mem.total / GiB, 1), "available_gib": round(mem.available / GiB, 1),
            "load_avg": load_avg(), "python": platform.python_version(), "torch": _torch_version(),
            "git_commit": git_commit()}


# --- the one result format -----------------------------------------------------------------------------------
def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _argv() -> list[str]:
    """The command that ran this process: what `conveyor bench study` was given, else this interpreter's own
    argv as typed (`sys.orig_argv`: `python benchmarks/x.py --flag`)."""
    if _TYPED_ARGV:
        try:
            return list(json.loads(_TYPED_ARGV))
        except ValueError:
            pass
    return list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


class Study:
    """One run of a study: its name, the command that ran it, the machine, when it started. `write` puts a
    payload in the one result format; call it as often as partial results come (`final=False` leaves
    "finished" null), the last time with `final=True`."""

    def __init__(self, name: str | None = None, argv: Sequence[str] | None = None) -> None:
        self.name = name or Path(sys.argv[0]).stem
        self.command = list(argv) if argv is not None else _argv()
        self.started = utc_now()
        self.machine = machine()  # at the start: the load average before the study adds its own

    def document(self, results: Any, final: bool = True) -> dict[str, Any]:
        return {"study": self.name, "command": self.command, "machine": self.machine, "started": self.started,
                "finished": utc_now() if final else None, "results": results}

    def dumps(self, results: Any, final: bool = True, indent: int | None = 1) -> str:
        return json.dumps(self.document(results, final), indent=indent, default=str)

    def write(self, path: str | os.PathLike, results: Any, final: bool = True, indent: int | None = 1) -> Path:
        """Write the document to `path` (its folder made if missing), atomically: a reader never sees half."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.dumps(results, final, indent) + "\n")
        tmp.replace(path)
        return path

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)


def is_result(doc: Any) -> bool:
    return isinstance(doc, dict) and {"study", "command", "machine", "results"} <= doc.keys()


def read_result(path: str | os.PathLike) -> Any:
    """A result file's payload: `results` of the one format, or the whole of a file written before it."""
    doc = json.loads(Path(path).read_text())
    return doc["results"] if is_result(doc) else doc


# --- servers -------------------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen | None = None, timeout: float = 600.0, poll_s: float = 0.1,
                on_answer: Callable[[httpx.Response], None] | None = None, request_timeout: float = 5.0) -> float:
    """Poll `url`/health every `poll_s` until it answers 200; the `time.monotonic()` of that answer.

    Raises if `proc` (the server's process, when it is one) exits first, or after `timeout` seconds.
    `on_answer` sees every answer, 503s ("loading", "restarting") included."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health answered 200")
        try:
            r = httpx.get(url + "/health", timeout=request_timeout)
        except httpx.HTTPError:
            r = None
        if r is not None:
            if on_answer is not None:
                on_answer(r)
            if r.status_code == 200:
                return time.monotonic()
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout:g} s")
        time.sleep(poll_s)


BOUND = re.compile(r"bound \S+:(\d+); serving there")  # `conveyor serve --port 0` says where it listens


class Server:
    """A server subprocess for a study, started in a session of its own, its output into `log`.

    `port`: where it listens (a `free_port()` the caller put in `cmd`), or 0: `cmd` is a `conveyor serve
    --port 0`, and the port is read from its log ("bound HOST:PORT; serving there").
    As a context manager: started and ready (`/health` 200) on entry, stopped on exit. `stop()` sends SIGTERM
    (to the whole process group with `term_group`, for servers whose children must see it too: vLLM's engine
    core), waits `stop_timeout` seconds, then SIGKILLs whatever is left of the tree and the group."""

    def __init__(self, cmd: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, log: IO | str | os.PathLike | None = None,
                 ready_timeout: float = 600.0, poll_s: float = 0.1, stop_timeout: float = 60.0,
                 term_group: bool = False, host: str = "127.0.0.1") -> None:
        self.cmd, self.env, self.cwd = [str(c) for c in cmd], env, cwd
        self.port = port
        self.host = host
        self.ready_timeout, self.poll_s, self.stop_timeout, self.term_group = (ready_timeout, poll_s, stop_timeout,
                                                                                term_group)
        self._own_log = log is None or isinstance(log, (str, os.PathLike))
        if log is None:
            import tempfile

            log = tempfile.NamedTemporaryFile("w+", prefix="study-server-", suffix=".log", delete=False)  # noqa: SIM115
        elif isinstance(log, (str, os.PathLike)):
            log = open(log, "a+")  # noqa: SIM115 - closed in stop()
        self.log: IO = log
        self.proc: subprocess.Popen | None = None
        self.started: float | None = None  # time.monotonic() just before the process was started
        self.bound_s: float | None = None  # port=0: seconds from the start to the log naming the port
        self.ready_s: float | None = None  # seconds from the start to /health 200
        self._log_from = 0

    @property
    def log_path(self) -> str | None:
        name = getattr(self.log, "name", None)
        return name if isinstance(name, str) else None

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the server's port is not known yet (wait_bound)")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Server:
        self.log.flush()
        self._log_from = os.fstat(self.log.fileno()).st_size  # this server's lines only (a log may be shared)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        return self

    def log_text(self) -> str:
        """What this server has written to the log so far."""
        fd = self.log.fileno()
        try:
            data = os.pread(fd, max(0, os.fstat(fd).st_size - self._log_from), self._log_from)
        except OSError:  # a log opened for writing only: read it by its name
            if self.log_path is None:
                return ""
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                data = f.read()
        return data.decode(errors="replace")

    def wait_bound(self, timeout: float | None = None) -> str:
        """The server's URL, once known (`port=0`: once its log names the port)."""
        assert self.proc is not None and self.started is not None, "start() first"
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.port:
            m = BOUND.search(self.log_text())
            if m:
                self.port, self.bound_s = int(m.group(1)), time.monotonic() - self.started
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it listened")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server named no port within {limit:g} s")
            time.sleep(min(self.poll_s, 0.05))
        return self.url

    def wait_ready(self, timeout: float | None = None, on_answer: Callable[[httpx.Response], None] | None = None,
                   log_tail: int = 3000) -> float:
        """Seconds from the start to `/health` 200. Raises if the server exits first or after `timeout`, the
        error naming the log and quoting its last `log_tail` characters."""
        assert self.started is not None, "start() first"
        timeout = self.ready_timeout if timeout is None else timeout
        try:
            self.wait_bound(timeout)
            left = timeout - (time.monotonic() - self.started)
            self.ready_s = wait_health(self.url, self.proc, left, self.poll_s, on_answer) - self.started
            return self.ready_s
        except (RuntimeError, TimeoutError) as e:
            tail = f", its end:\n{self.log_text()[-log_tail:]}" if log_tail else ""
            raise type(e)(f"{e} (the server's log: {self.log_path}{tail})") from e

    def stop(self) -> int | None:
        """SIGTERM, `stop_timeout` seconds, then SIGKILL to what is left of the tree; the exit code."""
        proc = self.proc
        if proc is None:
            return None
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.term_group:
                os.killpg(proc.pid, signal.SIGTERM)
            elif proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.stop_timeout)
        for p in tree:  # children that outlived the server (an engine, a Ray worker)
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # and anything else of its session
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        if self._own_log:
            self.log.close()
        return code

    def up(self) -> Server:
        """Started and ready (`ready_s`), or stopped and the error raised."""
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Server:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- clients and neighbours ----------------------------------------------------------------------------------
def lab_run_command(url: str, flags: Sequence[str], out: str | os.PathLike) -> list[str]:
    """`conveyor bench run --url URL FLAGS --out OUT`: the lab's HTTP client, as a command of its own."""
    return [sys.executable, "-m", "conveyor", "bench", "run", "--url", url, *flags, "--out", str(out)]


def lab_run(url: str, flags: Sequence[str], out: str | os.PathLike, **popen: Any) -> dict[str, Any]:
    """One run of the lab's HTTP client against `url` in a process of its own (its CPU is not the server's or
    the study's); the result it wrote to `out` (`RunResult.to_json`'s shape). `popen`: `subprocess.run`'s
    keywords (stdout, stderr, env); stdout is dropped unless given."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    subprocess.run(lab_run_command(url, flags, out), check=True, **popen)
    return json.loads(Path(out).read_text())


class Neighbours:
    """`n` CPU-bound processes (`python -c "while True: pass"`) beside what runs in the `with` block: a busy
    machine on purpose. `settle_s`: seconds to wait after they start (for a server to notice its lost cores)."""

    def __init__(self, n: int, settle_s: float = 0.0) -> None:
        self.n, self.settle_s, self.procs = n, settle_s, []

    def __enter__(self) -> Neighbours:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        if self.n and self.settle_s:
            time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


# --- memory --------------------------------------------------------------------------------------------------
def tree_memory(pid: int, pss: bool = False) -> tuple[int, int]:
    """(RSS, PSS) bytes of a process and every descendant, summed. PSS (pages shared between the tree's
    processes counted once) only with `pss` (reading it walks /proc/PID/smaps: slower); else it is the RSS."""
    root = psutil.Process(pid)
    rss = pss_sum = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            if pss:
                full = p.memory_full_info()
                rss += full.rss
                pss_sum += getattr(full, "pss", full.rss)
            else:
                rss += p.memory_info().rss
        except psutil.Error:
            pass
    return rss, (pss_sum if pss else rss)


class TreeMemory(threading.Thread):
    """Samples a process tree's memory (`tree_memory`) in a thread started here: the RSS every `every` seconds,
    the PSS at most every `pss_every` seconds; the last RSS, and the peaks while loading (until `ready()`) and
    while serving.

    Why PSS so rarely: reading it walks every page of the tree's mappings (/proc/PID/smaps). For a 1B model's
    server (a 9.4 GiB KV pool) that took 46-67 ms a call: every 0.25 s, a quarter of a core or more taken beside
    the server being measured, on a 2-core machine (docs/performance.md, 2026-12-06, fifth). The RSS
    (/proc/PID/statm) costs ~2 ms a tree."""

    def __init__(self, pid: int, every: float = 0.25, pss: bool = True, pss_every: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.pss, self.pss_every, self.t0 = pid, every, pss, pss_every, time.monotonic()
        self.ready_s: float | None = None
        self.last_rss = 0
        self.peak = {"loading": [0, 0], "serving": [0, 0]}  # phase -> [rss, pss] bytes
        self._done = threading.Event()  # not _stop: threading.Thread has its own
        self._pss_at = -math.inf  # when the PSS was last read
        self.start()

    def ready(self) -> None:
        """Ends the loading phase, reading its PSS once more first: a server that is ready in less than
        `pss_every` would otherwise keep only the PSS of its first instant (a few MiB) as the loading peak."""
        if self.pss:
            self._read_pss_into(self.peak["loading"])
        self.ready_s = time.monotonic() - self.t0

    @property
    def peak_rss(self) -> int:
        return max(v[0] for v in self.peak.values())

    def _phase_peak(self) -> list[int]:
        """[rss, pss] peaks of the phase now: loading until `ready()`, then serving."""
        return self.peak["loading" if self.ready_s is None else "serving"]

    def run(self) -> None:
        while True:
            now = time.monotonic()
            with_pss = self.pss and now - self._pss_at >= self.pss_every
            try:
                rss, pss = tree_memory(self.pid, with_pss)
            except psutil.Error:  # not there (yet, or any more)
                rss = pss = 0
            if rss:
                self.last_rss = rss
                peak = self._phase_peak()
                peak[0] = max(peak[0], rss)
                if with_pss or not self.pss:  # without PSS, tree_memory's PSS is the RSS
                    self._pss_at = now
                    peak[1] = max(peak[1], pss)
            if self._done.wait(self.every):
                return

    def result(self) -> dict[str, Any]:
        """Stops sampling: the time to ready and each phase's peaks in GiB (the PSS read once more now, the
        measured work being over)."""
        self._done.set()
        self.join(10)
        if self.pss:
            self._read_pss_into(self._phase_peak())
        # a peak never read (the tree gone before it could be) is None, not 0 GiB
        return {"ready_s": self.ready_s, **{f"peak_{kind}_{phase}_gib": round(v[i] / GiB, 2) if v[i] else None
                                            for phase, v in self.peak.items() for i, kind in enumerate(("rss", "pss"))}}

    def _read_pss_into(self, peak: list[int]) -> None:
        """One PSS read, outside the sampling rhythm, into a phase's [rss, pss] peaks."""
        try:
            _, pss = tree_memory(self.pid, True)
        except psutil.Error:  # the tree is gone
            return
        peak[1] = max(peak[1], pss)


# --- the studies ---------------------------------------------------------------------------------------------
STUDIES = REPO / "benchmarks"  # beside the package in a source checkout; absent from an installed wheel


def _summary(lines: list[str]) -> str:
    """The first paragraph of a docstring or comment block, as one line."""
    para: list[str] = []
    for line in lines:
        if not line.strip():
            if para:
                break
            continue
        para.append(line.strip())
    return " ".join(para)


def describe(path: Path) -> str:
    """A study's one-line description: its docstring's (a .py) or its header comment's (a .sh) first paragraph."""
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        import ast

        return _summary((ast.get_docstring(ast.parse(text)) or "").splitlines())
    comments = []
    for line in text.splitlines()[1:]:  # after the shebang
        if not line.startswith("#"):
            break
        if not line.startswith("#  "):  # not a usage line
            comments.append(line.lstrip("#"))
    return _summary(comments)


def studies(folder: Path = STUDIES) -> dict[str, Path]:
    """name -> script: every benchmarks/*.py and *.sh (a .py wins over a .sh of the same name)."""
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.sh")) + sorted(folder.glob("*.py")):
        if not path.name.startswith("_"):
            found[path.stem] = path
    return dict(sorted(found.items()))
