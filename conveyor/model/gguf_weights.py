"""GGUF block weights served as the file ships them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants Q4_K,
Q5_K, Q6_K, run by `linear_gguf.cpp` (int8 dot products on quantized activations, as llama.cpp does).

Why: CPU users hold GGUF files in these formats (Q4_K_M above all). Dequantized on load, an 8B Q4_K_M file
(4.9 GB) becomes 16 GB of bf16 and a decode step reads three times the bytes. Kept, each tensor's blocks are
repacked once (the same bytes, rearranged for the SIMD lanes) and read as they are.

Which weights are kept (`keep_policy` per file, from its header; then `keepable` per tensor, packed by the
loader's per-tensor hook `loader.keep_gguf_tensor` as the runner builds each layer): by default, every tensor
of a type above in a file whose layer weights are mostly one of those types, except Q4_1: the built-in model
(SmolLM2-135M-Instruct, a Q4_1 file) keeps the behaviour it always had, dequantized to the model's dtype
(`--quantization int4` keeps its Q4_1 blocks on the int4 kernel, as before). `--quantization gguf` keeps
every tensor of a kernel type whatever the file (Q4_1 included); `--quantization none` dequantizes
everything; `int8` / `int4` quantize the dequantized weights as before. A Q4_K_M file mixes types (Q6_K for
the output and half of ffn_down / attn_v; a 576-wide model falls back to Q5_0 / Q8_0 where rows are not
whole 256-blocks): each tensor keeps its own, and a fused q/k/v or gate/up linear runs its parts side by side
in one call (`GGUFLinear`). The embedding is looked up from the same packed blocks (the rows asked for are
dequantized as gguf-py would), so a tied LM head and the embedding share one copy.

The references (tests/model/test_gguf_weights.py): `GGUFWeight.dequantize` is gguf-py's own
`gguf.quants.dequantize`; `GGUFLinear.reference` is fp32 `x @ W^T` on it; `emulate` is the kernel's integer
arithmetic in torch (activation blocks quantized to int8, exact integer sums, the scales in fp32).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from conveyor import kernels

log = logging.getLogger("conveyor.gguf")

# ggml's type ids of the types the kernels take, and (elements, bytes) of one block
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# kept without being asked; Q4_1 is left out so that the built-in model's default stays what it was
DEFAULT_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
COLUMNS = 16  # the kernels' column group: a kept weight needs N % 16 == 0


@dataclass
class GGUFWeight:
    """An [N, K] weight of GGUF blocks, held in the kernels' layout (`gguf_pack`: the file's bytes rearranged, not
    one changed), so that a load keeps one copy of it and none of the file's pages."""

    qtype: str
    packed: torch.Tensor  # uint8 [bytes], gguf_pack's layout
    shape: tuple[int, int]

    @staticmethod
    def from_raw(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFWeight:
        """From the file's bytes: `raw` [N, K / block elements * block bytes], row n being output n's blocks."""
        with warnings.catch_warnings():  # a read-only file mapping: gguf_pack only reads it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(raw).reshape(shape[0], -1))
        return GGUFWeight(qtype, kernels.load().gguf_pack(GGML_TYPES[qtype], src, shape[1]), shape)

    def raw(self, rows: torch.Tensor | None = None) -> np.ndarray:
        """The file's bytes of `rows` (default: all), [rows, row bytes]."""
        rows = torch.arange(self.shape[0]) if rows is None else rows
        return kernels.load().gguf_unpack_rows(GGML_TYPES[self.qtype], self.packed, *self.shape, rows).numpy()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], exactly as the loader dequantizes a file (gguf-py's dequantize)."""
        import gguf

        arr = gguf.quants.dequantize(self.raw(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(self.shape))

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


# --- which tensors a load keeps -------------------------------------------------------------------------------

def kernels_available() -> bool:
    k = kernels.load()
    return k is not None and hasattr(k, "gguf_available") and k.gguf_available()


def main_type(tensors) -> str | None:
    """The type holding most bytes among a GGUF's layer weights (`blk.*`, 2-D): what the file "is". `tensors`:
    the file's tensors as the loader reads them from its header (`loader.GGUFTensor`: name, shape, qtype,
    n_bytes)."""
    by_type: Counter = Counter()
    for t in tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            by_type[t.qtype] += int(t.n_bytes)
    return by_type.most_common(1)[0][0] if by_type else None


def keep_policy(tensors, quantization: str | None) -> frozenset[str]:
    """The GGUF types a load keeps as blocks (empty: dequantize everything), from the file's tensors (as
    `main_type` takes them) and `--quantization` (module docstring)."""
    if quantization in ("none", "int8", "int4"):
        return frozenset()
    if quantization == "gguf":
        types = frozenset(GGML_TYPES)
    else:
        main = main_type(tensors)
        types = frozenset(DEFAULT_TYPES) if main in DEFAULT_TYPES else frozenset()
    if types and not kernels_available():
        log.warning("no GGUF kernels in this build or on this CPU (they need AVX2 + FMA): dequantizing the weights")
        return frozenset()
    return types


def keepable(qtype: str, shape: tuple[int, ...], types: frozenset[str]) -> bool:
    """Whether a tensor of `qtype` and `shape` (numpy order: rows, cols) is kept as its blocks under `types` (a
    `keep_policy`): a 2-D weight of one of those types whose rows fill whole column groups. The loader's
    per-tensor hook (`loader.keep_gguf_tensor`) packs exactly the tensors this passes."""
    return qtype in types and len(shape) == 2 and shape[0] % COLUMNS == 0


# --- modules --------------------------------------------------------------------------------------------------

def _pack(weights: list[GGUFWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' packed blocks one after the other (one part: its own tensor, no copy), and meta int64 [P, 3]
    (type, N, byte offset)."""
    meta, at = [], 0
    for w in weights:
        meta.append((GGML_TYPES[w.qtype], w.shape[0], at))
        at += w.nbytes
    packed = weights[0].packed if len(weights) == 1 else torch.cat([w.packed for w in weights])
    return packed, torch.tensor(meta, dtype=torch.int64)


class GGUFLinear(nn.Module):
    """y = x W^T with W one or more GGUF weights side by side (fused q/k/v, gate/up), each in its own type."""

    batch_invariant = True  # each row is computed alone (linear_gguf.cpp)

    def __init__(self, weights: list[GGUFWeight], dtype: torch.dtype) -> None:
        super().__init__()
        k = {w.shape[1] for w in weights}
        if len(k) != 1:
            raise ValueError("fused GGUF parts must share K")
        self.in_features = k.pop()
        self.out_features = sum(w.shape[0] for w in weights)
        self.parts = [(w.qtype, w.shape[0]) for w in weights]
        self.dtype = dtype
        self.bias = None
        packed, meta = _pack(weights)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("meta", meta, persistent=False)

    @property
    def qtypes(self) -> list[str]:
        return [t for t, _ in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.dtype not in (torch.float32, torch.bfloat16):
            return kernels.load().gguf_linear(x.float(), self.packed, self.meta).to(x.dtype)
        return kernels.load().gguf_linear(x, self.packed, self.meta)

    def weights(self) -> list[GGUFWeight]:
        """The parts, each its own GGUFWeight (views of this module's bytes)."""
        out = []
        for (qtype, n), (_, _, at) in zip(self.parts, self.meta.tolist()):
            qk, bb = BLOCKS[qtype]
            nbytes = n * self.in_features // qk * bb
            out.append(GGUFWeight(qtype, self.packed[at:at + nbytes], (n, self.in_features)))
        return out

    def dequantize(self) -> torch.Tensor:
        return torch.cat([w.dequantize() for w in self.weights()])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x @ dequantized W^T: what the kernel approximates (its activations are int8)."""
        return x.float() @ self.dequantize().T


class GGUFEmbedding(nn.Module):
    """Embedding rows looked up from a one-part GGUFLinear's packed blocks (a tied LM head shares them)."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if len(table.parts) != 1:
            raise ValueError("an embedding is one GGUF tensor")
        self.table = table
        self.qtype, self.num_embeddings = table.parts[0]
        self.embedding_dim = table.in_features
        self.dtype = dtype

    def tied_head(self) -> GGUFLinear:
        """The LM head of a model whose head is tied to this embedding: the same blocks, not a copy."""
        return self.table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = kernels.load().gguf_dequant_rows(GGML_TYPES[self.qtype], self.table.packed, self.num_embeddings,
                                                self.embedding_dim, ids.reshape(-1).to(torch.int64).contiguous())
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)


# --- the kernel's arithmetic in torch (the reference for linear_gguf.cpp) -------------------------------------

def quantize_rows(x: torch.Tensor, qk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], d fp32 [M, K / qk], sums per 16 int32 [M, K / 16]), as the kernel does:
    amax per block, d = amax / 127, q = clamp(round_half_even(x * (127 / amax)), -127, 127)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // qk, qk)
    amax = xb.abs().amax(-1)
    # tensor by tensor: torch turns a division by (or of) a Python scalar into a multiplication by a rounded
    # reciprocal, one ulp off the kernel's division now and then
    c127 = torch.full_like(amax, 127.0)
    d = amax / c127
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, 1.0), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(m, k)
    sums = q.reshape(m, k // 16, 16).sum(-1, dtype=torch.int32)
    return q, d, sums


def decode(w: GGUFWeight) -> dict[str, torch.Tensor]:
    """A weight's integers and scales: q [N, K] (unsigned as stored; Q8_0 signed), d (and m / dmin) fp32 per
    block [N, blocks], k-quant sub-block scales sc (and mins m) [N, blocks, sub-blocks]."""
    import gguf

    n, k = w.shape
    qk, bb = BLOCKS[w.qtype]
    b = w.raw().reshape(n * (k // qk), bb)
    f16 = lambda a: torch.from_numpy(a.copy().view(np.float16).astype(np.float32)).reshape(n, k // qk)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if w.qtype == "Q8_0":
        out["d"] = f16(b[:, :2])
        out["q"] = torch.from_numpy(b[:, 2:].copy().view(np.int8).astype(np.int64)).reshape(n, k)
    elif qk == 32:
        out["d"] = f16(b[:, :2])
        at = 2
        if w.qtype in ("Q4_1", "Q5_1"):
            out["m"] = f16(b[:, 2:4])
            at = 4
        qh = None
        if w.qtype in ("Q5_0", "Q5_1"):
            qh = b[:, at:at + 4].copy().view(np.uint32)[:, 0]
            at += 4
        qs = b[:, at:at + 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)
        if qh is not None:
            q |= ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        out["q"] = torch.from_numpy(q).reshape(n, k)
    elif w.qtype in ("Q4_K", "Q5_K"):
        out["d"], out["dmin"] = f16(b[:, :2]), f16(b[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        out["sc"] = torch.from_numpy(sc.astype(np.int64)).reshape(n, k // qk, 8)
        out["m"] = torch.from_numpy(m.astype(np.int64)).reshape(n, k // qk, 8)
        qs = b[:, 48:] if w.qtype == "Q5_K" else b[:, 16:]
        q = np.stack([qs.reshape(-1, 4, 32) & 15, qs.reshape(-1, 4, 32) >> 4], axis=2).reshape(-1, 256).astype(np.int64)
        if w.qtype == "Q5_K":
            qh = b[:, 16:48]
            bit = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [blocks, sub-block, 32]
            q |= bit.reshape(-1, 256).astype(np.int64) << 4
        out["q"] = torch.from_numpy(q).reshape(n, k)
    else:  # Q6_K
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [.., half, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        out["q"] = torch.from_numpy((low | (high << 4)).reshape(-1, 256).astype(np.int64)).reshape(n, k)
        out["sc"] = torch.from_numpy(b[:, 192:208].copy().view(np.int8).astype(np.int64)).reshape(n, k // qk, 16)
        out["d"] = f16(b[:, 208:210])
    return out


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), computed in fp64 (a * b is exact there) and rounded once more to fp32: equal to the
    fused result but for a rare double rounding (the tests allow an ulp)."""
    return (a.double() * b.double() + c.double()).float()


def emulate(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """The kernel's arithmetic in torch: fp32 [M, N] (before the rounding to the output dtype). Integer sums are
    exact in fp64 (every partial sum is far below 2^53); the fp32 steps follow linear_gguf.cpp's numerics."""
    n, k = w.shape
    qk, _ = BLOCKS[w.qtype]
    nb = k // qk
    xq, xd, xs = quantize_rows(x, qk)
    m = x.shape[0]
    p = decode(w)
    qx = xq.double().reshape(m, nb, qk)
    qw = p["q"].double().reshape(n, nb, qk)
    y = torch.zeros(m, n)
    if qk == 32:
        dots = torch.einsum("mbi,nbi->mnb", qx, qw)  # exact integers
        bsum = xs.reshape(m, nb, 2).sum(-1).double()
        off = {"Q4_0": 8, "Q5_0": 16}.get(w.qtype, 0)
        s = dots - off * bsum[:, None, :]
        for b in range(nb):
            scale = (p["d"][None, :, b] * xd[:, None, b])  # fp32 product
            y = _fma(scale, s[:, :, b].float(), y)
            if "m" in p:
                y = _fma(p["m"][None, :, b] * xd[:, None, b], bsum[:, None, b].float().expand(m, n), y)
        return y
    sub = 32 if w.qtype in ("Q4_K", "Q5_K") else 16
    dots = torch.einsum("mbji,nbji->mnbj", qx.reshape(m, nb, qk // sub, sub), qw.reshape(n, nb, qk // sub, sub))
    bs = xs.reshape(m, nb, qk // sub, sub // 16).sum(-1).double()  # [m, nb, subs]
    sc = p["sc"].double()  # [n, nb, subs]
    if w.qtype == "Q6_K":
        isum = ((dots - 32 * bs[:, None]) * sc[None]).sum(-1)
    else:
        isum = (dots * sc[None]).sum(-1)
        msum = (bs[:, None] * p["m"].double()[None]).sum(-1)
    for b in range(nb):
        y = _fma(p["d"][None, :, b] * xd[:, None, b], isum[:, :, b].float(), y)
        if w.qtype != "Q6_K":
            y = _fma(-(p["dmin"][None, :, b] * xd[:, None, b]), msum[:, :, b].float(), y)
    return y
