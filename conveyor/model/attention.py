"""Attention over the paged KV cache: a compiled CPU kernel, and the pure-torch reference beside it.

One step's tokens from every request arrive flattened: `[num_tokens, heads, head_dim]`. The
runner builds `AttentionMetadata` once per step; every layer reuses it.

The cache layout is per layer `k_cache: [num_blocks, Hkv, head_dim, block_size]` (K transposed
inside a block, so that a tile of keys is contiguous for every dimension: the kernel's Q.K^T is a
run of vector FMAs with no transposition) and `v_cache: [num_blocks, Hkv, block_size, head_dim]`.

Two implementations read it:
- `kernel` (CPU, fp32/bf16): `conveyor/kernels/csrc/paged_attention.cpp`, one call per layer for the
  whole step, K/V read straight from the blocks through the block tables, GQA groups sharing each
  K/V load, a fixed KV tile order per query (the result for a token does not depend on its batch).
- `torch` (any device, any dtype): vectorised torch, the reference the kernel is tested against.
  Requests are split into decodes, whole prompts and continued chunks; a group's KV is gathered
  through the block tables and one `scaled_dot_product_attention` call does the masking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from conveyor import kernels
from conveyor.config import ATTENTION_BACKENDS, check_choice

log = logging.getLogger("conveyor.attention")

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
KERNEL_MAX_GROUP = 64


def cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K shape, V shape) of one layer's cache."""
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


def scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    """Shape of an int8 cache's scales (K and V each): one fp16 per token and KV head. fp16, not fp32,
    so that a token costs 2 * (D + 2) bytes per head instead of 2 * 2 * D: 1.94x the tokens of bf16 at
    D = 64 (fp32 scales would give 1.88x)."""
    return (num_blocks, num_kv_heads, block_size)


