"""The fused CPU element-wise kernels against the model's torch reference ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import kernels
from conveyor.model.llama import RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="compiled kernels could not be built here")
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    res = torch.randn(37, 576, generator=g).to(dtype) if with_residual else None
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    want, want_res = norm(x.clone(), None if res is None else res.clone())
    norm.fused = True
    res_k = None if res is None else res.clone()
    got, got_res = norm(x.clone(), res_k)
    torch.testing.assert_close(got, want, **tol(dtype))
    if with_residual:
        assert torch.equal(got_res, want_res)  # residual add rounds the same way


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_column_slice(dtype):
    g = torch.Generator().manual_seed(1)
    t, h, hkv, d = 11, 9, 3, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos.float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q = qkv[:, : h * d].view(t, h, d)
    want = apply_rope(q.clone(), cos, sin)
    kernels.load().rope_(q, cos, sin)
    torch.testing.assert_close(q, want, **tol(dtype))
    assert torch.equal(qkv[:, h * d:], qkv[:, h * d:].clone())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 2 * 1000, generator=g) * 6).to(dtype)  # 1000: not a multiple of the vector width
    gate, up = x.split(1000, dim=-1)
    torch.testing.assert_close(kernels.load().silu_and_mul(x), F.silu(gate) * up, **tol(dtype))


def test_bf16_silu_and_mul_rounds_as_the_fp32_kernel_then_torch():
    """The bf16 kernel is the fp32 kernel's silu rounded to bf16 (as torch rounds), times up, rounded again:
    bit for bit, NaN and infinities and tiny products (denormal before rounding) included, over a width that
    leaves a scalar tail. (The AVX-512 bf16 path rounds in integer lanes: a hardware conversion would flush
    denormals to zero.)"""
    g = torch.Generator().manual_seed(3)
    inter = 1000
    gate = torch.randn(9, inter, generator=g) * 8
    up = torch.randn(9, inter, generator=g)
    gate[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -90.0, -200.0, 0.0])
    up[1, :4] = torch.tensor([1e-38, -3e-39, 1e-30, float("nan")])
    gate, up = gate.bfloat16(), up.bfloat16()
    ops = kernels.load()
    act = ops.silu_and_mul(torch.cat([gate.float(), torch.ones_like(gate, dtype=torch.float32)], dim=-1))
    want = (act.bfloat16().float() * up.float()).bfloat16()
    got = ops.silu_and_mul(torch.cat([gate, up], dim=-1))
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert (got.view(torch.int16)[nan] == 0x7FC0).all()  # c10's quiet NaN, as the scalar path writes it
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
