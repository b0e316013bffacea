"""The suite's kernel tests pass under every installed kernel variant this CPU can run.

The default variant (the most capable) runs them in this process with the rest of the suite; each other
one runs them in a subprocess with CONVEYOR_CPU_VARIANT set, which also checks that the variable is obeyed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor import kernels

KERNEL_TESTS = ["tests/kernels/test_fused_ops.py", "tests/model/test_attention_kernel.py",
                "tests/model/test_linear_bf16.py", "tests/model/test_kv_int8.py",
                "tests/runner/test_sampler_kernel.py",  # the sampler's scalar path runs under avx2 and generic
                "tests/model/test_gguf_weights.py",  # AVX2's maddubs path (avx2, avx512), none in generic
                # the LoRA kernel's portable shrink and expand (no AVX512-BF16 / no AVX-512)
                "tests/lora/test_lora_parity.py::test_kernel_and_torch_paths_match_rowwise_reference",
                # W8A8: VNNI (avx512bf16), vpmaddubsw (avx512, avx2), the torch reference (generic)
                *(f"tests/model/test_w8a8.py::{t}" for t in (
                    "test_activation_quantization_matches_the_reference", "test_kernel_matches_the_reference_exactly",
                    "test_rows_do_not_depend_on_the_batch_or_the_threads", "test_close_to_the_float_product",
                    "test_reference_path_without_the_kernel"))]
ROOT = Path(__file__).resolve().parents[2]

kernels.load()
OTHERS = kernels.installed_variants()[1:]

RUN = """
import os, sys
import pytest
from conveyor import kernels
kernels.load()
assert kernels.variant() == os.environ["CONVEYOR_CPU_VARIANT"], (kernels.variant(), os.environ["CONVEYOR_CPU_VARIANT"])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.skipif(not OTHERS, reason="no installed kernel build with more than one variant this CPU runs")
@pytest.mark.parametrize("variant", OTHERS)
def test_kernel_tests_pass_under(variant):
    env = dict(os.environ, CONVEYOR_CPU_VARIANT=variant)
    proc = subprocess.run([sys.executable, "-c", RUN, *KERNEL_TESTS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def test_variants_agree_with_each_other_on_the_fused_ops():
    """In one process, switching variants (kernels.use_variant): each one's RMSNorm and SiLU*up match the
    most capable one's to fp32 rounding (the vectorised exp differs only in its last bits)."""
    import torch

    variants = kernels.installed_variants()
    if len(variants) < 2:
        pytest.skip("fewer than two installed variants this CPU runs")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    gu = torch.randn(37, 2 * 1536, generator=gen)
    ops = kernels.load()
    outs = {}
    try:
        for v in variants:
            kernels.use_variant(v)
            assert kernels.variant() == v
            outs[v] = (ops.rms_norm(x, None, w, 1e-5), ops.silu_and_mul(gu))
    finally:
        kernels.use_variant(variants[0])
    for v in variants[1:]:
        torch.testing.assert_close(outs[v][0], outs[variants[0]][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(outs[v][1], outs[variants[0]][1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not installed"):
        kernels.use_variant("z80")


def test_variants_agree_bit_for_bit_on_w8a8():
    """W8A8 sums integers exactly and scales them the same way everywhere: VNNI's vpdpbusd and AVX2's
    vpmaddubsw give the same bits, with and without the Hadamard transform."""
    import torch

    from conveyor.model import w8a8

    variants = [v for v in kernels.installed_variants() if v != "generic"]
    if len(variants) < 2:
        pytest.skip("fewer than two installed variants with the W8A8 kernel this CPU runs")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1536, generator=gen).bfloat16()
    q, sw = w8a8.quantize_weight(torch.randn(96, 1536, generator=gen))
    packed, comp = w8a8.pack_weight(q)
    ops = kernels.load()
    outs = {}
    try:
        for v in variants:
            kernels.use_variant(v)
            outs[v] = [ops.linear_w8a8(x, packed, comp, sw, had) for had in (0, 512)]
    finally:
        kernels.use_variant(kernels.installed_variants()[0])
    for v in variants[1:]:
        for a, b in zip(outs[v], outs[variants[0]]):
            assert torch.equal(a, b), v
