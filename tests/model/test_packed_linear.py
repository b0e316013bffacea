"""Prepacked oneDNN linears: same results as nn.Linear, and a row's result independent of the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.model import packed_linear
from conveyor.model.packed_linear import PackedLinear, onednn_packs_bf16, packing_available, padded_rows


def packable(dtype: torch.dtype):
    """`dtype` as a parameter, skipped where oneDNN cannot pack it (bf16 on an AVX2-only CPU)."""
    ok = packing_available(torch.device("cpu"), dtype) and (dtype != torch.bfloat16 or onednn_packs_bf16())
    return pytest.param(dtype, marks=pytest.mark.skipif(not ok, reason=f"oneDNN cannot pack {dtype} weights here"))


DTYPES = [packable(torch.float32), packable(torch.bfloat16)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_nn_linear(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(7, 96).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 3072)])  # SmolLM2's shapes
def test_rows_do_not_depend_on_the_batch(k, n, dtype):
    """oneDNN computes an odd last row on another path (K=1536 showed it); PackedLinear keeps M even."""
    torch.manual_seed(1)
    lin = PackedLinear(nn.Linear(k, n, bias=False).to(dtype), kernel="onednn")
    if lin.row_multiple is None:
        pytest.skip("no row padding makes oneDNN row-invariant for this shape on this CPU (logged)")
    x = torch.randn(80, k).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(80)])
    for m in list(range(1, 20)) + [31, 33, 63, 64, 65, 80]:
        assert torch.equal(lin(x[:m]), alone[:m]), f"M={m}"


def test_row_buckets_are_bounded_and_cheap():
    """Above 64 rows the row count is padded to one of 8 sizes per octave: a bounded set of oneDNN
    primitives (each ~0.65 MB, cached per shape) for at most 12.5% extra rows."""
    sizes = {padded_rows(m, 2) for m in range(1, 8193)}
    assert len(sizes) <= 100
    for m in range(1, 8193):
        r = padded_rows(m, 2)
        assert r >= m and r % 2 == 0
        assert r == m + (m % 2) if m <= 64 else r <= m * 1.125


@pytest.mark.parametrize("dtype", DTYPES)
def test_bucketed_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(2)
    lin = PackedLinear(nn.Linear(576, 1536, bias=False).to(dtype), kernel="onednn")
    if lin.row_multiple is None:
        pytest.skip("no row padding makes oneDNN row-invariant for this shape on this CPU (logged)")
    x = torch.randn(300, 576).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(300)])
    for m in (65, 100, 129, 200, 257, 300):
        assert torch.equal(lin(x[:m]), alone[:m]), f"M={m}"


def test_bf16_packing_is_offered_exactly_where_onednn_or_ours_can_pack():
    """On an AVX2-only CPU oneDNN refuses bf16 weights: `onednn_packs_bf16` must say so, and packing is then
    offered only through one of our kernels (`avx2` there); with neither, a bf16 model loads with plain
    nn.Linear (the runner asks `packing_available`). Where packing is offered it must work."""
    w = torch.randn(32, 64).bfloat16()
    if onednn_packs_bf16():
        torch.ops.mkldnn._reorder_linear_weight(w, None)
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert packing_available(torch.device("cpu"), torch.bfloat16) == (
        onednn_packs_bf16() or bool(packed_linear.available_kernels()))
    if packing_available(torch.device("cpu"), torch.bfloat16):
        lin = PackedLinear(nn.Linear(64, 32, bias=False).bfloat16())
        assert lin.kernel in ("onednn", *packed_linear.available_kernels())


def test_an_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel must be one of"):
        PackedLinear(torch.nn.Linear(32, 16).bfloat16(), kernel="foo")
