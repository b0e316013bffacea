"""Compiled CPU kernels; the pure-torch paths stay as reference and fallback.

Installed builds (`pip install -e .`, a wheel): setup.py compiled the kernels at install time into one
library per instruction-set variant (`_cpu_avx512bf16`, `_cpu_avx512`, `_cpu_avx2`, `_cpu_generic`: see
variants.py) plus the torch bindings (`_C`). `load()` imports `_C` and has it load the most capable variant
this CPU runs (or the one `CONVEYOR_CPU_VARIANT` names): no compiler at run time, and one wheel runs on any
x86-64 CPU. A build made from other sources than the ones beside it (an editable install whose csrc/ was
edited since) is not used.

Without an installed build (a source tree on PYTHONPATH, an edited csrc/), `load()` compiles the same sources
on first use for this very CPU (`-march=native`), into a cache folder whose name carries a hash of the
sources, the compiler flags and the CPU's feature flags: a machine with another CPU builds its own copy
instead of loading one that could use instructions it lacks. It says so, and how long it took. Without a
working compiler the engine logs one line and runs the reference path. `CONVEYOR_KERNELS=0` turns the
compiled kernels off; `CONVEYOR_KERNELS=jit` skips the installed build.

Many processes load the JIT build at once (a server and its engine process, replicas, a test suite
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
import importlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from conveyor.kernels import variants

log = logging.getLogger("conveyor.kernels")

_SRC = Path(__file__).parent / "csrc"
JIT_VARIANT = "native"
# -fopenmp: at::parallel_for in the bindings is ATen's inline OpenMP loop; without it every kernel runs on one thread
_FLAGS = ["-O3", "-march=native", "-fopenmp", f"-DCONVEYOR_VARIANT={JIT_VARIANT}",
          f"-DCONVEYOR_BUILTIN_VARIANT={JIT_VARIANT}"]
_lock = threading.Lock()
_cached: ModuleType | None = None
_tried = False
_variant_paths: dict[str, str] = {}  # installed build: variant name -> its library, most capable first


def source_files() -> list[Path]:
    """Every kernel source and header (what a build is made from)."""
    return sorted(_SRC.glob("*.cpp")) + sorted(_SRC.glob("*.h"))


def source_hash() -> str:
    """What setup.py stamps into `_C` and the JIT cache folder's name is made of."""
    h = hashlib.sha256()
    for src in source_files():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def cpu_flags() -> str:
    """This CPU's flags as one string (what the JIT build's name hashes), or its name where it lists none."""
    from conveyor.kernels.variants import cpu_info

    info = cpu_info()
    return " ".join(info.flags) if info.flags else info.model


def jit_build_name() -> str:
    """The first-use build's name (and cache folder): these sources, flags, CPU and torch version."""
    import torch

    h = hashlib.sha256(source_hash().encode())
    h.update(" ".join(_FLAGS).encode())
    h.update(cpu_flags().encode())
    h.update(torch.__version__.encode())
    return f"conveyor_cpu_{h.hexdigest()[:16]}"


def jit_cache_dir() -> Path:
    """Where the first-use build of these sources for this CPU is (or would be) cached."""
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor")
    return Path(root) / "kernels" / jit_build_name()


def _build_dir(name: str) -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor")
    d = Path(root) / "kernels" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def load() -> ModuleType | None:
    """The compiled kernels module, or None (with one log line saying why) if there is none and it cannot be built."""
    global _cached, _tried
    if _tried:
        return _cached
    with _lock:
        if _tried:
            return _cached
        _tried = True
        mode = os.environ.get("CONVEYOR_KERNELS", "1")
        if mode == "0":
            log.info("compiled kernels disabled by CONVEYOR_KERNELS=0: using the pure-torch reference path")
            return None
        import torch  # noqa: F401 - the extensions link against libtorch, which must be loaded first

        if mode != "jit":
            _cached = _load_installed()
            if _cached is not None:
                return _cached
        files = source_files()
        name = jit_build_name()
        try:
            build_dir = _build_dir(name)
            with _build_lock(build_dir):
                _cached = _import_built(name, build_dir) or _build(name, build_dir, files)
        except Exception as e:  # no compiler, missing headers, ...: the reference path still works
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("compiled CPU kernels unavailable (%s): using the pure-torch reference path", first[:200])
            _cached = None
        return _cached