KV_SCALE_DTYPE = torch.float16


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hkv, D] -> (int8 [T, Hkv, D], fp16 scales [T, Hkv]): the kernel's arithmetic, in torch.

    The scale max|x| / 127 is rounded to fp16 and then moved one fp16 step up wherever rounding took it
    below max|x| / 127: a scale rounded down would push the largest values past 127 and into the clamp,
    an error of several steps for small heads whose scale is an fp16 subnormal (neighbours a few % apart).
    Rounded up, every value stays within half a step of what was stored.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / 127).to(KV_SCALE_DTYPE)
    up = (scale.view(torch.int16) + 1).view(KV_SCALE_DTYPE)  # the next fp16 above a scale >= 0, on any device
    scale = torch.where(scale.float() * 127 < amax, up, scale)
    sf = scale.float()[..., None]
    q = torch.where(sf > 0, torch.round(xf / torch.where(sf > 0, sf, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8), scale


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> str:
    """'kernel' where the compiled kernel applies and builds, else 'torch'. `requested`: auto | kernel | torch."""
    check_choice("attention backend", requested, ATTENTION_BACKENDS)
    if requested == "torch":
        return "torch"
    why = None
    if device.type != "cpu":
        why = f"device {device.type}"
    elif dtype not in KERNEL_DTYPES:
        why = f"dtype {dtype}"
    elif head_dim not in KERNEL_HEAD_DIMS or num_heads // num_kv_heads > KERNEL_MAX_GROUP:
        why = f"head_dim {head_dim} / GQA group {num_heads // num_kv_heads}"
    elif kernels.load() is None:
        why = "it could not be built"
    if why is None:
        return "kernel"
    if requested == "kernel":
        raise ValueError(f"the compiled attention kernel was asked for but does not apply: {why}")
    log.info("attention: pure-torch path (compiled kernel not used: %s)", why)
    return "torch"


@dataclass
class AttentionGroup:
    """Reference path: one group of requests padded to a common query length."""

    num_seqs: int
    max_query_len: int
    query_index: torch.Tensor  # [num_seqs * max_query_len] -> flat token index (padding -> 0)
    token_index: torch.Tensor  # [n] flat token indices that belong to this group
    out_index: torch.Tensor  # [n] where each of those tokens sits in the padded layout
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_blocks * block_size] bool, True = attend
    identity: bool = False  # tokens already in padded order (a pure decode group): skip the scatter
    fresh: bool = False  # whole prompts with no earlier context: attend to this step's K/V, plain causal

    def to(self, device: torch.device) -> AttentionGroup:
        return AttentionGroup(self.num_seqs, self.max_query_len, self.query_index.to(device),
                              self.token_index.to(device), self.out_index.to(device),
                              self.block_tables.to(device), None if self.mask is None else self.mask.to(device),
                              self.identity, self.fresh)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 -> slot = block * block_size + offset
    block_size: int
    backend: str = "torch"
    groups: list[AttentionGroup] | None = None  # torch backend
    block_tables: torch.Tensor | None = None  # kernel backend: int32 [num_seqs, max_blocks]
    cu_query_lens: torch.Tensor | None = None  # kernel backend: int32 [num_seqs + 1]
    context_lens: torch.Tensor | None = None  # kernel backend: int32 [num_seqs]


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    backend: str = "torch",
) -> AttentionMetadata:
    """Describe one flattened step: request i contributes query_lens[i] tokens ending at context_lens[i]."""
    n = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    nbs = -(-ctx // block_size)
    max_blocks = int(nbs.max()) if n else 0
    tables = np.zeros((n, max_blocks), dtype=np.int64)
    for i, (t, nb) in enumerate(zip(block_tables, nbs)):
        tables[i, :nb] = t[:nb]
    # slot of every token: position -> (block via the table, offset)
    seq_of = np.repeat(np.arange(n), q_lens)
    pos = np.arange(cu[-1]) - cu[seq_of] + (ctx - q_lens)[seq_of]
    slots = tables[seq_of, pos // block_size] * block_size + pos % block_size
    meta = AttentionMetadata(torch.from_numpy(slots).to(device), block_size, backend)
    if backend == "kernel":
        meta.block_tables = torch.from_numpy(tables.astype(np.int32))
        meta.cu_query_lens = torch.from_numpy(cu.astype(np.int32))
        meta.context_lens = torch.from_numpy(ctx.astype(np.int32))
        return meta
    decode = [i for i, q in enumerate(query_lens) if q == 1]
    fresh = [i for i, q in enumerate(query_lens) if q > 1 and context_lens[i] == q]
    cont = [i for i, q in enumerate(query_lens) if q > 1 and context_lens[i] > q]
    meta.groups = [_build_group(m, query_lens, context_lens, tables, cu, block_size, fresh=m is fresh).to(device)
                   for m in (decode, fresh, cont) if m]
    return meta


def _build_group(members, query_lens, context_lens, tables, starts, block_size, fresh=False) -> AttentionGroup:
    n = len(members)
    max_q = max(query_lens[i] for i in members)
    max_blocks = max(-(-context_lens[i] // block_size) for i in members)
    group_tables = torch.from_numpy(tables[members, :max_blocks].copy())
    q_lens = torch.tensor([query_lens[i] for i in members])
    ctx_lens = torch.tensor([context_lens[i] for i in members])
    starts_t = torch.tensor([int(starts[i]) for i in members])
    j = torch.arange(max_q)
    valid = j[None, :] < q_lens[:, None]  # [n, max_q]
    query_index = torch.where(valid, starts_t[:, None] + j[None, :], 0).reshape(-1)
    # absolute position of each padded query; padding rows look at key 0 only (never all-masked)
    q_pos = torch.where(valid, (ctx_lens - q_lens)[:, None] + j[None, :], 0)
    mask = None
    if not fresh:  # causal; also hides the padding beyond each request's context
        mask = (torch.arange(max_blocks * block_size)[None, None, :] <= q_pos[:, :, None])[:, None]
    flat_valid = valid.reshape(-1).nonzero().squeeze(1)
    token_index = query_index[flat_valid]
    identity = max_q == 1 and members == list(range(members[0], members[0] + n))
    return AttentionGroup(n, max_q, query_index, token_index, flat_valid, group_tables, mask, identity, fresh)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
             ) -> None:
    """Store this step's K/V [T, Hkv, D] in their slots (int8 caches: quantized, scales beside)."""
    if meta.backend == "kernel":
        kernels.load().write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return
    bs = meta.block_size
    blk, off = meta.slot_mapping // bs, meta.slot_mapping % bs
    if k_cache.dtype == torch.int8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        k_scale.permute(0, 2, 1).index_put_((blk, off), ks)  # [NB, BS, Hkv] view
        v_scale.permute(0, 2, 1).index_put_((blk, off), vs)
    k_cache.permute(0, 3, 1, 2).index_put_((blk, off), k.to(k_cache.dtype))  # [NB, BS, Hkv, D] view
    v_cache.permute(0, 2, 1, 3).index_put_((blk, off), v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size]
    v_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,  # int8 caches: fp16 [num_blocks, Hkv, block_size]
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into their slots, then attend every query to its request's context."""
    write_kv(k, v, k_cache, v_cache, meta, k_scale, v_scale)
    if meta.backend == "kernel":
        q = q.contiguous()
        out = torch.empty_like(q)
        kernels.load().paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.cu_query_lens,
                                       meta.context_lens, scale, k_scale, v_scale)
        return out
    return _torch_attention(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)


def _torch_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                     k_scale=None, v_scale=None) -> torch.Tensor:
    _, hkv, d, bs = k_cache.shape
    h = q.shape[1]
    out = q.new_empty(q.shape)
    gqa = h != hkv
    quantized = k_cache.dtype == torch.int8
    dtype = torch.float32 if quantized else q.dtype
    for g in meta.groups:
        n, mq = g.num_seqs, g.max_query_len
        qg = q.index_select(0, g.query_index).view(n, mq, h, d).transpose(1, 2).to(dtype)
        if g.fresh and not quantized:  # padded keys sit after every valid query: the causal mask hides them
            kg = k.index_select(0, g.query_index).view(n, mq, hkv, d).transpose(1, 2).to(q.dtype)
            vg = v.index_select(0, g.query_index).view(n, mq, hkv, d).transpose(1, 2).to(q.dtype)
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            nb = g.block_tables.shape[1]
            table = g.block_tables.view(-1)
            kg = k_cache.index_select(0, table).view(n, nb, hkv, d, bs)
            vg = v_cache.index_select(0, table).view(n, nb, hkv, bs, d)
            if quantized:  # dequantize in fp32: [n, nb, hkv, bs] scales
                kg = kg.float() * k_scale.index_select(0, table).view(n, nb, hkv, 1, bs).float()
                vg = vg.float() * v_scale.index_select(0, table).view(n, nb, hkv, bs, 1).float()
            kg = kg.permute(0, 2, 1, 4, 3).reshape(n, hkv, nb * bs, d)
            vg = vg.permute(0, 2, 1, 3, 4).reshape(n, hkv, nb * bs, d)
            mask = g.mask
            if mask is None:  # a fresh group read back from an int8 cache: plain causal over its own tokens
                mask = (torch.arange(nb * bs, device=q.device)[None, :] <= torch.arange(mq, device=q.device)[:, None])
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=gqa)
        og = og.transpose(1, 2).reshape(n * mq, h, d).to(q.dtype)
        if g.identity and len(meta.groups) == 1:
            return og
        out.index_copy_(0, g.token_index, og.index_select(0, g.out_index))
    return out
