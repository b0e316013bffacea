"""W8A8 int8 (`--quantization int8_per_channel`): the compiled kernel against the torch reference (the same
integers, bit for bit), both against the float product (error within what the quantization allows), rows
independent of the batch and of the thread count, the Hadamard transform, a whole model and the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import kernels
from conveyor.kernels.variants import cpu_info
from conveyor.model import w8a8
from conveyor.model.w8a8 import W8A8Linear, fwht, quantize_activations

KERNEL = w8a8.kernel_available(torch.float32)
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the W8A8 kernel needs AVX2 (or AVX-512 VNNI) and the compiled "
                                  "kernels")


def hadamard_matrix(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rows(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows of very different sizes, with a few outlier channels (what per-row scales are for)."""
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, : max(1, k // 50)] *= 20
    return x.to(dtype)


def test_fwht_is_the_hadamard_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g, dtype=torch.float64)
    want = (x.view(5, 3, 32) @ hadamard_matrix(32)).view(5, 96)
    torch.testing.assert_close(fwht(x, 32), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(fwht(fwht(x, 32), 32) / 32, x, rtol=0, atol=1e-12)  # H H = 32 I


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256, 512])
def test_the_weights_transform_is_the_stages_transform(block):
    """`fwht_weight` (two Kronecker factors, for the load) gives the stages' fp64 values exactly on bf16 weights
    (their sums are exact in fp64, in any order), hence the same int8 weights and scales."""
    g = torch.Generator().manual_seed(block)
    w = (torch.randn(300, block * 3, generator=g) * torch.rand(300, 1, generator=g)).to(torch.bfloat16)  # 2 slices
    w[0, :block] = 0
    w[1, 5] = 30.0  # an outlier the transform spreads
    assert torch.equal(w8a8.fwht_weight(w, block), fwht(w.double(), block))
    q, sw = w8a8.quantize_weight(w, block)
    q0, sw0 = w8a8.quantize_weight(fwht(w.double(), block) / block)
    assert torch.equal(q, q0) and torch.equal(sw, sw0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard", [0, 16, 64])
def test_activation_quantization_matches_the_reference(dtype, hadamard):
    """The kernel's per-row quantization is the reference's, bit for bit: zero rows, non-finite rows, K not a
    multiple of the vector width."""
    ops = kernels.load()
    g = torch.Generator().manual_seed(hadamard)
    for k in ([7, 130, 576] if not hadamard else [hadamard * 3, hadamard * 5]):
        x = rows(9, k, dtype, g)
        x[1] = 0
        x[2, k // 2] = float("nan")
        x[3, 0] = float("-inf")
        q, s = ops.w8a8_quantize(x, hadamard)
        q0, s0 = quantize_activations(x, hadamard)
        assert torch.equal(q, q0) and torch.equal(s.nan_to_num(-1.0), s0.nan_to_num(-1.0))
        assert int(q.abs().max()) <= 127 and s[2].isnan() and s[3].isnan() and not q[2].any()
        assert not q[1].any() and s[1] > 0, "a row of zeros quantizes to zeros with a finite scale"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 16, 0), (3, 70, 48, 0), (17, 576, 960, 0), (70, 1536, 576, 512),
                                   (5, 96, 32, 32), (4, 100, 32, 0), (6, 20, 16, 0)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_the_reference_exactly(dtype, shape):
    """Exact int32 sums and the same fp32 scaling: the compiled kernel and the torch reference agree bit for bit."""
    m, k, n, had = shape
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    lin = W8A8Linear(w, b, dtype, hadamard=had)
    assert lin.kernel
    x = rows(m, k, dtype, g).view(1, m, k)
    y = lin(x)
    assert y.shape == (1, m, n) and y.dtype == dtype
    assert torch.equal(y, lin.reference(x))


@needs_kernel
@pytest.mark.parametrize("k", [64, 36])
def test_the_largest_sums_are_exact(k):
    """Operands at the ends of their range, all products of one sign: where partial sums are largest (AVX2's
    vpmaddubsw sums a pair of products in int16 with saturation, at most 2 x 127 x 127 = 32,258 with the sign
    trick; a wider operand range would clip there), the kernel still gives the exact product; an odd number of
    4-k groups (K = 36) too."""
    w = torch.ones(32, k)
    w[16:] = -1.0
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    lin = W8A8Linear(w, None, torch.float32)
    assert int(lin.weight_q().abs().min()) == 127
    y = lin(x)
    assert torch.equal(y, lin.reference(x))
    # every operand is +-1: the integers are +-127 and the scales 1 / 127 (u8 activations xq + 128 would clip pairs
    # of 255 x 127 at 32,767: y would be far off)
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_the_float_product(dtype):
    """Against x @ W^T in fp64: within the bound the two roundings allow (per output, half a weight step times
    sum |x| plus half an activation step times sum |w| plus their product, in the transformed domain where
    there is one), plus the output's own rounding. Rows with outlier channels lose bits to them; the Hadamard
    transform spreads the outliers and the error drops. Kernel and reference alike."""
    g = torch.Generator().manual_seed(1)
    m, k, n = 33, 256, 80
    w, x = torch.randn(n, k, generator=g) * 0.05, rows(m, k, dtype, g)
    exact = x.double() @ w.double().t()
    errors = {}
    for had in (0, 32):
        lin = W8A8Linear(w, None, dtype, hadamard=had)
        y = lin(x).double()
        xt, wt = (fwht(x.double(), had), fwht(w.double(), had) / had) if had else (x.double(), w.double())
        sx = xt.abs().amax(1, keepdim=True) / 127
        sw = lin.sw.double()[None, :]
        bound = sw / 2 * xt.abs().sum(1, keepdim=True) + sx / 2 * wt.abs().sum(1)[None, :] + k * sx * sw / 4
        bound = bound * 1.001 + exact.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6) + 1e-6
        assert ((y - exact).abs() <= bound).all()
        errors[had] = float((y - exact).norm() / exact.norm())
        if lin.kernel:
            assert torch.equal(lin.reference(x), lin(x))
    assert errors[32] < 0.02 and errors[0] < 0.05 and errors[32] < 0.7 * errors[0], errors


