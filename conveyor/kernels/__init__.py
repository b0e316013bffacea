"""Compiled CPU kernels, built on first use and cached; the pure-torch paths stay as reference and fallback.

`load()` compiles `csrc/*.cpp` with `torch.utils.cpp_extension` for this very CPU (`-march=native`),
into a cache folder whose name carries a hash of the sources, the compiler flags and the CPU's
feature flags: a machine with another CPU builds its own copy instead of loading one that could
use instructions it lacks. Without a working compiler the engine logs one line and runs the
reference path. `CONVEYOR_KERNELS=0` turns the compiled kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("conveyor.kernels")

_SRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()
_cached: ModuleType | None = None
_tried = False


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _build_dir(name: str) -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor")
    d = Path(root) / "kernels" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def load() -> ModuleType | None:
    """The compiled kernels module, or None (with one log line saying why) if it cannot be built."""
    global _cached, _tried
    if _tried:
        return _cached
    with _lock:
        if _tried:
            return _cached
        _tried = True
        if os.environ.get("CONVEYOR_KERNELS", "1") == "0":
            log.info("compiled kernels disabled by CONVEYOR_KERNELS=0: using the pure-torch reference path")
            return None
        sources = sorted(_SRC.glob("*.cpp"))
        h = hashlib.sha256()
        for src in sources + sorted(_SRC.glob("*.h")):
            h.update(src.read_bytes())
        import torch
        h.update(" ".join(_FLAGS).encode())
        h.update(cpu_flags().encode())
        h.update(torch.__version__.encode())
        name = f"conveyor_cpu_{h.hexdigest()[:16]}"
        try:
            from torch.utils.cpp_extension import load as build
            build_dir = _build_dir(name)
            if not (build_dir / f"{name}.so").exists():
                log.info("compiling the CPU kernels for this machine (once, about a minute; cached in %s)", build_dir)
            _cached = build(name=name, sources=[str(s) for s in sources], extra_cflags=_FLAGS,
                            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        except Exception as e:  # no compiler, missing headers, ...: the reference path still works
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("compiled CPU kernels unavailable (%s): using the pure-torch reference path", first[:200])
            _cached = None
        return _cached
