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
- weights: symmetric per output channel, `sw = max|w| / 127` (fp32, not rounded further), q in [-127, 127];
- activations: symmetric per row, `a = max|x|` (at least 1e-30), `xq = round_half_even(x * (127 / a))`,
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

import logging

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import kernels
from conveyor.config import W8A8_QUANTIZATION

log = logging.getLogger("conveyor.quantization")

METHOD = W8A8_QUANTIZATION  # "int8_per_channel"
MIN_ABS_MAX = 1e-30  # a row of zeros quantizes to zeros (and scale 1e-30 / 127), not to NaN


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K] in [-127, 127], sw fp32 [N]): symmetric, one scale per output channel."""
    q = torch.empty(w.shape, dtype=torch.int8)
    sw = torch.empty(w.shape[0], dtype=torch.float32)
    for r in range(0, w.shape[0], 4096):  # in slices: an fp32 copy of a whole LM head would be ~1 GB at 1B
        part = w[r:r + 4096].detach().float()
        s = (part.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q[r:r + 4096] = torch.round(part / s[:, None]).clamp(-127, 127)
        sw[r:r + 4096] = s
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
    packed = F.pad(q, (0, kp - k)).view(n // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = (q.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
    return packed, comp


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether the compiled W8A8 kernel runs here for activations in `dtype` (AVX-512 VNNI or AVX2)."""
    k = kernels.load()
    return (k is not None and getattr(k, "linear_w8a8_available", lambda: False)()
            and dtype in (torch.float32, torch.bfloat16))


def kernel_isa() -> str:
    """"avx512-vnni", "avx2", or "torch" (the reference: no compiled kernel for this CPU or build)."""
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
        if hadamard:
            weight = fwht(weight.detach().double(), hadamard) / hadamard  # in fp64; the division is by a power of 2
        q, sw = quantize_weight(weight)
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


def residual_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal [n, n] matrix that mixes every coordinate into all others, fp64: (R_m kron H_p) D with
    n = p m, p the largest power of two dividing n, H_p the normalized Hadamard matrix, R_m a random orthogonal
    m x m matrix (QR of a seeded Gaussian; m is small: 9 for SmolLM2's 576, 1 for 2048, 3 for 3072) and D
    random signs. Every entry is O(1/sqrt(n)): no coordinate of x Q is made of a few of x's."""
    p = n & -n
    m = n // p
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    r, tri = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    r = r * torch.sign(torch.diagonal(tri))[None, :]
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return torch.kron(r.contiguous(), h / p ** 0.5) * signs[None, :]


def _chunks(rows: int, step: int = 4096):
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


@torch.no_grad()
def _rotated(w: torch.Tensor, q: torch.Tensor, gamma: torch.Tensor | None = None, side: str = "in") -> torch.Tensor:
    """fp32 `(w diag(gamma)) Q` (side "in": a reader of the residual stream) or `Q^T w` ("out": a writer), computed
    in slices of rows (an LM head's fp32 copy would be ~1 GB at 1B)."""
    qf = q.float()
    if side == "out":
        wf = w.float()
        return torch.cat([qf[:, a:b].t() @ wf for a, b in _chunks(w.shape[0])])
    out = torch.empty(w.shape, dtype=torch.float32)
    for a, b in _chunks(w.shape[0]):
        part = w[a:b].float()
        out[a:b] = (part if gamma is None else part * gamma.float()[None, :]) @ qf
    return out


# W8A8 everywhere, the LM head included: measured on SmolLM2 (docs/quantization.md, "W8A8"), an int8 head over the
# rotated stream costs no measurable perplexity, and at 64 users the head is a fifth of the step's multiply-adds
QUANTIZE_HEAD = True


@torch.no_grad()
def quantize_model(model: nn.Module, dtype: torch.dtype, make=None) -> int:
    """Turn a LlamaModel's linears into W8A8Linears (returns how many), after rotating its residual stream.
    `make(weight fp32, bias, dtype, hadamard)` builds each linear instead (tests: float linears, to check that
    the rotation alone leaves the model's function as it is).

    Why the rotation: per-token int8 rounds every value of a row to the row's largest, and the residual stream of
    these models has a few channels far larger than the rest (RMSNorm's weights scale them further), so the
    inputs of q/k/v, gate/up and the LM head lose most of their bits: measured on SmolLM2, W8A8 as it is cost
    +4.1% perplexity, +1.7 points of it q/k/v's. An orthogonal Q (residual_rotation) leaves the model's function
    as it is (computational invariance, as QuaRot and SpinQuant use it) but spreads those channels over all:
    the embeddings become E Q; every reader of the stream W diag(gamma) Q with its RMSNorm's gamma folded in (an
    RMSNorm of x Q is the RMSNorm of x times Q: the norm of a vector does not change under Q), the norms' weights
    ones; every writer (o_proj, down_proj) Q^T W; the final norm's gamma goes into the LM head (untied from the
    embeddings). All of it at load, in fp32, so the int8 weights are rounded once, from the rotated values.
    down_proj's input (SiLU(gate) * up) cannot be rotated ahead of time, so its kernel applies a block Hadamard
    transform to each row before quantizing it (W8A8Linear's `hadamard`). Together: +0.3% on SmolLM2.

    The hidden states leave the body rotated: `model.w8a8_unrotate` (Q^T and the final gamma) turns them back
    where they are read as such (pooled embeddings, LlamaModel.unrotate_hidden)."""
    make = make or W8A8Linear
    layers = model.layers
    hidden = model.embed_tokens.weight.shape[1]
    q = residual_rotation(hidden)
    emb = model.embed_tokens.weight
    rot_emb = torch.empty(emb.shape, dtype=emb.dtype)
    for a, b in _chunks(emb.shape[0]):
        rot_emb[a:b] = (emb[a:b].float() @ q.float()).to(emb.dtype)
    head_w, gamma_f = model.lm_head.weight, model.norm.weight.detach().float().clone()
    model.embed_tokens.weight = nn.Parameter(rot_emb, requires_grad=False)  # untied from the head
    count = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        g1, g2 = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()

        def out_bias(lin: nn.Linear) -> torch.Tensor | None:
            return None if lin.bias is None else (lin.bias.detach().float() @ q.float()).to(dtype)

        attn.qkv_proj = make(_rotated(attn.qkv_proj.weight, q, g1), attn.qkv_proj.bias, dtype, 0)
        attn.o_proj = make(_rotated(attn.o_proj.weight, q, side="out"), out_bias(attn.o_proj), dtype, 0)
        mlp.gate_up_proj = make(_rotated(mlp.gate_up_proj.weight, q, g2), mlp.gate_up_proj.bias, dtype, 0)
        mlp.down_proj = make(_rotated(mlp.down_proj.weight, q, side="out"), out_bias(mlp.down_proj), dtype,
                             hadamard_block(mlp.down_proj.in_features))
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        count += 4
    head = _rotated(head_w, q, gamma_f)
    if QUANTIZE_HEAD:
        model.lm_head = make(head, None, dtype, 0)
        count += 1
    else:
        model.lm_head = nn.Linear(hidden, head.shape[0], bias=False)
        model.lm_head.weight = nn.Parameter(head.to(dtype), requires_grad=False)
    model.norm.weight.fill_(1.0)
    model.w8a8_unrotate = (q.t().float().contiguous(), gamma_f)
    return count
