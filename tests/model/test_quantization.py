"""Weight-only int8/int4: quantization error, the kernels against the dequantized reference, row
invariance of the kernels, the dense copy for big steps, and GGUF Q4 blocks mapped without rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.model import quantization
from conveyor.model.quantization import (
    QuantizedLinear,
    QuantizedWeight,
    int4_kernel_fits,
    int8_kernel_fits,
    quantize,
    quantize_int4,
    quantize_int8,
    tune_dense_threshold,
)


def test_int8_error_within_half_a_step():
    w = torch.randn(48, 96) * torch.rand(48, 1) * 3
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (48, 1) and qw.q.abs().max() <= 127
    assert ((qw.dequantize() - w).abs() <= qw.scale * 0.5001).all()


def test_int4_error_within_half_a_step():
    w = torch.randn(48, 96) * torch.rand(48, 1) * 3
    qw = quantize_int4(w, 32)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15 and qw.scale.shape == (48, 3)
    step = qw.scale.repeat_interleave(32, dim=1)
    assert ((qw.dequantize() - w).abs() <= step * 0.5001 + 1e-6).all()


def test_scales_are_representable_in_the_kernel_dtype():
    """q is chosen for the scale the kernel will actually see (rounded to bf16), not the exact one."""
    qw = quantize_int4(torch.randn(32, 64), 32, torch.bfloat16)
    assert torch.equal(qw.scale, qw.scale.bfloat16().float())
    assert torch.equal(qw.zero, qw.zero.bfloat16().float())


OURS = {"int4": int4_kernel_fits(quantize_int4(torch.randn(16, 32), 32), torch.float32),
        "int8": int8_kernel_fits(quantize_int8(torch.randn(16, 32)), torch.float32)}
# our kernels (linear_int8.cpp, linear_int4.cpp) where they run, and torch's (CONVEYOR_INT*_KERNEL=torch) everywhere
METHODS = ["int8", "int4", *(pytest.param(f"{bits}-ours", marks=pytest.mark.skipif(
    not OURS[bits], reason=f"our {bits} kernel needs AVX2 + FMA and the compiled kernels")) for bits in OURS)]


def quantized_linear(method: str, w: torch.Tensor, b, dtype, monkeypatch) -> QuantizedLinear:
    for bits in OURS:
        monkeypatch.setenv(f"CONVEYOR_{bits.upper()}_KERNEL", "ours" if method == f"{bits}-ours" else "torch")
    qw = quantize_int8(w, dtype) if method.startswith("int8") else quantize_int4(w, 32, dtype)
    lin = QuantizedLinear(qw, b, dtype)
    assert lin.ours == method.endswith("-ours")
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_kernel_matches_dequantized_reference(method, dtype, rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    lin = quantized_linear(method, w, b, dtype, monkeypatch)
    x = torch.randn(2, rows, 128, generator=g).to(dtype)
    y = lin(x)
    assert y.shape == (2, rows, 96) and y.dtype == dtype
    ref = lin.reference(x)
    # fp32: summation order only; bf16: one rounding of outputs of size ~|x||w| ~ 11 (ulp 2^-4 at 8..16)
    tol = 1e-4 if dtype == torch.float32 else 0.07
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_kernel_rows_do_not_depend_on_the_batch(method, monkeypatch):
    """A row's bits are the same alone, in any prefix of a batch, or in the full batch."""
    dtype = torch.bfloat16
    lin = quantized_linear(method, torch.randn(576, 1536), None, dtype, monkeypatch)
    x = torch.randn(40, 1536).to(dtype)
    full = lin(x)
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(40)]), full)
    for m in (2, 3, 5, 9, 17, 33):
        assert torch.equal(lin(x[:m]), full[:m])


