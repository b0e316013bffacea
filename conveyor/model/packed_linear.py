"""Linear layers with their weights prepacked once for oneDNN, the way vLLM's CPU backend runs them.

`F.linear` on CPU reorders the weight into oneDNN's blocked layout on every call; packing it once at
load time makes a decode-sized matmul up to 2x faster on the machines we measured (AMD EPYC,
AVX-512 BF16: 1x576x3072 in bf16 158 -> 80 us, 64x576x49152 16.1 -> 11.0 ms). The packing is
independent of the batch size (`_reorder_linear_weight(w, None)`), so one packed weight serves
every step. `nn.Linear` stays the reference: CUDA, other dtypes, or `CONVEYOR_PACKED_LINEAR=0`.

bf16 weights may instead run one of our own kernels on the same packed layout, both batch-invariant by
construction: `dpbf16` (`kernels/csrc/linear_bf16.cpp`, the AVX-512 BF16 dot-product instruction), which reads
a decode step's weights much faster than oneDNN on the AMD EPYC we measured, and `amx`
(`kernels/csrc/linear_amx.cpp`, AMX tiles), which on an Intel Xeon with AMX matches oneDNN at 64 rows and
beats it at one. On an AVX2-only CPU, where oneDNN cannot pack bf16 at all, `avx2`
(`kernels/csrc/linear_avx2.cpp`) widens the bf16 weights to fp32 in registers. Which one runs is measured once per
kind of machine (`linear_kernel`); `CONVEYOR_LINEAR_KERNEL=onednn|dpbf16|amx|avx2` forces one.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("conveyor.model")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a `dtype` weight can be packed here, for oneDNN or for one of our kernels. oneDNN packs bf16
    only with AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; on an AVX2-only CPU (an AMD EPYC Zen 3, say) our
    `avx2` kernel packs it instead. Where neither can, layers stay `nn.Linear` (torch's own path)."""
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and os.environ.get("CONVEYOR_PACKED_LINEAR", "1") != "0"):
        return False
    return dtype != torch.bfloat16 or onednn_packs_bf16() or bool(available_kernels())