def _load_installed() -> ModuleType | None:
    """The build `pip install` made (setup.py), with the variant for this CPU loaded; None if there is none,
    or if it was built from other sources than the ones beside it."""
    try:
        module = importlib.import_module("conveyor.kernels._C")
    except ImportError as e:
        log.debug("no installed kernel build (%s)", e)
        return None
    if _SRC.is_dir() and getattr(module, "source_hash", lambda: "")() != source_hash():
        log.warning("the installed CPU kernels were built from other sources than %s (edited since `pip install`?): "
                    "not using them; `pip install -e .` rebuilds them", _SRC)
        return None
    paths = {}
    for v in variants.variants_for_this_platform():
        spec = importlib.util.find_spec(f"conveyor.kernels._cpu_{v.name}")
        if spec is not None and spec.origin:
            paths[v.name] = spec.origin
    if not paths:
        log.warning("the installed kernel bindings have no variant library beside them; not using them")
        return None
    name, why = variants.choose(list(paths))
    (log.warning if "CONVEYOR_CPU_VARIANT=" in why else log.info)(
        "CPU kernels: the %s variant (%s; installed: %s)", name, why, ", ".join(paths))
    module.load_variant(paths[name])
    _variant_paths.clear()
    _variant_paths.update(paths)
    return module


def installed_variants() -> list[str]:
    """The variants of the installed build that this CPU runs, most capable first ([] under the JIT build)."""
    return variants.runnable(list(_variant_paths))


def use_variant(name: str) -> None:
    """Run the kernels of another installed variant from now on (benchmarks and tests compare them; a
    server picks one at load, by CPU or CONVEYOR_CPU_VARIANT). Not safe while a step runs."""
    module = load()
    if module is None or name not in _variant_paths:
        raise ValueError(f"kernel variant {name!r} is not installed (installed: {', '.join(_variant_paths) or 'none'})")
    if name not in installed_variants():
        raise ValueError(f"this CPU cannot run the {name} kernels")
    module.load_variant(_variant_paths[name])


def variant() -> str | None:
    """The variant the kernels run ("native" for the first-use build), or None without kernels."""
    module = load()
    return None if module is None else module.variant()


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

    from conveyor import startup

    (build_dir / "built").unlink(missing_ok=True)
    (build_dir / "lock").unlink(missing_ok=True)  # torch's lock file: stale, since we hold the build lock
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for f in files:
        shutil.copyfile(f, src / f.name)
    kernel_files = [f for f in files if f.suffix == ".cpp" and f.name not in ("bindings.cpp", "variant_table.cpp")]
    (src / "kernel_files.h").write_text("".join(f"CONVEYOR_KERNEL_FILE({f.stem})\n" for f in kernel_files))
    startup.phase(startup.COMPILING_KERNELS)
    cores = os.cpu_count() or 1
    # ~45 s of compiler time, most of it the torch bindings and paged attention, two compiles at a time (ninja);
    # measured 95 s on a 2-core machine whose load average was 6 (docs/startup.md)
    estimate = 45 // min(cores, 2) + 10
    log.warning("compiling the CPU kernels for this machine: no build was installed with the package (`pip install "
                "-e .` makes one). One time, about %d s on %d idle cores, longer on a busy machine; cached in %s",
                estimate, cores, build_dir)
    t0 = time.monotonic()
    done = threading.Event()

    def progress() -> None:
        while not done.wait(15.0):
            log.warning("still compiling the CPU kernels (%.0f s so far)", time.monotonic() - t0)

    threading.Thread(target=progress, name="conveyor-kernel-build-progress", daemon=True).start()
    try:
        module = build(name=name, sources=[str(src / f.name) for f in files if f.suffix == ".cpp"],
                       extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(src)], build_directory=str(build_dir), verbose=False)
    finally:
        done.set()
    log.warning("compiled the CPU kernels in %.0f s", time.monotonic() - t0)
    (build_dir / "built").write_text(name + "\n")
    return module
