"""The compiled CPU attention kernel against the pure-torch reference path, and its batch invariance.

Random steps mix decodes, whole prompts and continued chunks over shuffled block tables (so a
request's blocks are scattered through the pool), with odd lengths, GQA ratios 1, 3 and 8, head
dims 64 and 128, block sizes below, at and above the kernel's 16-key tile, in fp32 and bf16.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import kernels
from conveyor.model.attention import build_metadata, cache_shapes, choose_backend, paged_attention

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="compiled kernels could not be built here")


def make_step(reqs, h, hkv, d, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = sum(need) + 2
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    it = iter(order)
    tables = [[next(it) for _ in range(nb)] for nb in need]
    k_shape, v_shape = cache_shapes(num_blocks, block_size, hkv, d)
    k_cache = torch.randn(k_shape, generator=g).to(dtype)
    v_cache = torch.randn(v_shape, generator=g).to(dtype)
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, heads, d, generator=g).to(dtype) for heads in (h, hkv, hkv))
    return tables, k_cache, v_cache, q, k, v


def run(backend, reqs, tables, k_cache, v_cache, q, k, v, block_size):
    meta = build_metadata([n for _, n in reqs], [c + n for c, n in reqs], tables, block_size,
                          torch.device("cpu"), backend)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = paged_attention(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5)
    return out, kc, vc


@st.composite
def steps(draw):
    kinds = draw(st.lists(st.sampled_from(["decode", "prompt", "chunk"]), min_size=1, max_size=5))
    reqs = []
    for kind in kinds:
        if kind == "decode":
            reqs.append((draw(st.integers(0, 70)), 1))
        elif kind == "prompt":
            reqs.append((0, draw(st.integers(2, 70))))
        else:
            reqs.append((draw(st.integers(1, 50)), draw(st.integers(2, 40))))
    h, hkv = draw(st.sampled_from([(4, 4), (9, 3), (8, 1), (24, 3)]))
    return (reqs, h, hkv, draw(st.sampled_from([32, 64, 80, 96, 128, 256])),
            draw(st.sampled_from([4, 16, 32, 64, 128])),
            draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=80, deadline=None)
@given(steps())
def test_kernel_matches_reference(step):
    reqs, h, hkv, d, block_size, dtype, seed = step
    data = make_step(reqs, h, hkv, d, block_size, dtype, seed)
    ref, kc_ref, vc_ref = run("torch", reqs, *data, block_size)
    out, kc, vc = run("kernel", reqs, *data, block_size)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "K/V written to different slots"
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output (ulp 2^-7 near 1..2)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_head_dim_against_the_reference(d, block_size, dtype):
    """Every compiled head dim, both tile paths: bf16 with 16-key tiles takes the vdpbf16ps path where the
    CPU has it (head dims in multiples of 32; 96 ends on a 32-wide chunk; block size 16 reads K row
    pairs as one line, 64 as two halves); fp32 and head dim 80 the fp32 tile (80 and 96 end on a chunk
    narrower than 64: once read past the row)."""
    reqs = [(37, 1), (0, 45), (20, 13), (150, 1)]
    data = make_step(reqs, 9, 3, d, block_size, dtype, d + block_size)
    ref, _, _ = run("torch", reqs, *data, block_size)
    out, _, _ = run("kernel", reqs, *data, block_size)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_batch_invariant(dtype):
    """A query's output bits do not depend on its neighbours, on chunking, or on the thread count."""
    block_size, h, hkv, d = 16, 9, 3, 64
    probe = (37, 1)  # a decode at position 37
    crowd = [(100, 1), (0, 50), (20, 13), (5, 1)]
    reqs = [probe] + crowd
    tables, k_cache, v_cache, q, k, v = make_step(reqs, h, hkv, d, block_size, dtype, 7)
    # alone: the probe's own row only
    alone, _, _ = run("kernel", [probe], tables[:1], k_cache, v_cache, q[:1], k[:1], v[:1], block_size)
    crowded, _, _ = run("kernel", reqs, tables, k_cache, v_cache, q, k, v, block_size)
    assert torch.equal(alone[0], crowded[0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single, _, _ = run("kernel", reqs, tables, k_cache, v_cache, q, k, v, block_size)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, crowded)
    # a prompt computed whole or as two chunks gives the same rows
    prompt = [(0, 30)]
    tbl, kc0, vc0, pq, pk, pv = make_step(prompt, h, hkv, d, block_size, dtype, 11)
    whole, _, _ = run("kernel", prompt, tbl, kc0, vc0, pq, pk, pv, block_size)
    first, kc1, vc1 = run("kernel", [(0, 12)], tbl, kc0, vc0, pq[:12], pk[:12], pv[:12], block_size)
    second, _, _ = run("kernel", [(12, 18)], tbl, kc1, vc1, pq[12:], pk[12:], pv[12:], block_size)
    assert torch.equal(torch.cat([first, second]), whole)


def test_choose_backend():
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, torch.bfloat16, 9, 3, 64) == "kernel"
    assert choose_backend("torch", cpu, torch.bfloat16, 9, 3, 64) == "torch"
    assert choose_backend("auto", cpu, torch.float16, 9, 3, 64) == "torch"
    assert choose_backend("auto", cpu, torch.float32, 9, 3, 72) == "torch"
    with pytest.raises(ValueError, match="does not apply"):
        choose_backend("kernel", cpu, torch.float16, 9, 3, 64)
    with pytest.raises(ValueError, match="auto, kernel or torch"):
        choose_backend("fast", cpu, torch.float32, 9, 3, 64)
