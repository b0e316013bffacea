"""The instruction-set variants the kernels are compiled for, and which one this CPU runs.

setup.py compiles every kernel file once per variant (with its `cflags`) into one module, as llama.cpp's
GGML_CPU_ALL_VARIANTS and PyTorch's own CPU_CAPABILITY kernels do, so that one built wheel runs on any
x86-64 CPU at the speed of the best code that CPU can execute. At import, `choose()` takes the most
capable variant whose `needs` (flag names as /proc/cpuinfo spells them) the CPU has all of;
`CONVEYOR_CPU_VARIANT=avx2` (or any name below) forces one, for comparisons and tests.

Standard library only: setup.py imports this file before anything is installed.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

# x86-64 micro-architecture levels (the psABI's), in /proc/cpuinfo's names
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    name: str  # also the C++ namespace of its kernels (CONVEYOR_VARIANT)
    cflags: tuple[str, ...]
    needs: frozenset[str]
    summary: str


X86_VARIANTS = (  # most capable first
    # AMX intrinsics compile in here too (linear_amx.cpp); they run only where the CPU reports AMX. Every CPU
    # with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) also has AVX512-VNNI (int8 dot products)
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                           "-mamx-int8", "-mtune=generic"),
            frozenset(_V4 | {"avx512_bf16", "avx512_vnni"}),
            "AVX-512 with BF16 and VNNI dot products (vdpbf16ps, vpdpbusd): Cooper Lake, Sapphire Rapids and "
            "later, AMD Zen 4 and later"),
    Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), frozenset(_V4),
            "AVX-512 F/BW/CD/DQ/VL (x86-64-v4): Skylake-SP and later, AMD Zen 4"),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), frozenset(_V3),
            "AVX2 + FMA (x86-64-v3): Haswell and later, AMD Zen"),
    Variant("generic", ("-march=x86-64", "-mtune=generic"), frozenset(),
            "baseline x86-64 (SSE2): any x86-64 CPU"),
)
PORTABLE = (Variant("generic", (), frozenset(), "the compiler's default target"),)


def variants_for_this_platform() -> tuple[Variant, ...]:
    """What a build compiles: the x86-64 ladder on x86-64, one portable variant elsewhere."""
    return X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else PORTABLE


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says of the first CPU: the one place that file is read (kernel choice, the
    default dtype, the lab's reports and the benchmarks all ask here)."""

    model: str  # "model name"; platform's processor or machine name where there is no /proc/cpuinfo
    flags: tuple[str, ...]  # instruction-set flags, in the file's order

    @property
    def has_fast_bf16(self) -> bool:
        """AVX512-BF16 or AMX: bf16 matmuls beat fp32 there; elsewhere bf16 on a CPU is emulated and slow."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = "", ()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = tuple(line.split(":", 1)[1].split())
                if model and flags:
                    break
    except OSError:
        pass
    return CpuInfo(model or platform.processor() or platform.machine(), flags)


def cpu_flags() -> set[str]:
    return set(cpu_info().flags)


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (platform.processor() is empty on Linux)."""
    return cpu_info().model


def runnable(names: list[str], flags: set[str] | None = None) -> list[str]:
    """The variants among `names` (compiled ones) that this CPU can execute, in the order given."""
    flags = cpu_flags() if flags is None else flags
    known = {v.name: v for v in X86_VARIANTS + PORTABLE}
    return [n for n in names if n in known and known[n].needs <= flags]


def choose(names: list[str], flags: set[str] | None = None) -> tuple[str, str]:
    """(the variant to run among the compiled `names`, why). CONVEYOR_CPU_VARIANT wins where the CPU runs it."""
    ok = runnable(names, flags)
    forced = os.environ.get("CONVEYOR_CPU_VARIANT", "").strip()
    if forced:
        if forced in ok:
            return forced, "CONVEYOR_CPU_VARIANT"
        why = "is not built" if forced not in names else "needs instructions this CPU lacks"
        fallback = ok[0] if ok else names[-1]
        return fallback, f"CONVEYOR_CPU_VARIANT={forced} {why} (built: {', '.join(names)}); using {fallback}"
    if not ok:  # flags unreadable (not Linux): the most portable build
        return names[-1], "the CPU's flags are unknown"
    return ok[0], "the most capable variant this CPU runs"
