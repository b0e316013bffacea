"""Paged attention equals plain causal attention, for any mix of decodes, whole prompts and chunks.

Hypothesis draws a step (each request: tokens already cached, tokens in this step), scatters the
requests' blocks over the pool in random order, pre-fills the cache with the earlier tokens' K/V,
and compares `paged_attention` with a dense per-request reference (GQA by repeating K/V heads).
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.attention import build_metadata, cache_shapes, paged_attention


def reference(q, k_all, v_all, num_cached: int, scale: float) -> torch.Tensor:
    """q: [n, H, D] for positions num_cached.. ; k_all/v_all: [num_cached + n, Hkv, D]."""
    h, hkv = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_all.repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    qpos = torch.arange(num_cached, num_cached + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > qpos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, D]


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    kinds = draw(st.lists(st.sampled_from(["decode", "prompt", "chunk"]), min_size=1, max_size=6))
    reqs = []
    for kind in kinds:
        if kind == "decode":
            cached, new = draw(st.integers(0, 40)), 1
        elif kind == "prompt":
            cached, new = 0, draw(st.integers(2, 40))
        else:
            cached, new = draw(st.integers(1, 40)), draw(st.integers(2, 40))
        reqs.append((cached, new))
    heads = draw(st.sampled_from([(4, 4), (4, 2), (6, 1)]))
    return block_size, reqs, heads, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(steps())
def test_paged_attention_matches_dense(step):
    block_size, reqs, (h, hkv), seed = step
    d = 8
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = sum(need) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)  # non-contiguous, interleaved tables
    tables, it = [], iter(order)
    for nb in need:
        tables.append([next(it) for _ in range(nb)])
    k_shape, v_shape = cache_shapes(num_blocks, block_size, hkv, d)
    k_cache = torch.randn(k_shape, generator=g)  # garbage everywhere else
    v_cache = torch.randn(v_shape, generator=g)
    full_k, full_v, qs = [], [], []
    for (cached, new), table in zip(reqs, tables):
        k_all = torch.randn(cached + new, hkv, d, generator=g)
        v_all = torch.randn(cached + new, hkv, d, generator=g)
        for pos in range(cached):  # earlier steps already wrote these
            k_cache[table[pos // block_size], :, :, pos % block_size] = k_all[pos]
            v_cache[table[pos // block_size], :, pos % block_size] = v_all[pos]
        full_k.append(k_all)
        full_v.append(v_all)
        qs.append(torch.randn(new, h, d, generator=g))
    q = torch.cat(qs)
    k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, reqs)])
    v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, reqs)])
    meta = build_metadata([n for _, n in reqs], [c + n for c, n in reqs], tables, block_size, torch.device("cpu"))
    scale = d ** -0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    start = 0
    for i, (cached, new) in enumerate(reqs):
        want = reference(qs[i], full_k[i], full_v[i], cached, scale)
        torch.testing.assert_close(out[start:start + new], want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, i=i: f"request {i} {reqs[i]}: {m}")
        start += new
        for pos in range(cached + new):  # this step's K/V landed in the request's own slots
            blk, off = tables[i][pos // block_size], pos % block_size
            torch.testing.assert_close(k_cache[blk, :, :, off], full_k[i][pos], atol=0, rtol=0)
            torch.testing.assert_close(v_cache[blk, :, off], full_v[i][pos], atol=0, rtol=0)


def test_groups_split_by_kind():
    """Decodes, whole prompts and continued chunks each get their own group (bounded padding)."""
    meta = build_metadata([1, 5, 3, 1], [9, 5, 7, 2], [[0, 1, 2], [3, 4], [5, 6], [7]], 4, torch.device("cpu"))
    kinds = sorted((grp.num_seqs, grp.max_query_len, grp.fresh) for grp in meta.groups)
    assert kinds == [(1, 3, False), (1, 5, True), (2, 1, False)]
    # slot = block * 4 + offset: position 8 of [0,1,2]; 0..4 of [3,4]; 4..6 of [5,6]; 1 of [7]
    assert meta.slot_mapping.tolist() == [8, 12, 13, 14, 15, 16, 24, 25, 26, 29]