@pytest.mark.skipif(not KERNEL or "amx_int8" not in cpu_info().flags,
                    reason="no AMX-INT8 on this CPU (an Intel Xeon from Sapphire Rapids on has it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_tiles_run_and_match_the_reference_exactly(dtype):
    """On a CPU with AMX-INT8 the kernel runs on tiles (tdpbusd), with the VNNI path's bits: more rows than one
    256-row chunk, an odd row group at the end, column blocks that do not fill the 4-block groups, a K of 64s
    (tiles) and one that is not (the VNNI path)."""
    assert w8a8.kernel_isa() == "amx-int8"
    g = torch.Generator().manual_seed(5)
    for m, k, n in ((300, 2048, 208), (17, 8192, 48), (1, 64, 16), (47, 1536, 80), (33, 100, 32)):
        lin = W8A8Linear(torch.randn(n, k, generator=g), None, dtype)
        x = rows(m, k, dtype, g)
        assert torch.equal(lin(x), lin.reference(x)), (m, k, n)


@needs_kernel
@pytest.mark.parametrize("had", [0, 128])
def test_rows_do_not_depend_on_the_batch_or_the_threads(had):
    """A row's bits are the same alone, in any prefix of a batch, in the full batch, and on one thread or more."""
    g = torch.Generator().manual_seed(2)
    lin = W8A8Linear(torch.randn(576, 1536, generator=g), None, torch.bfloat16, hadamard=had)
    x = rows(200, 1536, torch.bfloat16, g)  # more rows than one chunk of the kernel's work split at this K
    full = lin(x)
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(0, 200, 7)]), full[0:200:7])
    for m in (2, 5, 6, 7, 13, 64, 170):
        assert torch.equal(lin(x[:m]), full[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


def test_reference_path_without_the_kernel(monkeypatch):
    """Where no compiled kernel runs (another CPU, a width the kernel does not take), the reference runs: the
    same bits as the kernel, and its rows are batch-invariant too (integer sums are exact in any order)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    on_kernel = W8A8Linear(w, b, torch.bfloat16, hadamard=16)
    monkeypatch.setattr(w8a8, "kernel_available", lambda dtype: False)
    lin = W8A8Linear(w, b, torch.bfloat16, hadamard=16)
    assert not lin.kernel and lin.batch_invariant
    x = rows(9, 64, torch.bfloat16, g)
    full = lin(x)
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(9)]), full)
    if on_kernel.kernel:
        assert torch.equal(on_kernel(x), full)


def test_packed_weight_round_trips():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 70, generator=g)
    q, sw = w8a8.quantize_weight(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and sw.shape == (48,)
    assert ((q.float() * sw[:, None] - w).abs() <= sw[:, None] / 2 * 1.0001).all()
    packed, comp = w8a8.pack_weight(q)
    assert packed.shape == (3, 18, 16, 4)
    assert torch.equal(packed.permute(0, 2, 1, 3).reshape(48, 72)[:, :70], q)
    assert torch.equal(comp, 128 * q.int().sum(1))


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    from conveyor.config import EngineConfig
    from conveyor.model.llama import LlamaModel
    from conveyor.model.loader import load_checkpoint
    from conveyor.runner.model_runner import ModelRunner

    def build() -> LlamaModel:  # as the runner builds it, in fp32, its linears left as nn.Linear
        ckpt = load_checkpoint(str(tiny_llama))
        config = EngineConfig(model=str(tiny_llama), dtype="float32", packed_linear=False, num_kv_blocks=8)
        return ModelRunner(ckpt.config, ckpt.tensors, config).model

    return build


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits of one prompt through the torch path, on a paged cache."""
    from conveyor.model.attention import build_metadata, cache_shapes

    cfg = model.cfg
    k_shape, v_shape = cache_shapes(8, 16, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(k_shape), torch.zeros(v_shape)) for _ in range(cfg.num_layers)]
    t = len(ids)
    meta = build_metadata([t], [t], [list(range((t + 15) // 16))], 16, torch.device("cpu"), "torch")
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), caches, meta))


def test_quantized_model_close_to_float(tiny_model):
    """The whole W8A8 model (every linear and the head in int8, each with its input's Hadamard block) against
    fp32: mostly the same next token, and logits within a few percent."""
    ids = list(range(3, 60))
    want = forward_logits(tiny_model(), ids)
    model = tiny_model()
    assert w8a8.quantize_model(model, torch.float32) == 9
    assert [m.hadamard for m in model.modules() if isinstance(m, W8A8Linear)] == [64, 64, 64, 128] * 2 + [64]
    got = forward_logits(model, ids)
    # (this random model's logits are flat and its activations large; a wrong transform or scale gives an error
    # of order 1)
    agree, err = float((got.argmax(-1) == want.argmax(-1)).float().mean()), float((got - want).norm() / want.norm())
    assert agree >= 0.7 and err < 0.12, (agree, err)


def test_engine_flag_names(tiny_llama):
    """vLLM's shorthand style and SGLang's name both select W8A8; a misspelling is refused, naming the choices."""
    from conveyor.config import EngineConfig

    assert EngineConfig(model=str(tiny_llama), quantization="w8a8_int8").quantization == "int8_per_channel"
    assert EngineConfig(model=str(tiny_llama), quantization="int8_per_channel").quantization == "int8_per_channel"
    with pytest.raises(ValueError, match="quantization must be .*int8_per_channel"):
        EngineConfig(model=str(tiny_llama), quantization="w8a8")


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory):
    """head_dim 64 (SmolLM2's), so that the compiled attention and the fused decoder call run."""
    from tests.conftest import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("w8a8-head64"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1)


@needs_kernel
def test_llm_runs_w8a8_batch_invariant_and_fused(head64_llama):
    """LLM(quantization=...) serves on the W8A8 kernels in one compiled decoder call, reports batch invariance,
    and its embeddings stay close to bf16's."""
    from conveyor import LLM, SamplingParams

    llm = LLM(str(head64_llama), quantization="int8_per_channel", dtype="bfloat16", num_kv_blocks=64,
              use_tqdm_on_load=False)
    info, model = llm.engine.info, llm.engine.model
    assert info.quantized_linears == 9 and info.weight_dtype == "int8_per_channel"
    if info.attention_backend != "kernel":
        pytest.skip("the fused decoder call needs the kernel attention")
    assert info.batch_invariant
    assert model.fused_body is not None and model.fused_body[0] == "linear_w8a8"
    # (the fused call's bits against the loop's: tests/model/test_fused_body.py)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12, 12]
    bf16 = LLM(str(head64_llama), dtype="bfloat16", num_kv_blocks=64, use_tqdm_on_load=False)
    a = torch.tensor(llm.embed(["the quick brown fox"])[0].outputs.embedding)
    b = torch.tensor(bf16.embed(["the quick brown fox"])[0].outputs.embedding)
    assert F.cosine_similarity(a, b, dim=0) > 0.98
