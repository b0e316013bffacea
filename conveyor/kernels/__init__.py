"""Compiled CPU kernels, built on first use and cached; the pure-torch paths stay as reference and fallback.

`load()` compiles `csrc/*.cpp` with `torch.utils.cpp_extension` for this very CPU (`-march=native`),
into a cache folder whose name carries a hash of the sources, the compiler flags and the CPU's
feature flags: a machine with another CPU builds its own copy instead of loading one that could
use instructions it lacks. Without a working compiler the engine logs one line and runs the
reference path. `CONVEYOR_KERNELS=0` turns the compiled kernels off.

Many processes load the kernels at once (a server and its engine process, replicas, a test suite
beside a benchmark), from more than one checkout, and some are killed mid-load. So:
- one build at a time, under an `flock` on the folder's `conveyor.lock`, which the kernel drops when
  its holder dies. torch's own lock file (`lock`, created by `cpp_extension.load` and never removed
  by a process killed while compiling) made every later load wait for it forever: an engine stuck
  in its first grammar step, seen in the test suite;
- the sources are copied into the folder and built from there, so every checkout (a CI clone, a
  work tree) has the same build commands and none rebuilds what another built;
- a finished build is marked by `built`, and is imported straight from its `.so`, without torch's
  lock or a ninja run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator
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
        files = sorted(_SRC.glob("*.cpp")) + sorted(_SRC.glob("*.h"))
        h = hashlib.sha256()
        for src in files:
            h.update(src.read_bytes())
        import torch
        h.update(" ".join(_FLAGS).encode())
        h.update(cpu_flags().encode())
        h.update(torch.__version__.encode())
        name = f"conveyor_cpu_{h.hexdigest()[:16]}"
        try:
            build_dir = _build_dir(name)
            with _build_lock(build_dir):
                _cached = _import_built(name, build_dir) or _build(name, build_dir, files)
        except Exception as e:  # no compiler, missing headers, ...: the reference path still works
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("compiled CPU kernels unavailable (%s): using the pure-torch reference path", first[:200])
            _cached = None
        return _cached


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold `build_dir/conveyor.lock` exclusively: an flock, so a holder that dies releases it."""
    import fcntl

    with open(build_dir / "conveyor.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The module of a build that finished (`built` is written after it), else None."""
    so = build_dir / f"{name}.so"
    if not ((build_dir / "built").exists() and so.exists()):
        return None
    import importlib.util

    import torch  # noqa: F401 - the extension links against libtorch, which must be loaded first

    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, build_dir: Path, files: list[Path]) -> ModuleType:
    """Compile `files` (copied into `build_dir/src` first) into `build_dir`; called under `_build_lock`."""
    from torch.utils.cpp_extension import load as build

    (build_dir / "built").unlink(missing_ok=True)
    (build_dir / "lock").unlink(missing_ok=True)  # torch's lock file: stale, since we hold the build lock
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for f in files:
        shutil.copyfile(f, src / f.name)
    from conveyor import startup

    startup.phase(startup.COMPILING_KERNELS)
    log.info("compiling the CPU kernels for this machine (once, about a minute; cached in %s)", build_dir)
    module = build(name=name, sources=[str(src / f.name) for f in files if f.suffix == ".cpp"],
                   extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    (build_dir / "built").write_text(name + "\n")
    return module
