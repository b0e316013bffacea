"""What a starting engine is doing right now, for whoever waits on it (the server's `/health`, a progress line).

Loading takes from a second (the tiny test model) to minutes (weights from a slow disk, a first
kernel compile, faulting a large KV pool in), and a load balancer, a Kubernetes probe or a person
at a terminal needs to know it is progressing and where. The engine's constructor and the parts
it calls say `phase("loading weights")` etc. as they go; the server reads `progress.snapshot()`.

One process-wide record, because the steps that report are deep in the stack (the kernel build, the
KV pool) and a process loads one engine at a time in practice; several engines loading at once
(tests) only make the reported phase less precise, never wrong about being loading.
No imports beyond the standard library: the server reads it before torch is imported.
"""

from __future__ import annotations

import threading
import time
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

    def set(self, name: str, detail: str = "") -> None:
        with self._lock:
            self._phase = Phase(name, time.monotonic(), detail)

    def current(self) -> Phase:
        with self._lock:
            return self._phase


progress = StartupProgress()


def phase(name: str, detail: str = "") -> None:
    """Say that loading has entered `name` (one of the constants above, or a short free text)."""
    progress.set(name, detail)
