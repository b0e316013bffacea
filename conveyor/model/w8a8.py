"""W8A8 int8 (`--quantization int8_per_channel`): int8 weights with one scale per output channel, activations
quantized to int8 per token on the fly, int8 dot products summed exactly in int32.

Why: the weight-only modes (quantization.py) make a decode step read fewer bytes, but their kernels widen the
integers to floats and multiply in fp32, so at 64 rows or in prefill, where the linear layers are
compute-bound, they lose to the bf16 GEMM (they hand those steps to dense copies). Here both operands are
int8, and AVX-512 VNNI's vpdpbusd multiplies 64 byte pairs per instruction where vdpbf16ps multiplies 32 bf16
pairs, at the same instruction rate: the compute-bound steps get up to 2x, and the weights' bytes halve too.

The name is vLLM's: its online `--quantization` shorthands are `<dtype>_per_<granularity>`, with
`fp8_per_channel` meaning per-channel weight scales and dynamic per-token activations (its INT8 W8A8 scheme
is the same shape in int8), and a `_weight_only` suffix marking weight-only; `w8a8_int8` (SGLang's name for
this scheme) is accepted too (`conveyor.config.QUANTIZATION_ALIASES`).

Numerics, one definition for the compiled kernel (kernels/csrc/linear_w8a8.cpp) and the reference here:
- a block Walsh-Hadamard transform H (blocks of `hadamard_block(K)` inputs) on both sides, which leaves x W^T
  as it is (H H = b I) and spreads outliers (linear_for says why): W' = W H / b, x' = x H in fp32;
- weights: symmetric per output channel, `sw = max|w'| / 127` (fp32, not rounded further), q in [-127, 127];
- activations: symmetric per row, `a = max|x'|` (at least 1e-30), `xq = round_half_even(x' * (127 / a))`,
  `sx = a / 127`; a row with a NaN or an infinity gets `sx = NaN` and `xq = 0` (its outputs are NaN);
- `y = float(sum_k xq * q) * (sx * sw)`, one rounding to the output dtype.
Symmetric rather than asymmetric activations: the inputs of a Llama layer's linears (RMSNorm's output,
attention's, SiLU(gate) * up) are centred on zero, so a zero point would buy little range, while it would
cost a per-row correction term (zero point x column sums) in every output and a u8 x u8 product the VNNI
instruction lacks; vLLM's and SGLang's dynamic int8 schemes are symmetric per token too.

The integer sum is exact, so its order never matters: any row blocking, thread split or instruction set
gives the same bits. Kernel and reference agree bit for bit (tested), and a row's result never depends on
the other rows of its step: W8A8 layers are batch-invariant by construction, on the kernel and on the
reference path alike.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import kernels
from conveyor.config import W8A8_QUANTIZATION

log = logging.getLogger("conveyor.quantization")

METHOD = W8A8_QUANTIZATION  # "int8_per_channel"
MIN_ABS_MAX = 1e-30  # a row of zeros quantizes to zeros (and scale 1e-30 / 127), not to NaN


def quantize_weight(w: torch.Tensor, hadamard: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K] in [-127, 127], sw fp32 [N]): symmetric, one scale per output channel;
    with `hadamard` > 0, of W H / hadamard (each row's blocks transformed in fp64 first, as W8A8Linear wants).

    In slices of 256 rows: a transformed fp64 copy of a whole LM head would be 2 GiB at 1B, and a slice's
    transform stays in cache."""
    q = torch.empty(w.shape, dtype=torch.int8)
    sw = torch.empty(w.shape[0], dtype=torch.float32)
    for r in range(0, w.shape[0], 256):
        part = w[r:r + 256].detach()
        if hadamard:
            part = fwht_weight(part, hadamard) / hadamard  # the division is by a power of 2: exact
        part = part.float()
        s = (part.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q[r:r + 256] = torch.round(part / s[:, None]).clamp(-127, 127)
        sw[r:r + 256] = s
    return q, sw


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of every block of `block` values along x's last dimension, as
    the kernel computes it: stages h = 1, 2, 4, ..., block/2, each turning every pair (x[i], x[i + h]) (bit h of
    i clear) into (x[i] + x[i + h], x[i] - x[i + h]), in x's dtype (the same operations in the same order, so
    the same bits). H H = block I, so x W^T = fwht(x) fwht(W)^T / block."""
    y = x.reshape(-1, block)
    h = 1
    while h < block:
        y = y.view(-1, block // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape)


@functools.cache
def _sylvester(f: int) -> torch.Tensor:
    """The f x f Sylvester Hadamard matrix (f a power of two), fp64, symmetric."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < f:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht_weight(w: torch.Tensor, block: int) -> torch.Tensor:
    """fwht(w, block) in fp64 for a weight at load, by two Kronecker factors instead of log2(block) stages.

    Why not `fwht`: its stages at h = 1, 2, 4 run on tensors whose innermost dimension is 1-4 values wide, which
    torch walks element by element (an LM head of 128,256 x 2,048 took 57 s on a 2-core Zen 3, most of a 1B
    model's 176 s W8A8 load). The Sylvester matrix factors, H_(ab) = H_a (x) H_b, so a block viewed as an a x b
    matrix X becomes H_a X H_b: two dense products of at most 32 x 32 (3 s for that head, in the 256-row slices
    `quantize_weight` hands in, which stay in cache). The sums run in another order than the stages', which does
    not matter in fp64: bf16 weights' sums of 512 terms are exact there (the activations keep `fwht`, whose
    order the kernel repeats in fp32)."""
    y = w.reshape(-1, block).double()
    p = block.bit_length() - 1
    a, b = 1 << (p - p // 2), 1 << (p // 2)  # 512 -> 32 x 16
    y = y.reshape(-1, a, b)
    if b > 1:
        y = y @ _sylvester(b)
    y = (y.transpose(1, 2) @ _sylvester(a)).transpose(1, 2)  # H_a is symmetric: (H_a X)^T = X^T H_a
    return y.reshape(w.shape)


def quantize_activations(x: torch.Tensor, hadamard: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] fp32/bf16 -> (xq int8 [M, K], sx fp32 [M]): per row, as the kernel quantizes its input (with
    `hadamard` > 0, each row's blocks of that many values Walsh-Hadamard transformed first, in fp32).

    Tensor-by-tensor divisions on purpose: torch turns a division by a Python scalar into a multiplication by
    its reciprocal, which rounds differently from the kernel's division."""
    xf = x.float()
    if hadamard:
        xf = fwht(xf, hadamard)
    bad = ~torch.isfinite(xf).all(dim=1, keepdim=True)
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_ABS_MAX)
    c127 = torch.full_like(amax, 127.0)
    q = torch.round(xf * (c127 / amax)).clamp(-127, 127)
    q = torch.where(bad, torch.zeros_like(q), q).to(torch.int8)
    sx = torch.where(bad, torch.full_like(amax, float("nan")), amax / c127)
    return q, sx[:, 0]


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [N, K]^T -> int32 [M, N], exact (torch's int8 GEMM where it has one)."""
    if a.shape[0] == 0:
        return torch.zeros(0, b.shape[0], dtype=torch.int32)
    if hasattr(torch, "_int_mm"):
        return torch._int_mm(a.contiguous(), b.t().contiguous())
    return (a.long() @ b.long().t()).int()  # exact too: |sum| < 2^31 (127 * 127 * K)


def reference(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None,
              hadamard: int = 0) -> torch.Tensor:
    """The W8A8 product in torch: the kernel's integers and its fp32 scaling, rounded once to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activations(x2, hadamard)
    y = (int_matmul(xq, q).float() * (sx[:, None] * sw[None, :])).to(x.dtype)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], q.shape[0])


def pack_weight(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (linear_w8a8.cpp): int8 [N/16, Kp/4, 16, 4] (K padded with zeros to a multiple of 4;
    per 16 columns and 4 k, one 64-byte vector) and comp int32 [N] = 128 * sum_k q[n, k] (the VNNI path feeds
    activations in as xq + 128 and subtracts it)."""
    n, k = q.shape
    kp = -(-k // 4) * 4
    packed = (q if kp == k else F.pad(q, (0, kp - k))).view(n // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    # in slices: a whole LM head's sums in one call widened it to int32 and int64 (+3.2 GiB at 1B, the load's peak)
    comp = torch.empty(n, dtype=torch.int32)
    for r in range(0, n, 4096):
        comp[r:r + 4096] = q[r:r + 4096].sum(dim=1, dtype=torch.int32) * 128
    return packed, comp


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether the compiled W8A8 kernel runs here for activations in `dtype` (AMX-INT8, AVX-512 VNNI or AVX2)."""
    k = kernels.load()
    return (k is not None and getattr(k, "linear_w8a8_available", lambda: False)()
            and dtype in (torch.float32, torch.bfloat16))


def kernel_isa() -> str:
    """"amx-int8", "avx512-vnni", "avx2", or "torch" (the reference: no compiled kernel for this CPU or build)."""
    k = kernels.load()
    return (getattr(k, "w8a8_isa", lambda: "")() if k is not None else "") or "torch"


def hadamard_block(k: int) -> int:
    """The Hadamard block for an input of width k: the largest power of two dividing k, at most 512 (0 below 16)."""
    b = min(k & -k, 512)
    return b if b >= 16 else 0


class W8A8Linear(nn.Module):
    """y = x W^T + b with W as int8 per channel and x quantized to int8 per row on every call.

    `hadamard` > 0: x's rows are Walsh-Hadamard transformed in blocks of that size before they are quantized,
    and W alike (divided by the block) at load, which leaves x W^T as it is but spreads a row's outliers over
    the block, so that they no longer set the scale every other value of the row is rounded to."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, hadamard: int = 0) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.hadamard = hadamard
        q, sw = quantize_weight(weight, hadamard)
        # the kernel takes 16 output columns at a time; other widths (none in the Llama family) run the reference
        self.kernel = kernel_available(dtype) and self.out_features % 16 == 0
        packed, comp = pack_weight(q) if self.kernel else (None, None)
        # buffers, so that the engine's weight bytes count them; q only where the reference runs (the packed copy
        # holds the same bytes: `weight_q` unpacks them when asked)
        self.register_buffer("q", None if self.kernel else q, persistent=False)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("comp", comp, persistent=False)
        self.register_buffer("sw", sw, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)
        self._op = kernels.load().linear_w8a8 if self.kernel else None

    def weight_q(self) -> torch.Tensor:
        """The int8 weight [N, K] (unpacked from the kernel's layout where only that is kept)."""
        if self.q is not None:
            return self.q
        n = self.out_features
        return self.packed.permute(0, 2, 1, 3).reshape(n, -1)[:, :self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._op is None:
            return reference(x, self.q, self.sw, self.bias, self.hadamard)
        shape = x.shape
        y = self._op(x.reshape(-1, self.in_features), self.packed, self.comp, self.sw, self.hadamard)
        if self.bias is not None:
            y += self.bias  # as PackedLinear adds it (and decoder_layers, for q/k/v's biases)
        return y.view(*shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same integers and scaling in torch (what the kernel must equal bit for bit)."""
        return reference(x, self.weight_q(), self.sw, self.bias, self.hadamard)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight these integers stand for, in fp32 (q * sw, transformed back where the input is)."""
        w = self.weight_q().float() * self.sw[:, None]
        return fwht(w, self.hadamard) if self.hadamard else w

    batch_invariant = True  # exact integer sums and per-row quantization, kernel and reference alike


# W8A8 everywhere, the LM head included: measured on SmolLM2 (docs/quantization.md, "W8A8"), an int8 head costs
# <0.1% perplexity, and at 64 users the head is a fifth of a step's multiply-adds
QUANTIZE_HEAD = True


@torch.no_grad()
def linear_for(name: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> W8A8Linear | None:
    """The W8A8 layer for the linear `name` (a module path: "lm_head" is the head), with the Hadamard block of
    its input width; None for the LM head where QUANTIZE_HEAD is off. The one place that decides which linears
    W8A8 quantizes and how: the loader (model_runner, layer by layer) and `quantize_model` both ask here.

    Why the Hadamard transform on every input: per-token int8 rounds every value of a row to a step of the row's
    largest value / 127, and these models' activations have a few channels far larger than the rest (the
    residual stream's outliers, which RMSNorm's weights scale further; the massive values of SiLU(gate) * up),
    so most values of a row keep few bits. Measured on SmolLM2-135M: W8A8 as it is cost +4.1% perplexity
    (q/k/v +1.7 points, down_proj +1.5). An orthogonal transform of the input, undone in the weights, leaves
    x W^T as it is but spreads each outlier over its block (QuaRot's idea, calibration-free); a block
    Walsh-Hadamard costs log2(block) additions per value. Every linear on its own: +0.5-0.7% on two texts.
    (A rotation of the whole residual stream folded into the weights at load, with a transform on down_proj's
    input only, measured +0.6-0.9%: rounding the rotated stream to bf16 costs precision by itself, and it
    would have untied the head, turned pooled embeddings and broken LoRA adapters.)"""
    if name == "lm_head" and not QUANTIZE_HEAD:
        return None
    return W8A8Linear(weight, bias, dtype, hadamard_block(weight.shape[1]))


def quantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every nn.Linear of an already built `model` by its `linear_for` layer; returns how many (the
    loader quantizes as it reads instead: this is for a model built in float, as the tests build one)."""
    count = 0
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        layer = linear_for(name, lin.weight, lin.bias, dtype)
        if layer is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
            count += 1
    return count
