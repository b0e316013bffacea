"""int8 KV cache: the kernel against the torch reference, and both against attention over bf16 K/V.

The quantization itself is checked directly (scale per token and head, values within half a step),
then random mixed steps (decodes, prompts, chunks; GQA; block sizes below/at/above the 16-key tile)
run through both backends writing into int8 pools.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import kernels
from conveyor.model.attention import (
    KV_SCALE_DTYPE,
    build_metadata,
    cache_shapes,
    paged_attention,
    quantize_kv,
    scale_shape,
    write_kv,
)

needs_kernel = pytest.mark.skipif(kernels.load() is None, reason="compiled kernels could not be built here")


# Heads from 1e-9 to 1e3 in size: below ~8e-3 the scale max|x| / 127 is an fp16 subnormal, a few % apart.
MAGNITUDES = torch.logspace(-9, 3, 60)


def within_half_a_step(x, q, s):
    back = q.float() * s.float()[..., None]
    return (back - x).abs() <= s.float()[..., None] * 0.5 + 1e-5 * x.abs().amax(-1, keepdim=True)


def test_quantize_kv_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == KV_SCALE_DTYPE and s.shape == (50, 3)
    assert within_half_a_step(x, q, s).all()
    assert q.abs().max() <= 127


def test_quantize_kv_tiny_heads_stay_within_half_a_step():
    """A scale rounded down to an fp16 subnormal would clamp the largest values several steps off."""
    x = torch.randn(60, 2, 64, generator=torch.Generator().manual_seed(1)) * MAGNITUDES[:, None, None]
    q, s = quantize_kv(x)
    assert within_half_a_step(x, q, s).all()
    assert (s.float() > 0).all() and q.abs().max() <= 127


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_reference_bytes_for_every_magnitude(dtype):
    d, hkv, bs = 64, 2, 16
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(60, hkv, d, generator=g) * MAGNITUDES[:, None, None]).to(dtype)
    v = (torch.randn(60, hkv, d, generator=g) * MAGNITUDES.flip(0)[:, None, None]).to(dtype)
    table = list(range(4))
    pools = {}
    for backend in ("kernel", "torch"):
        pools[backend] = make_pools(4, bs, hkv, d)
        meta = build_metadata([60], [60], [table], bs, torch.device("cpu"), backend)
        write_kv(k, v, *pools[backend][:2], meta, *pools[backend][2:])
    for a, b in zip(pools["kernel"], pools["torch"]):
        assert torch.equal(a, b)
    zq, zs = quantize_kv(torch.zeros(2, 1, 8))
    assert (zq == 0).all() and (zs == 0).all()


def make_pools(num_blocks, block_size, hkv, d):
    k_shape, v_shape = cache_shapes(num_blocks, block_size, hkv, d)
    s_shape = scale_shape(num_blocks, block_size, hkv)
    return (torch.zeros(k_shape, dtype=torch.int8), torch.zeros(v_shape, dtype=torch.int8),
            torch.zeros(s_shape, dtype=KV_SCALE_DTYPE), torch.zeros(s_shape, dtype=KV_SCALE_DTYPE))


def run_steps(backend, steps, tables, h, hkv, d, block_size, dtype, pools, seed):
    """Feed each request's tokens in the given chunks; returns the concatenated outputs."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    done = [0] * len(tables)
    for step in steps:  # step: list of (request, num_tokens)
        n_tok = sum(n for _, n in step)
        q, k, v = (torch.randn(n_tok, heads, d, generator=g).to(dtype) for heads in (h, hkv, hkv))
        meta = build_metadata([n for _, n in step], [done[r] + n for r, n in step], [tables[r] for r, _ in step],
                              block_size, torch.device("cpu"), backend)
        outs.append(paged_attention(q, k, v, *pools[:2], meta, d ** -0.5, *pools[2:]))
        for r, n in step:
            done[r] += n
    return torch.cat(outs)


@st.composite
def workloads(draw):
    n_req = draw(st.integers(1, 4))
    lens = [draw(st.integers(1, 60)) for _ in range(n_req)]
    steps, left = [], list(lens)
    while any(left):
        step = []
        for r in range(n_req):
            if left[r]:
                n = min(left[r], draw(st.integers(1, 40)))
                step.append((r, n))
                left[r] -= n
        steps.append(step)
    h, hkv = draw(st.sampled_from([(4, 4), (9, 3), (8, 1)]))
    return (lens, steps, h, hkv, draw(st.sampled_from([64, 128])), draw(st.sampled_from([4, 16, 32])),
            draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.integers(0, 2**31 - 1)))


def tables_for(lens, block_size, seed):
    need = [-(-n // block_size) for n in lens]
    order = list(range(sum(need) + 2))
    random.Random(seed).shuffle(order)
    it = iter(order)
    return [[next(it) for _ in range(nb)] for nb in need], len(order)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(workloads())
def test_int8_kernel_matches_torch_reference(w):
    lens, steps, h, hkv, d, bs, dtype, seed = w
    tables, nb = tables_for(lens, bs, seed)
    pk, pt = make_pools(nb, bs, hkv, d), make_pools(nb, bs, hkv, d)
    out_k = run_steps("kernel", steps, tables, h, hkv, d, bs, dtype, pk, seed)
    out_t = run_steps("torch", steps, tables, h, hkv, d, bs, dtype, pt, seed)
    for a, b in zip(pk, pt):  # the same integers and scales were written
        assert torch.equal(a, b)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_k.float(), out_t.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["torch", pytest.param("kernel", marks=needs_kernel)])
def test_int8_attention_close_to_bf16(backend):
    """The quantization error stays small next to attention over unquantized K/V."""
    lens, bs, h, hkv, d = [40, 7, 33], 16, 9, 3, 64
    steps = [[(0, 30), (1, 7), (2, 16)], [(0, 10), (2, 17)], [(0, 1), (1, 1), (2, 1)]]
    tables, nb = tables_for(lens, bs, 1)
    k_shape, v_shape = cache_shapes(nb, bs, hkv, d)
    dense = (torch.zeros(k_shape), torch.zeros(v_shape))
    ref = run_steps(backend, steps, tables, h, hkv, d, bs, torch.float32, dense, 3)
    out = run_steps(backend, steps, tables, h, hkv, d, bs, torch.float32, make_pools(nb, bs, hkv, d), 3)
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.03, err  # int8 steps of max|x|/127 on N(0, 1) data; outputs are O(1)
