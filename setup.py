"""Builds the CPU kernels at install time (`pip install -e .`, `python -m build`).

Two kinds of extension modules under conveyor/kernels/:
- `_cpu_<variant>` (one per instruction-set variant, conveyor/kernels/variants.py): every kernel file
  (csrc/*.cpp but bindings.cpp) compiled with that variant's -march flags and hidden visibility into a
  library of its own (csrc/kernel_api.h says why not one library). These files include no torch header,
  so compiling them four times is cheap;
- `_C`: bindings.cpp, the one file with torch's headers (the slow one to compile), compiled once for the
  baseline ISA. At import, conveyor/kernels/__init__.py picks the variant this CPU runs and `_C` loads it.

setuptools compiles the extensions `os.cpu_count()` at a time. A new kernel file needs nothing here: it is
found by its name and must define `register_<file>(conveyor::Table&)` in namespace
`conveyor::CONVEYOR_VARIANT` (csrc/kernel_api.h). Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
CSRC = Path("conveyor", "kernels", "csrc")  # relative: setuptools wants relative source paths
GEN = Path("build", "conveyor_gen")  # generated sources and headers (build/ is not in git)
_spec = importlib.util.spec_from_file_location("_conveyor_variants", ROOT / "conveyor" / "kernels" / "variants.py")
variants = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = variants  # dataclasses look their module up there
_spec.loader.exec_module(variants)

# -g0: Python's own CFLAGS carry -g, which makes the compile slower and the libraries 10x larger. The
# bindings get the C++ standard torch asks for from BuildExtension; the kernels are C++17.
FLAGS = ["-O3", "-g0"]
VARIANT_FLAGS = FLAGS + ["-std=c++17", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-DCONVEYOR_SHARED"]


def kernel_files() -> list[Path]:
    """The per-variant sources: every csrc/*.cpp but the bindings, the longest first (they compile longest)."""
    files = [p for p in (ROOT / CSRC).glob("*.cpp") if p.name not in ("bindings.cpp", "variant_table.cpp")]
    return sorted(files, key=lambda p: (-p.stat().st_size, p.name))


def source_hash() -> str:
    """The same hash as conveyor/kernels/__init__.py source_hash(): which sources a build was made from."""
    files = sorted((ROOT / CSRC).glob("*.cpp")) + sorted((ROOT / CSRC).glob("*.h"))
    h = hashlib.sha256()
    for src in files:
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def compiler_takes(flags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler accepts a variant's flags (an old one may not know -mavx512bf16)."""
    cxx = os.environ.get("CXX", "c++").split()
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        return subprocess.run([*cxx, *flags, "-c", str(src), "-o", str(Path(d) / "probe.o")],
                              capture_output=True).returncode == 0


def depends() -> list[str]:
    """What every extension is rebuilt for when it changes (setuptools looks at the .cpp files alone otherwise,
    and an edited header would leave a build whose source hash no longer matches: never used)."""
    return sorted(str(p.relative_to(ROOT)) for p in [*(ROOT / CSRC).glob("*.cpp"), *(ROOT / CSRC).glob("*.h")])


def variant_extension(v) -> Extension:
    """`conveyor.kernels._cpu_<name>`: each kernel file through a one-line wrapper in GEN/<name>/, so that the
    variants' objects do not share a path in setuptools' build folder."""
    sources = []
    for src in [*kernel_files(), ROOT / CSRC / "variant_table.cpp"]:
        wrapper = ROOT / GEN / v.name / src.name
        # by its path from here: a bare "name.cpp" would find the wrapper itself first
        write_if_changed(wrapper, f'#include "../../../{(CSRC / src.name).as_posix()}"  // the {v.name} variant\n')
        sources.append(str(wrapper.relative_to(ROOT)))
    return Extension(f"conveyor.kernels._cpu_{v.name}", sources, language="c++", depends=depends(),
                     include_dirs=[str(CSRC), str(GEN)],
                     extra_compile_args=[*VARIANT_FLAGS, *v.cflags, f"-DCONVEYOR_VARIANT={v.name}"])


def extensions() -> list[Extension]:
    write_if_changed(ROOT / GEN / "kernel_files.h",
                     "".join(f"CONVEYOR_KERNEL_FILE({p.stem})\n" for p in kernel_files()))
    chosen = [v for v in variants.variants_for_this_platform() if compiler_takes(v.cflags)]
    if not chosen:
        raise RuntimeError("the C++ compiler compiles none of the kernel variants (conveyor/kernels/variants.py)")
    # the longest compile first (the bindings, ~10 s of CPU; the AVX-512 variants' attention ~11-14 s; the
    # others ~5 s), so that the parallel workers end together
    # -fopenmp: the bindings' at::parallel_for is ATen's inline OpenMP loop (torch's parallel backend), the one
    # thread pool every kernel runs on; compiled without it, the pragma is dropped and every kernel runs on
    # one thread (tests/kernels/test_build.py checks that a kernel uses more than one)
    bindings = CppExtension("conveyor.kernels._C", [str(CSRC / "bindings.cpp")], include_dirs=[str(CSRC)],
                            depends=depends(),
                            extra_compile_args=FLAGS + ["-fopenmp", f'-DCONVEYOR_SOURCE_HASH="{source_hash()}"'],
                            extra_link_args=["-fopenmp"])
    return [bindings] + [variant_extension(v) for v in chosen]


class BuildKernels(BuildExtension):
    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None or self.parallel is True:
            self.parallel = max(1, os.cpu_count() or 1)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildKernels.with_options(use_ninja=False)})
