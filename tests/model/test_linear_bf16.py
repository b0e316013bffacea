"""Our bf16 linear kernels against the plain fp32 matmul, and a row's bits independent of the rows beside
it, by construction: `dpbf16` (`kernels/csrc/linear_bf16.cpp`, one vdpbf16ps chain per output), `amx`
(`kernels/csrc/linear_amx.cpp`, one tile element per output, K in order) and `avx2`
(`kernels/csrc/linear_avx2.cpp`, one fp32 FMA chain per output), each where the CPU has it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor import kernels
from conveyor.model import packed_linear
from conveyor.model.packed_linear import PackedLinear, onednn_packs_bf16, packing_available

_k = kernels.load()
pytestmark = pytest.mark.skipif(
    _k is None or not packed_linear.available_kernels() or not packing_available(torch.device("cpu"), torch.bfloat16),
    reason="none of our bf16 linear kernels runs on this CPU or build")
OURS = [pytest.param(name, marks=pytest.mark.skipif(name not in packed_linear.available_kernels(),
                                                     reason=f"no {name} on this CPU or build"))
        for name in ("dpbf16", "amx", "avx2")]
# where a bf16 shape fits none of ours: oneDNN's packed matmul, or torch's where oneDNN cannot pack bf16 (AVX2)
FALLBACK = "onednn" if onednn_packs_bf16() else "torch"


def reference(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    y = x.float() @ lin.weight.float().T
    return (y if lin.bias is None else y + lin.bias.float()).bfloat16()


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 576, 3072), (7, 1536, 576), (64, 576, 576), (5, 2, 16),
                                   (13, 34, 48), (130, 96, 80), (300, 64, 208), (70, 5000, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", OURS)
def test_matches_the_fp32_matmul(m, k, n, bias, kernel):
    """Within bf16's rounding of the output (fp32 accumulation, one rounding at the end), for odd row
    counts, column counts that are not a multiple of the 64-column register block, and more rows than
    one 128-row pass, and a K the AVX2 kernel takes in spans (2,048, 2,048, then 904)."""
    if kernel == "amx" and k % 32:
        k += 32 - k % 32  # AMX tiles take K in steps of 32
    torch.manual_seed(m * 7 + k + n)
    lin = nn.Linear(k, n, bias=bias).bfloat16()
    x = torch.randn(m, k).bfloat16()
    ours = PackedLinear(lin, kernel=kernel)
    assert ours.kernel == kernel and ours.row_multiple == 1
    torch.testing.assert_close(ours(x).float(), reference(x, lin).float(), atol=2e-2, rtol=1.6e-2)
    # 3-D inputs keep their leading dims
    assert ours(x.view(1, m, k)).shape == (1, m, n)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 3072), (64, 48), (5000, 48)])
@pytest.mark.parametrize("kernel", OURS)
def test_rows_are_bit_identical_whatever_the_batch(k, n, kernel):
    if kernel == "amx" and k % 32:
        k += 32 - k % 32  # AMX tiles take K in steps of 32
    torch.manual_seed(3)
    lin = PackedLinear(nn.Linear(k, n, bias=False).bfloat16(), kernel=kernel)
    x = torch.randn(300, k).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(300)])
    for m in [*range(1, 14), 31, 64, 65, 127, 128, 129, 200, 300]:
        assert torch.equal(lin(x[:m]), alone[:m]), f"M={m}"
    assert torch.equal(lin(x[5:70]), alone[5:70])  # rows at other offsets too


@pytest.mark.parametrize("kernel", OURS)
def test_zero_rows(kernel):
    lin = PackedLinear(nn.Linear(32, 16, bias=False).bfloat16(), kernel=kernel)
    assert lin(torch.empty(0, 32, dtype=torch.bfloat16)).shape == (0, 16)


def test_shapes_it_cannot_take_fall_back_to_onednn_or_torch():
    odd = nn.Linear(64, 40, bias=False).bfloat16()  # N not a multiple of 16
    fallback = PackedLinear(odd)
    assert fallback.kernel == FALLBACK
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(fallback(x).float(), reference(x, odd).float(), atol=2e-2, rtol=1.6e-2)
    with pytest.raises(ValueError, match="N % 16"):
        PackedLinear(odd, kernel=packed_linear.available_kernels()[0])
    assert PackedLinear(nn.Linear(64, 48)).kernel == "onednn"  # fp32: oneDNN's


def test_the_choice_is_measured_once_remembered_and_can_be_forced(monkeypatch, tmp_path):
    ours = packed_linear.available_kernels()
    choice, measured = packed_linear._measure_linear_kernels(_k, ours)
    assert choice in ("onednn", *ours) and len(measured) == 2 * (onednn_packs_bf16() + len(ours))
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    monkeypatch.delenv("CONVEYOR_LINEAR_KERNEL", raising=False)
    monkeypatch.setattr(packed_linear, "_LINEAR_KERNEL", None)
    first = packed_linear.linear_kernel()
    # a later start on this machine reads the decision back instead of timing again (noise cannot flip it)
    monkeypatch.setattr(packed_linear, "_measure_linear_kernels", lambda *a: pytest.fail("measured again"))
    for _ in range(3):
        monkeypatch.setattr(packed_linear, "_LINEAR_KERNEL", None)
        assert packed_linear.linear_kernel() == first
    monkeypatch.setattr(packed_linear, "_LINEAR_KERNEL", None)
    monkeypatch.setenv("CONVEYOR_LINEAR_KERNEL", "onednn")
    assert packed_linear.linear_kernel() == "onednn"
    assert PackedLinear(nn.Linear(64, 48, bias=False).bfloat16()).kernel == FALLBACK
    monkeypatch.setattr(packed_linear, "_LINEAR_KERNEL", None)
    monkeypatch.setenv("CONVEYOR_LINEAR_KERNEL", "fastest")
    with pytest.raises(ValueError, match="CONVEYOR_LINEAR_KERNEL"):
        packed_linear.linear_kernel()


@pytest.mark.parametrize("kernel", OURS)
def test_the_thread_count_changes_nothing(kernel):
    """Threads split the columns; each output's chain stays the same, so the bits do too."""
    torch.manual_seed(4)
    lin = PackedLinear(nn.Linear(576, 960, bias=False).bfloat16(), kernel=kernel)
    x = torch.randn(9, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, lin(x))
