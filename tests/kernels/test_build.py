"""The installed build loads the variant this CPU runs (or the one CONVEYOR_CPU_VARIANT names); the first-use
build (CONVEYOR_KERNELS=jit, or no installed build) caches its result; without a working compiler the kernels
are skipped with one clear log line, and attention falls back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import logging, torch
logging.basicConfig(level=logging.INFO)
import conveyor
from conveyor import kernels
from conveyor.model.attention import choose_backend
print("package:", conveyor.__file__)
print("module:", kernels.load())
print("backend:", choose_backend("auto", torch.device("cpu"), torch.bfloat16, 9, 3, 64))
print("variant:", kernels.variant())
"""


def run_probe(tmp_path, cwd=None, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, CONVEYOR_CACHE=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=full,
                          cwd=cwd)


def installed() -> list[str]:
    from conveyor import kernels

    kernels.load()
    return kernels.installed_variants()


def test_no_compiler_falls_back_to_the_reference(tmp_path):
    proc = run_probe(tmp_path, CXX="/bin/false", CC="/bin/false", CONVEYOR_KERNELS="jit")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "module: None" in proc.stdout and "backend: torch" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "compiled CPU kernels unavailable" in line]
    assert len(warnings) == 1, proc.stderr[-2000:]


def test_kernels_can_be_turned_off(tmp_path):
    proc = run_probe(tmp_path, CONVEYOR_KERNELS="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "module: None" in proc.stdout and "backend: torch" in proc.stdout
    assert "CONVEYOR_KERNELS=0" in proc.stderr


def built_cache(tmp_path) -> tuple[str, os.PathLike]:
    """A copy of this machine's finished kernel build in a cache folder of its own: (name, folder)."""
    import shutil
    from pathlib import Path

    from conveyor import kernels

    module = kernels.load()
    if module is None:
        pytest.skip("no compiled kernels on this machine")
    if kernels.variant() != kernels.JIT_VARIANT:  # the installed build: find this machine's first-use build
        src = kernels.jit_cache_dir()
        if not (src / "built").exists():
            pytest.skip("no first-use (JIT) build of these sources in this machine's cache (the installed one is used)")
    else:
        src = Path(module.__file__).parent
    dst = tmp_path / "cache" / "kernels" / src.name
    dst.mkdir(parents=True)
    for f in (f"{src.name}.so", "built"):
        shutil.copy2(src / f, dst / f)
    return src.name, dst


def test_a_stale_torch_lock_file_does_not_block_loading(tmp_path):
    """torch's build lock (a plain file, left behind by a process killed while compiling) made every later
    load wait forever: a server's engine hung in its first grammar step. A finished build is imported
    without it."""
    name, folder = built_cache(tmp_path)
    (folder / "lock").touch()
    proc = run_probe(tmp_path / "cache", CXX="/bin/false", CONVEYOR_KERNELS="jit")  # and nothing is compiled again
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"module: <module '{name}'" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "compiling" not in proc.stderr


def test_another_checkout_uses_the_same_build(tmp_path):
    """Sources are built from a copy inside the cache folder, so a second checkout of the same code (a CI
    clone beside a work tree) imports what the first built instead of rebuilding it."""
    import shutil
    from pathlib import Path

    import conveyor

    name, _ = built_cache(tmp_path)
    shutil.copytree(Path(conveyor.__file__).parent, tmp_path / "checkout" / "conveyor",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = run_probe(tmp_path / "cache", cwd=tmp_path / "checkout", CXX="/bin/false", CONVEYOR_KERNELS="jit")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"package: {tmp_path / 'checkout' / 'conveyor'}" in proc.stdout, proc.stdout
    assert f"module: <module '{name}'" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_the_installed_build_runs_the_best_variant_or_the_one_asked_for(tmp_path):
    variants = installed()
    if not variants:
        pytest.skip("no installed kernel build (pip install -e . makes one)")
    proc = run_probe(tmp_path, CXX="/bin/false")  # nothing to compile: the installed build is used
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"variant: {variants[0]}" in proc.stdout and "backend: kernel" in proc.stdout, proc.stdout
    assert "compiling" not in proc.stderr
    proc = run_probe(tmp_path, CXX="/bin/false", CONVEYOR_CPU_VARIANT=variants[-1])
    assert f"variant: {variants[-1]}" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_the_variant_is_the_most_capable_the_cpu_runs(monkeypatch):
    from conveyor.kernels import variants

    built = ["avx512bf16", "avx512", "avx2", "generic"]
    zen3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "cx16", "lahf_lm", "popcnt",
            "pni", "sse4_1", "sse4_2", "ssse3"}
    skylake_sp = zen3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    monkeypatch.delenv("CONVEYOR_CPU_VARIANT", raising=False)
    assert variants.choose(built, zen3)[0] == "avx2"
    assert variants.choose(built, skylake_sp)[0] == "avx512"
    assert variants.choose(built, skylake_sp | {"avx512_bf16", "avx512_vnni"})[0] == "avx512bf16"
    assert variants.choose(built, {"sse2"})[0] == "generic"
    monkeypatch.setenv("CONVEYOR_CPU_VARIANT", "generic")
    assert variants.choose(built, skylake_sp) == ("generic", "CONVEYOR_CPU_VARIANT")
    monkeypatch.setenv("CONVEYOR_CPU_VARIANT", "avx512bf16")  # not on this CPU: never forced into SIGILL
    name, why = variants.choose(built, zen3)
    assert name == "avx2" and "needs instructions this CPU lacks" in why
    monkeypatch.setenv("CONVEYOR_CPU_VARIANT", "z80")
    name, why = variants.choose(built, zen3)
    assert name == "avx2" and "z80 is not built" in why


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: nothing to run in parallel")
def test_kernels_run_on_every_thread_of_torchs_pool():
    """The kernels' parallel loop (the bindings' at::parallel_for) uses torch's threads: a build that drops
    OpenMP (no -fopenmp on the bindings) compiles the loop serially and every kernel ran on one core."""
    import torch

    from conveyor import kernels

    ops = kernels.load()
    if ops is None:
        pytest.skip("no compiled kernels here")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.parallel_threads_used(64) == 2
        torch.set_num_threads(1)
        assert ops.parallel_threads_used(64) == 1
    finally:
        torch.set_num_threads(before)
