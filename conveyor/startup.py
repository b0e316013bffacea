"""What a starting engine is doing right now, for whoever waits on it (the server's `/health`, a progress line).

Loading takes from a second (the tiny test model) to minutes (weights from a slow disk, a first
kernel compile, faulting a large KV pool in), and a load balancer, a Kubernetes probe or a person
at a terminal needs to know it is progressing and where. The engine's constructor and the parts
it calls say `phase("loading weights")` etc. as they go; the server reads `progress.snapshot()`.

One process-wide record, because the steps that report are deep in the stack (the kernel build, the
KV pool) and a process loads one engine at a time in practice; several engines loading at once
(tests) only make the reported phase less precise, never wrong about being loading.
No imports beyond the standard library: the server reads it before torch is imported. Also here: what a
long-running process does once it is up (`freeze_startup_heap`, `dump_stacks_on_sigusr1`), for the server
and the engine process alike.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

LOADING_WEIGHTS = "loading weights"
COMPILING_KERNELS = "compiling kernels"
ALLOCATING_KV = "allocating the KV pool"
FILLING_KV = "filling the KV pool"
WARMING_UP = "warming up"
STARTING = "starting"


@dataclass(frozen=True)
class Phase:
    name: str
    started: float  # time.monotonic() at the phase's start
    detail: str = ""


class StartupProgress:
    """The current phase, set by the loading thread and read by any other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = Phase(STARTING, time.monotonic())
        # told every new phase (an engine process forwards its own to the server); never allowed to fail a load
        self.listeners: list[Callable[[Phase], None]] = []

    def set(self, name: str, detail: str = "") -> None:
        ph = Phase(name, time.monotonic(), detail)
        with self._lock:
            self._phase = ph
        for listener in list(self.listeners):
            with contextlib.suppress(Exception):
                listener(ph)

    def current(self) -> Phase:
        with self._lock:
            return self._phase


progress = StartupProgress()


def phase(name: str, detail: str = "") -> None:
    """Say that loading has entered `name` (one of the constants above, or a short free text)."""
    progress.set(name, detail)


@contextlib.contextmanager
def loading_progress(desc: str, enabled: bool = True, interval_s: float = 0.25) -> Iterator[None]:
    """A tqdm line on stderr while the block loads an engine on this thread: the phase it is in and the time so
    far (`Loading smollm2-135m: loading weights [00:03]`), then how long the whole load took. A watcher thread
    draws it, since the loading thread is busy (and must be the one that builds the model)."""
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {postfix} [{elapsed}]", file=sys.stderr,
               dynamic_ncols=True)
    progress.set(STARTING)
    done = threading.Event()

    def watch() -> None:
        shown = None
        while not done.wait(interval_s):
            ph = progress.current()
            if ph.name != shown:
                shown = ph.name
                bar.set_postfix_str(ph.name, refresh=False)
            bar.refresh()

    watcher = threading.Thread(target=watch, name="conveyor-load-progress", daemon=True)
    watcher.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        watcher.join()
        bar.set_postfix_str("ready" if ok else "failed", refresh=False)
        bar.close()


# --- a serving process, once it is up ------------------------------------------------------------
def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` writes every thread's Python stack to stderr (the log): how to see where a server
    or its engine process is stuck without stopping it."""
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)


def freeze_startup_heap() -> int:
    """Move every object alive now (the model's modules, torch, FastAPI, the tokenizer: everything a
    server builds at startup and keeps) out of the garbage collector's sight; returns how many.

    Why: a full (generation 2) collection walks every tracked object, and a loaded server holds a
    few hundred thousand; each one stopped every thread for 56-100 ms, measured from `gc.callbacks`
    in a serving process, and those pauses were the quiet tenant's worst TTFTs beside a noisy one
    (docs/fairness.md). Objects made afterwards (requests, steps) are collected as before; what is
    frozen is never freed by the collector (only by reference counting), so this is for a process
    that serves until it exits (`conveyor serve`, the engine process), not for a library caller."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