def onednn_packs_bf16() -> bool:
    """Whether oneDNN prepacks (and runs) bf16 weights on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once for the kernel that runs it: oneDNN (CPU, fp32/bf16) or ours (bf16)."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None) -> None:
        """`kernel`: "dpbf16", "amx", "avx2" (ours), "onednn", or "torch" (`F.linear` on the weight as it is, where
        neither fits: a bf16 shape ours cannot take on a CPU where oneDNN cannot pack bf16); None takes
        `linear_kernel()`'s choice where the shape fits it, else oneDNN's (or torch's)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.source_ptr = linear.weight.data_ptr()  # which weight was packed (tied LM heads: the embedding)
        self.bias = None if linear.bias is None else linear.bias.detach()
        w = linear.weight.detach()
        # "dpbf16" / "amx" / "avx2" (ours: rows never padded, invariant by construction), "onednn" or "torch"
        fallback = "onednn" if w.dtype != torch.bfloat16 or onednn_packs_bf16() else "torch"
        if kernel is None:
            kernel = linear_kernel() if w.dtype == torch.bfloat16 else "onednn"
            kernel = kernel if kernel in _OPS and _fits(kernel, w) else fallback
        elif kernel in ("onednn", "torch"):
            pass
        elif kernel not in _OPS:
            raise ValueError(f"kernel must be one of {', '.join([*_OPS, 'onednn', 'torch'])}, got {kernel!r}")
        elif not _fits(kernel, w):
            raise ValueError(f"the {kernel} kernel needs a bf16 weight with N % 16 == 0 and "
                             f"{'K % 32 == 0' if kernel == 'amx' else 'even K'}, got {tuple(w.shape)} {w.dtype}")
        elif kernel not in available_kernels():
            raise ValueError(f"the {kernel} kernel needs the compiled kernels on a CPU with {_NEEDS[kernel]}")
        self.kernel = kernel
        # bound once: looking the op up on every call cost ~6 us x 121 linears per step
        self._linear_bf16 = getattr(_kernels(), _OPS[kernel]) if kernel in _OPS else None
        with torch.no_grad():
            self.packed = (_kernels().linear_bf16_pack(w) if kernel in _OPS
                           else torch.ops.mkldnn._reorder_linear_weight(w, None) if kernel == "onednn" else w)
        # rows are padded to a multiple of this; None: no padding found that makes rows batch-invariant.
        # CONVEYOR_BATCH_INVARIANT=0 skips the check and the padding (only to measure what invariance costs).
        self.row_multiple: int | None = 1
        if self.kernel == "onednn" and os.environ.get("CONVEYOR_BATCH_INVARIANT", "1") != "0":
            self.row_multiple = _row_multiple(self.in_features, self.out_features, w.dtype)
        elif self.kernel == "torch":
            self.row_multiple = None  # torch's bf16 matmul makes no promise across row counts

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kernel == "torch":
            return F.linear(x2, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [None], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if self._linear_bf16 is not None:
            y = self._linear_bf16(x2, self.packed)
            if self.bias is not None:
                y += self.bias
            return y.view(*shape[:-1], self.out_features)
        rows = padded_rows(m, self.row_multiple or 1)
        if rows != m:
            x2 = F.pad(x2, (0, 0, 0, rows - m))
        return self._mm(x2)[:m].view(*shape[:-1], self.out_features)

    @property
    def batch_invariant(self) -> bool:
        return self.row_multiple is not None


EXACT_ROWS = 64  # up to this many rows, every row count gets its own oneDNN primitive
ROW_BUCKETS_PER_OCTAVE = 8


def padded_rows(m: int, multiple: int = 1) -> int:
    """The row count a matmul of `m` rows runs with: `m` rounded up to `multiple` (batch invariance,
    see `_row_multiple`) and, above `EXACT_ROWS`, to one of 8 sizes per power of two.

    Why the buckets: oneDNN (and ideep above it) caches one compiled primitive, about 0.65 MB, per
    distinct shape, up to 1,024 of each. Prefill chunks give a new row count almost every step, so a
    server's RSS climbed by hundreds of MB under load before the caches filled (measured: 0.40 GB
    idle to 1.08 GB after 2.5 minutes of mixed load on the tiny test model). With buckets the row
    counts a server ever sees are bounded (about 90 up to 8,192 rows), each is compiled once, and
    the price is at most 12.5% padding rows (6% on average) in steps of more than 64 rows (more
    where the batch-invariance multiple is larger than the bucket step, as AMX's 16 may be).
    """
    if m > EXACT_ROWS:
        step = 1 << (m.bit_length() - ROW_BUCKETS_PER_OCTAVE.bit_length())  # 2^(floor(log2 m) - 3)
        m = -(-m // step) * step
    return -(-m // multiple) * multiple


_ROW_MULTIPLE: dict[tuple[int, int, torch.dtype], int | None] = {}


def _row_multiple(k: int, n: int, dtype: torch.dtype) -> int | None:
    """The smallest row count multiple that makes this shape's rows batch-invariant (measured), or None.

    oneDNN picks kernels by the number of rows M. For most shapes a row's result is the same for every
    M, but not for all: for K=1536, N=576 in bf16 (SmolLM2's down projection, on an AMD EPYC) a row
    computed alone (M=1) or as the last row of an odd M rounds differently from the same row among an
    even number of rows. Padding M up to a multiple of 2 (one zero row) makes every row take the main
    path. Other CPUs (AMX tiles of 16 rows, say) may need a larger multiple, so this measures, once per
    shape with random data on the machine it runs on: for each candidate multiple, each of 64 rows
    alone and prefixes of up to 143 rows, padded as `forward` pads them, must match a 160-row call
    bit for bit.
    """
    key = (k, n, dtype)
    if key not in _ROW_MULTIPLE:
        g = torch.Generator().manual_seed(0)
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g).to(dtype), None)
        x = torch.randn(160, k, generator=g).to(dtype)  # 160: one of padded_rows' sizes
        mm = lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [None], "")
        full = mm(x)

        def padded(a: torch.Tensor, p: int) -> torch.Tensor:
            m = a.shape[0]
            return mm(F.pad(a, (0, 0, 0, padded_rows(m, p) - m)))[:m]

        _ROW_MULTIPLE[key] = None
        for p in (1, 2, 4, 8, 16, 32, 64):
            alone = torch.cat([padded(x[i:i + 1], p) for i in range(64)])
            if torch.equal(alone, full[:64]) and all(torch.equal(padded(x[:m], p), full[:m])
                                                     for m in (2, 3, 5, 7, 9, 15, 17, 31, 33, 63, 65, 100, 143)):
                _ROW_MULTIPLE[key] = p
                break
        if _ROW_MULTIPLE[key] is None:
            log.warning("linear %dx%d (%s): no row padding makes oneDNN's results batch-invariant here", k, n, dtype)
    return _ROW_MULTIPLE[key]


def _kernels():
    from conveyor import kernels

    return kernels.load()


_OPS = {"dpbf16": "linear_bf16", "amx": "linear_amx", "avx2": "linear_avx2"}  # ours, on linear_bf16_pack's layout
_NEEDS = {"dpbf16": "AVX-512 BF16", "amx": "AMX", "avx2": "AVX2 and FMA"}


def _fits(kernel: str, w: torch.Tensor) -> bool:
    """Whether our `kernel` takes this weight (its packed layout needs N % 16 == 0; AMX tiles K % 32 == 0)."""
    return (w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0
            and w.shape[1] % (32 if kernel == "amx" else 2) == 0)


def available_kernels() -> list[str]:
    """Our bf16 linear kernels this build and CPU can run (oneDNN's can wherever it packs bf16)."""
    k = _kernels()
    if k is None:
        return []
    return [name for name, ok in (("dpbf16", k.linear_bf16_available()),
                                  ("amx", getattr(k, "linear_amx_available", lambda: False)()),
                                  ("avx2", getattr(k, "linear_avx2_available", lambda: False)())) if ok]


_LINEAR_KERNEL: str | None = None


def linear_kernel() -> str:
    """Which kernel runs bf16 linears in this process: "dpbf16", "amx", "avx2" (ours) or "onednn", decided once.

    Not by assumption: every kernel this CPU can run does a SmolLM2-sized matmul (576 -> 1536) at 1 and at 64 rows,
    on one thread, single calls interleaved, best of 25 each; among those within 5% of the fastest at 64 rows
    (throughput) the fastest at one row (a single stream's speed) is taken. Measured: on an AMD EPYC Zen 4 ours
    (dpbf16) 1.8x faster than oneDNN at one row, 1.0-1.2x at 64; on an Intel Xeon with AMX (one thread) dpbf16 ~7x
    slower than oneDNN at 64 rows, amx 1.5x faster than oneDNN at 64 and 3x at one; on an AMD EPYC Zen 3 (AVX2 only)
    oneDNN cannot pack bf16 at all, and avx2 is the one candidate. The measurement is made once per
    kind of machine and remembered (`conveyor/kernels/decisions.py`): timed at every start, one start beside a busy
    process once chose the other kernel. One kernel serves every row count, so outputs stay batch-invariant
    whichever wins. Across processes the kernels may round differently: where runs on several processes must match
    bit for bit (replicas, a server and an offline job), pin the choice with `CONVEYOR_LINEAR_KERNEL`.
    """
    global _LINEAR_KERNEL
    with _CHOICE_LOCK:  # one measurement per process, even if two threads load models at once
        if _LINEAR_KERNEL is None:
            _LINEAR_KERNEL = _choose_linear_kernel()
    return _LINEAR_KERNEL


_CHOICE_LOCK = threading.Lock()


def _choose_linear_kernel() -> str:
    forced = os.environ.get("CONVEYOR_LINEAR_KERNEL", "auto")
    if forced not in ("auto", "onednn", *_OPS):
        raise ValueError(f"CONVEYOR_LINEAR_KERNEL must be auto, onednn, {', '.join(_OPS)}, got {forced!r}")
    ours = available_kernels()
    if forced != "auto":
        if forced != "onednn" and forced not in ours:
            log.warning("CONVEYOR_LINEAR_KERNEL=%s, but this CPU or build cannot run it: using oneDNN", forced)
            return "onednn"
        return forced
    if not ours:
        return "onednn"
    if len(ours) == 1 and not onednn_packs_bf16():
        return ours[0]  # nothing to compare it with
    from conveyor import kernels
    from conveyor.kernels.decisions import decide

    k = _kernels()
    key = {"torch": torch.__version__, "kernels": kernels.source_hash(), "variant": kernels.variant(),
           "candidates": ours}
    return decide("bf16 linear kernel", key, lambda: _measure_linear_kernels(k, ours))


def _measure_linear_kernels(k, ours: list[str]) -> tuple[str, dict]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    packed = k.linear_bf16_pack(w)
    dnn = torch.ops.mkldnn._reorder_linear_weight(w, None) if onednn_packs_bf16() else None
    runs = {name: (lambda a, op=getattr(k, _OPS[name]): op(a, packed)) for name in ours}
    if dnn is not None:
        runs["onednn"] = lambda a: torch.ops.mkldnn._linear_pointwise(a, dnn, None, "none", [None], "")
    best: dict[tuple[str, int], float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: beside a busy process, a 2-thread call waits for its slower half
    try:
        for rows in (1, 64):
            a = x[:rows].contiguous()
            for run in runs.values():
                run(a)  # warm: the first call builds oneDNN's primitive
            for _ in range(25):
                for name, run in runs.items():  # interleaved single calls: a noisy moment inflates one sample
                    t0 = time.perf_counter()
                    run(a)
                    dt = time.perf_counter() - t0
                    best[name, rows] = min(best.get((name, rows), dt), dt)
    finally:
        torch.set_num_threads(threads)
    fastest64 = min(best[name, 64] for name in runs)
    choice = min((name for name in runs if best[name, 64] <= 1.05 * fastest64), key=lambda name: best[name, 1])
    measured = {f"{name} {rows} rows us": round(t * 1e6, 1) for (name, rows), t in best.items()}
    log.info("bf16 linears: %s (measured 576->1536 on one thread, best us per call at 1 / 64 rows: %s)", choice,
             ", ".join(f"{name} {best[name, 1] * 1e6:.0f} / {best[name, 64] * 1e6:.0f}" for name in runs))
    return choice, measured


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear; returns how many were packed."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