def test_dense_copy_serves_big_steps(monkeypatch):
    """Above the threshold the dense (dequantized, oneDNN) copy runs; both stay close to the reference."""
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "2")
    model = torch.nn.Sequential(QuantizedLinear(quantize_int8(torch.randn(64, 64), torch.float32), None,
                                                torch.float32))
    assert tune_dense_threshold(model, 8192) == 2
    lin = model[0]
    assert lin.dense is not None and not lin.batch_invariant
    calls = []
    monkeypatch.setattr(lin, "quantized_mm", lambda x2: calls.append(x2.shape[0]) or QuantizedLinear.quantized_mm(
        lin, x2))
    x = torch.randn(5, 64)
    torch.testing.assert_close(lin(x[:2]), lin.reference(x[:2]), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lin(x), lin.reference(x), atol=1e-4, rtol=1e-5)
    assert calls == [2], "2 rows take the quantized kernel, 5 the dense copy"
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "none")
    assert tune_dense_threshold(model, 8192) is None and lin.dense is None and lin.batch_invariant


def test_measured_threshold_is_sane():
    """The startup measurement picks a threshold in range and leaves every layer consistent."""
    layers = torch.nn.Sequential(*[QuantizedLinear(quantize_int4(torch.randn(256, 256), 32, torch.float32), None,
                                                   torch.float32) for _ in range(3)])
    t = tune_dense_threshold(layers, 16)
    assert t is None or 0 <= t <= 64
    assert len({(m.dense_above, m.dense is None) for m in layers}) == 1


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_exactly(qtype):
    """The int4 layout holds a GGUF Q4 tensor's values exactly: no second rounding."""
    import gguf

    rows, cols = 48, 96
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, t)
    want = gguf.quants.dequantize(raw, t).reshape(rows, cols)
    qw = QuantizedWeight.from_gguf(raw, qtype, rows, cols)
    np.testing.assert_array_equal(qw.dequantize().numpy(), want)
    lin = QuantizedLinear(qw, None, torch.float32)
    x = torch.randn(3, cols)
    torch.testing.assert_close(lin(x), x @ torch.from_numpy(want).T, atol=1e-4, rtol=1e-5)


def test_fused_parts_concatenate():
    a, b = quantize_int4(torch.randn(32, 64)), quantize_int4(torch.randn(16, 64))
    c = QuantizedWeight.cat([a, b])
    assert torch.equal(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError):
        QuantizedWeight.cat([a, quantize_int8(torch.randn(16, 64))])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_chunked_quantization_gives_the_same_integers(method, monkeypatch):
    """Quantizing a chunk of rows at a time (bounded fp32 temporaries) is quantizing every row on its own."""
    w = (torch.randn(100, 64) * torch.rand(100, 1)).to(torch.bfloat16)
    whole = quantize(w, method, torch.bfloat16)
    monkeypatch.setattr(quantization, "QUANT_CHUNK_BYTES", 16 * 64 * 4)  # chunks of 16 rows, the last one short
    chunked = quantize(w, method, torch.bfloat16)
    assert torch.equal(chunked.q, whole.q) and torch.equal(chunked.scale, whole.scale)
    assert (whole.zero is None and chunked.zero is None) or torch.equal(chunked.zero, whole.zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_reference_weight_is_what_was_packed(method, dtype, monkeypatch):
    """The unpacked integers are not kept beside the packed ones: `reference_weight` unpacks them, exactly."""
    w = torch.randn(48, 64)
    qw = quantize_int8(w, dtype) if method.startswith("int8") else quantize_int4(w, 32, dtype)
    lin = quantized_linear(method, w, None, dtype, monkeypatch)
    torch.testing.assert_close(lin.reference_weight.dequantize(), qw.dequantize(), atol=0, rtol=0)


def test_dense_copies_only_where_they_fit(monkeypatch, caplog):
    """Dense copies that would take more than their memory budget are not built (nor timed): every step runs
    the quantized kernels."""
    import logging

    monkeypatch.delenv("CONVEYOR_QUANT_DENSE_ABOVE", raising=False)
    layers = torch.nn.Sequential(*[QuantizedLinear(quantize_int4(torch.randn(64, 64), 32, torch.float32), None,
                                                   torch.float32) for _ in range(2)])
    with caplog.at_level(logging.INFO, logger="conveyor.quantization"):
        assert tune_dense_threshold(layers, 64, memory_budget=2 * 64 * 64 * 4 - 1) is None
    assert all(m.dense is None and m.batch_invariant for m in layers)
    assert "dense copies for big steps would take" in caplog.text and "quantized vs dense" not in caplog.text
