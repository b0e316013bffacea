"""Weight-only quantization: int8 (one scale per output channel) and int4 (a scale and a zero per group
of 32 inputs), run by torch's own CPU kernels.

Why: a decode step reads every weight once per step, so at small batch its time is the time to stream
the weights from memory. int8 halves the bytes and int4 quarters them (SmolLM2-135M: 270 MB of bf16
per token down to 135 / ~75 MB). The kernels (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`) dequantize in registers and win while the step is memory-bound,
but lose several times over at large batch, where oneDNN's bf16 GEMM is compute-bound and they are
not blocked for it (measured on an AMD EPYC Zen 4, 2 threads, SmolLM2 shapes cold in cache: 30
layers at M=1 bf16 14.4 ms, int8 9.0, int4 3.9; at M=8 13.6 / 22.8 / 11.4). So each
`QuantizedLinear` may also hold a dense copy of its dequantized weight, packed for oneDNN, and steps
with more rows than a threshold measured at startup (`tune_dense_threshold`) run that instead.
Where that split is used, a token's numerics depend on its step's size: the runner then reports
outputs as not batch-invariant.

GGUF files already hold Q4_0 / Q4_1 blocks of 32 (`w = d * q + m`): those map exactly onto the int4
kernel's layout (`w = (q - 8) * scale + zero`), so `--quantization int4` keeps them as shipped
(`QuantizedWeight.from_gguf`) instead of quantizing the dequantized floats a second time.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from conveyor import kernels
from conveyor.config import QUANTIZATIONS
from conveyor.model.packed_linear import PackedLinear, packing_available

log = logging.getLogger("conveyor.quantization")

INT4_GROUP = 32  # GGUF's Q4 block: the int4 kernel also accepts 64/128/256
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class QuantizedWeight:
    """A [N, K] weight as integers plus scales: w[n, k] = (q[n, k] - offset) * scale[n, g] + zero[n, g],
    g = k // group. int8: q in [-127, 127], offset 0, no zero, group = K. int4: q in [0, 15], offset 8."""

    bits: int
    q: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K] (bits 4)
    scale: torch.Tensor  # fp32 [N, K // group]
    zero: torch.Tensor | None  # fp32 [N, K // group] (bits 4)
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight these integers stand for, in fp32 (the reference every kernel is tested against)."""
        offset = 8 if self.bits == 4 else 0
        s = self.scale.repeat_interleave(self.group, dim=1)
        w = (self.q.float() - offset) * s
        if self.zero is not None:
            w = w + self.zero.repeat_interleave(self.group, dim=1)
        return w

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along the output dimension (q/k/v and gate/up are fused into one matmul)."""
        first = parts[0]
        if any(p.bits != first.bits or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights quantized alike can be fused")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        return QuantizedWeight(first.bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               zero, first.group)

    @staticmethod
    def from_gguf(raw: np.ndarray, qtype: str, rows: int, cols: int) -> QuantizedWeight:
        """Q4_0 / Q4_1 blocks of 32 (2-byte d, [2-byte m,] 16 bytes of nibbles: element j in the low
        nibble of byte j, element j + 16 in its high nibble) as int4 with no rounding of q."""
        bpb = {"Q4_0": 18, "Q4_1": 20}[qtype]
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, bpb)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0] if qtype == "Q4_1" else None
        qs = blocks[..., bpb - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        scale = torch.from_numpy(d)
        # Q4_0: w = d * (q - 8); Q4_1: w = d * q + m = d * (q - 8) + (m + 8 d)
        zero = torch.zeros_like(scale) if m is None else torch.from_numpy(m + 8 * d)
        return QuantizedWeight(4, torch.from_numpy(q.astype(np.uint8)), scale, zero, 32)

    def permute_rows(self, fn) -> QuantizedWeight:
        """Apply a row permutation given as a function on [N, ...] arrays (GGUF's q/k RoPE order)."""
        z = None if self.zero is None else torch.from_numpy(fn(self.zero.numpy()).copy())
        return QuantizedWeight(self.bits, torch.from_numpy(fn(self.q.numpy()).copy()),
                               torch.from_numpy(fn(self.scale.numpy()).copy()), z, self.group)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values that are exactly representable in `dtype` (the kernels take scales in x's dtype)."""
    return x.to(dtype).float()


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Symmetric, one scale per output channel. The scale is rounded to the kernel's dtype first and q
    chosen for the rounded scale, so the weight the kernel sees is the one `dequantize()` describes."""
    w = w.float()
    lo, hi = torch.aminmax(w, dim=1, keepdim=True)  # max |w| = max(-min, max), in one pass
    scale = _round_to((torch.maximum(-lo, hi) / 127).clamp(min=1e-12), scale_dtype)
    q = (w / scale).round_().clamp_(-127, 127).to(torch.int8)  # in place after the first: fewer passes
    return QuantizedWeight(8, q, scale, None, w.shape[1])


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, scale_dtype: torch.dtype = torch.float32
                  ) -> QuantizedWeight:
    """Asymmetric per group of `group` inputs (as GGUF's Q4_1): 16 levels from the group's min to max."""
    n, k = w.shape
    g = w.to(torch.float32, copy=True).reshape(n, k // group, group)  # a copy: rewritten in place below
    lo, hi = torch.aminmax(g, dim=-1)
    scale = _round_to(((hi - lo) / 15).clamp(min=1e-12), scale_dtype)
    zero = _round_to(lo + 8 * scale, scale_dtype)  # w = (q - 8) * scale + zero, so q = 0 gives lo
    q = g.sub_(zero[..., None]).div_(scale[..., None]).add_(8).round_().clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(4, q.reshape(n, k), scale, zero, group)


QUANT_CHUNK_BYTES = 16 * 2**20  # fp32 bytes of weight quantized at a time


def quantize(w: torch.Tensor, method: str, scale_dtype: torch.dtype) -> QuantizedWeight:
    """`w` quantized a chunk of rows at a time (every row on its own: the same integers as in one go), so the
    fp32 temporaries stay at a few times 16 MB whatever the weight (an 8B model's LM head is 2 GB in fp32)."""
    if method == "int8":
        fn = lambda rows: quantize_int8(rows, scale_dtype)  # noqa: E731
    elif method == "int4":
        fn = lambda rows: quantize_int4(rows, INT4_GROUP, scale_dtype)  # noqa: E731
    else:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    n, k = w.shape
    step = max(16, QUANT_CHUNK_BYTES // (4 * k))
    if n <= step:
        return fn(w)
    first = fn(w[:step])
    q = torch.empty((n, k), dtype=first.q.dtype)
    scale = torch.empty((n, first.scale.shape[1]), dtype=first.scale.dtype)
    zero = None if first.zero is None else torch.empty_like(scale)
    for a in range(0, n, step):
        part = first if a == 0 else fn(w[a:a + step])
        q[a:a + step], scale[a:a + step] = part.q, part.scale
        if zero is not None:
            zero[a:a + step] = part.zero
    return QuantizedWeight(first.bits, q, scale, zero, first.group)


def _ours(op: str, env: str, dtype: torch.dtype) -> bool:
    k = kernels.load()
    return (k is not None and getattr(k, op + "_available", lambda: False)()
            and os.environ.get(env, "ours") != "torch" and dtype in (torch.float32, torch.bfloat16))


def int4_kernel_fits(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether our int4 kernel (AVX2 + FMA, `linear_int4.cpp`) takes this weight: groups of 32, N % 16 == 0,
    activations in fp32 or bf16. `CONVEYOR_INT4_KERNEL=torch` keeps torch's (to compare the two)."""
    return (_ours("linear_int4", "CONVEYOR_INT4_KERNEL", dtype) and qw.bits == 4 and qw.group == 32
            and qw.shape[0] % 16 == 0 and qw.shape[1] % 32 == 0)


def int8_kernel_fits(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether our int8 kernel (AVX2 + FMA, `linear_int8.cpp`) takes this weight: N % 16 == 0, K even,
    activations in fp32 or bf16. `CONVEYOR_INT8_KERNEL=torch` keeps torch's."""
    return (_ours("linear_int8", "CONVEYOR_INT8_KERNEL", dtype) and qw.bits == 8 and qw.shape[0] % 16 == 0
            and qw.shape[1] % 2 == 0)


def pack_int8(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int8 kernel's layout (linear_int8.cpp): q as int8 [N/16, K, 16] (16 columns' bytes per k), the
    per-channel scales as fp32 [N]."""
    n, k = qw.shape
    q = qw.q.to(torch.int8).view(n // 16, 16, k).transpose(1, 2).contiguous()
    return q, qw.scale[:, 0].float().contiguous()


def pack_int4(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 kernel's layout (linear_int4.cpp): q as uint8 [N/16, K/2, 16], byte j of row i holding column
    j's q[2i] (low nibble) and q[2i + 1] (high); per 16 columns and group: 16 scales, then 16 zero - 8 * scale."""
    n, k = qw.shape
    g = k // qw.group
    q = qw.q.to(torch.uint8).view(n // 16, 16, k // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 1).contiguous()
    scale, zero = qw.scale.float(), qw.zero.float()
    sz = torch.stack([scale, zero - 8 * scale], dim=-1).view(n // 16, 16, g, 2).permute(0, 2, 3, 1).contiguous()
    return packed, sz


def int4_fits(n: int, k: int, group: int = INT4_GROUP) -> bool:
    """The int4 kernel needs N a multiple of 16 and K a multiple of the group."""
    return n % 16 == 0 and k % group == 0


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held as int8 or int4 (CPU kernels), and optionally a dense copy for big steps."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group = qw.bits, qw.group
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.ours = False  # on our kernel (linear_int8.cpp / linear_int4.cpp) rather than torch's
        if qw.bits == 8 and int8_kernel_fits(qw, dtype):
            self.ours = True
            self.qweight, self.scales = pack_int8(qw)
        elif qw.bits == 8:
            self.qweight = qw.q.contiguous()
            self.scales = qw.scale[:, 0].to(dtype).contiguous()
        elif int4_kernel_fits(qw, dtype):
            self.ours = True
            self.qweight, self.scales = pack_int4(qw)
        else:
            self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
            # [K // group, N, 2]: (scale, zero) per group and output channel
            self.scales = torch.stack([qw.scale, qw.zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
        # torch's int4 packing is opaque: its layers keep the integers (a fallback for CPUs without AVX2); the
        # others derive them from the packed weight when asked (`reference_weight`), rather than holding a second
        # copy of the model (an 8B model's unpacked int4 is 7 GB beside its 3.5 GB packed)
        self._reference = qw if (qw.bits == 4 and not self.ours) else None
        self.dense: PackedLinear | nn.Linear | None = None
        self.dense_above: int | None = None  # steps with more rows than this run `dense`

    @property
    def reference_weight(self) -> QuantizedWeight:
        """The integers and scales this layer computes with, unpacked (tests, the dense copy)."""
        if self._reference is not None:
            return self._reference
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            q = self.qweight.transpose(1, 2).reshape(n, k) if self.ours else self.qweight
            return QuantizedWeight(8, q, self.scales.float().reshape(n, 1), None, k)
        g = k // self.group  # pack_int4's layout, undone
        q = torch.stack([self.qweight & 0x0F, self.qweight >> 4], dim=-1).permute(0, 2, 1, 3).reshape(n, k)
        scale = self.scales[:, :, 0, :].permute(0, 2, 1).reshape(n, g)
        zero = self.scales[:, :, 1, :].permute(0, 2, 1).reshape(n, g) + 8 * scale
        return QuantizedWeight(4, q, scale, zero, self.group)

    def make_dense(self) -> None:
        """Build the dense copy (the dequantized weight in the model's dtype) for large steps."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        ref = self.reference_weight
        w = torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        step = max(16, QUANT_CHUNK_BYTES // (4 * self.in_features))  # fp32 temporaries of one chunk of rows
        for a in range(0, self.out_features, step):
            part = QuantizedWeight(ref.bits, ref.q[a:a + step], ref.scale[a:a + step],
                                   None if ref.zero is None else ref.zero[a:a + step], ref.group)
            w[a:a + step] = part.dequantize()
        with torch.no_grad():
            lin.weight = nn.Parameter(w, requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias, requires_grad=False)
        self.dense = PackedLinear(lin) if packing_available(torch.device("cpu"), self.dtype) else lin

    def quantized_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.bits == 8 and self.ours:
            y = kernels.load().linear_int8(x2, self.qweight, self.scales)
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.ours:
            y = kernels.load().linear_int4(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and self.dense_above is not None and x2.shape[0] > self.dense_above:
            return self.dense(x)
        return self.quantized_mm(x2.contiguous()).view(*shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x @ dequantized W^T: what the kernel approximates."""
        y = x.float() @ self.reference_weight.dequantize().T
        return y if self.bias is None else y + self.bias.float()

    @property
    def batch_invariant(self) -> bool:
        """A row's result does not depend on the step's size unless the dense copy takes big steps."""
        return self.dense is None or self.dense_above is None


def quantization_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the quantized kernels run here, else why not."""
    if device.type != "cpu":
        return f"no quantized kernels for {device.type} yet"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype}"
    return None


def keeps_checkpoint_weight(name: str, method: str | None) -> bool:
    """Whether module `name` may serve a checkpoint's own quantized weight under `method` (not the LM head
    under int4: it is int8, see `quantize_weight`)."""
    return bool(method) and not (method == "int4" and name == "lm_head")


def usable_kept(name: str, kept: QuantizedWeight | None, method: str, n_out: int, k_in: int) -> QuantizedWeight | None:
    """`kept` (a checkpoint's own quantized weight for module `name`) if this layer can serve it as it is."""
    bits = 8 if method == "int8" else 4
    if kept is None or not keeps_checkpoint_weight(name, method):
        return None
    if kept.bits == bits and kept.shape == (n_out, k_in) and (bits == 8 or int4_fits(n_out, k_in, kept.group)):
        return kept
    return None


def quantize_weight(name: str, w: torch.Tensor, method: str, dtype: torch.dtype) -> QuantizedWeight:
    """Module `name`'s float weight quantized as `method` asks, with the exceptions: under int4 the LM head is
    int8 (as llama.cpp's Q4_K_M keeps its output at 6 bits: on SmolLM2 an int4 head costs 5.1% perplexity, an
    int8 one nothing measurable, for ~1 ms a token), and so is a shape the int4 kernel cannot take."""
    n_out, k_in = w.shape
    if method == "int4" and name == "lm_head":
        return quantize(w, "int8", dtype)
    if method == "int4" and not int4_fits(n_out, k_in):
        log.info("%s: %dx%d does not fit the int4 kernel; int8 instead", name, n_out, k_in)
        return quantize(w, "int8", dtype)
    return quantize(w, method, dtype)


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype,
                   prequantized: dict[str, QuantizedWeight] | None = None) -> dict[str, int]:
    """Replace every nn.Linear of `model` by a QuantizedLinear. `prequantized` maps a module's name
    (e.g. `layers.0.self_attn.qkv_proj`) to weights already quantized (from a GGUF), used as they are.
    Returns counts: {"quantized": n, "from_checkpoint": m}. (The runner's loader makes the same decisions
    layer by layer as it reads the checkpoint: `usable_kept`, `quantize_weight`.)"""
    counts = {"quantized": 0, "from_checkpoint": 0}
    prequantized = prequantized or {}
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        n_out, k_in = lin.weight.shape
        qw = usable_kept(name, prequantized.get(name), method, n_out, k_in)
        if qw is not None:
            counts["from_checkpoint"] += 1
        else:
            qw = quantize_weight(name, lin.weight.detach(), method, dtype)
        counts["quantized"] += 1
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantizedLinear(qw, lin.bias, dtype))
    return counts


DENSE_MEASURE_BYTES = 256 * 2**20  # dense copies built to time: layers enough to be cold in any CPU cache


def dense_copy_bytes(m: QuantizedLinear) -> int:
    return m.out_features * m.in_features * torch.empty((), dtype=m.dtype).element_size()


def tune_dense_threshold(model: nn.Module, max_rows: int, memory_budget: int | None = None) -> int | None:
    """Measure, in model order (so weights come cold from memory as in a real step), the quantized
    kernels against dense oneDNN GEMMs of the dequantized weights for growing row counts; give every
    QuantizedLinear a dense copy used above the largest row count at which the quantized kernels still
    win. Returns that threshold, or None where the quantized kernels win up to `max_rows` (no copies).

    `memory_budget`: the bytes the dense copies may take. Where all of them would take more, there are none
    and nothing is measured: an int4 8B model's dense bf16 copies are 14 GB beside its ~5 GB of int4, the very
    memory quantizing was meant to save. The measurement builds copies of the first layers only (at least
    `DENSE_MEASURE_BYTES`, so that they come cold from memory as in a real step), then of the rest if they win.

    `CONVEYOR_QUANT_DENSE_ABOVE=N` skips the measurement and uses N (`none`: never a dense copy: every
    step on the quantized kernels, outputs batch-invariant)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return None
    forced = os.environ.get("CONVEYOR_QUANT_DENSE_ABOVE")
    total = sum(dense_copy_bytes(m) for m in layers)
    if forced is not None:
        threshold = None if forced.lower() == "none" else int(forced)
    elif memory_budget is not None and total > memory_budget:
        log.info("dense copies for big steps would take %.2f GiB, more than the %.2f GiB they may have here: "
                 "quantized kernels for every step", total / 2**30, memory_budget / 2**30)
        threshold = None
    else:
        timed_layers, size = [], 0
        for m in layers:
            if size >= DENSE_MEASURE_BYTES:
                break
            m.make_dense()
            timed_layers.append(m)
            size += dense_copy_bytes(m)
        inputs: dict[tuple[int, int], torch.Tensor] = {}

        def timed(fn, rows: int) -> float:
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for m in timed_layers:
                    key = (rows, m.in_features)
                    if key not in inputs:
                        inputs[key] = torch.randn(rows, m.in_features).to(m.dtype)
                    fn(m, inputs[key])
                best = min(best, time.perf_counter() - t)
            return best

        threshold = 0
        with torch.inference_mode():
            for rows in (1, 2, 4, 8, 16, 32, 64):
                if rows > max_rows:
                    threshold = None  # the quantized kernels win at every step size this engine runs
                    break
                tq = timed(lambda m, x: m.quantized_mm(x), rows)
                td = timed(lambda m, x: m.dense(x), rows)
                log.info("quantized vs dense linears at %d rows (%d layers): %.2f vs %.2f ms", rows,
                         len(timed_layers), tq * 1e3, td * 1e3)
                if tq >= td:
                    break
                threshold = rows
    for m in layers:
        if threshold is None:
            m.dense, m.dense_above = None, None
        else:
            if m.dense is None:
                m.make_dense()
            m.dense_above = threshold
    return threshold


def dense_rows_note(threshold: int | None) -> str:
    if threshold is None:
        return "quantized kernels for every step"
    if threshold == 0:
        return "dense copies for every step (the quantized kernels never won here)"
    return f"quantized kernels up to {threshold} rows per step, dense oneDNN copies above"


