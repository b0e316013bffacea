"""The decoder layers in one compiled call (`LlamaModel.fuse_body`, `decoder_layers` in bindings.cpp) give the
same bits as the Python loop over the same kernels: every logit of every step, prefill chunks, decodes and a
preempted request's recompute alike. And where any op of the layers lacks its compiled kernel, the loop runs."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model import packed_linear
from conveyor.model.quantization import int4_kernel_fits, quantize_int4
from conveyor.request import make_request
from conveyor.runner import model_runner
from conveyor.sampling_params import SamplingParams
from tests.conftest import build_tiny_llama
from tests.engine.test_hf_parity import build_variant

pytestmark = pytest.mark.skipif(not packed_linear.available_kernels(),
                                reason="none of our bf16 linear kernels runs on this CPU or build")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64 and GQA 3 (SmolLM2's head shape): every linear fits our packed layout
    return build_tiny_llama(tmp_path_factory.mktemp("fused-body"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1)


def generate(model_dir, monkeypatch, fused: bool, **config) -> tuple[dict, dict, LLMEngine]:
    monkeypatch.setenv("CONVEYOR_FUSED_BODY", "1" if fused else "0")
    logits_seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    real = model_runner.sample

    def recording(logits: torch.Tensor, reqs, grammar=None, positions=None):
        for r, row in zip(reqs, logits):
            logits_seen[r.request_id].append(row.clone())
        return real(logits, reqs, grammar, positions)

    monkeypatch.setattr(model_runner, "sample", recording)
    cfg = dict(model=str(model_dir), device="cpu", dtype="bfloat16", max_model_len=512, block_size=16,
               max_num_batched_tokens=64, enable_prefix_caching=False)
    cfg.update(config)
    eng = LLMEngine(EngineConfig(**cfg))
    rng = random.Random(7)
    tokens: dict[str, list[int]] = defaultdict(list)
    for i in range(12):
        prompt = [rng.randrange(10, 300) for _ in range(rng.randrange(3, 150))]
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        eng.add_request(make_request(prompt, params, request_id=f"r{i}"))
    while eng.has_unfinished_requests():
        for d in eng.step().deltas:
            tokens[d.group_id].extend(d.new_token_ids)
    monkeypatch.setattr(model_runner, "sample", real)
    return tokens, logits_seen, eng


@pytest.mark.parametrize("config", [{}, {"num_kv_blocks": 24, "max_num_seqs": 8, "max_model_len": 256},
                                    {"quantization": "int4"}, {"quantization": "int8"},
                                    {"quantization": "int8_per_channel"}],
                         ids=["plain", "preempting", "int4", "int8", "w8a8"])
def test_one_call_gives_the_loops_bits(model_dir, monkeypatch, config):
    if config.get("quantization"):
        if not int4_kernel_fits(quantize_int4(torch.randn(16, 32), 32), torch.bfloat16):
            pytest.skip("our int kernels need AVX2 + FMA and the compiled kernels")
        monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "none")  # every step on the int4 kernel, in both runs
    fused_tokens, fused_logits, eng = generate(model_dir, monkeypatch, True, **config)
    assert eng.model.fused_body is not None, "the fused body should run here"
    if "num_kv_blocks" in config:
        assert eng.snapshot().preemptions > 0, "the small pool was meant to force recomputes"
    loop_tokens, loop_logits, eng = generate(model_dir, monkeypatch, False, **config)
    assert eng.model.fused_body is None
    assert fused_tokens == loop_tokens
    assert fused_logits.keys() == loop_logits.keys()
    for rid in loop_logits:
        assert len(fused_logits[rid]) == len(loop_logits[rid])
        for a, b in zip(fused_logits[rid], loop_logits[rid]):
            assert torch.equal(a, b), rid


def test_qwen2_qkv_biases_run_in_the_one_call(model_dir, tmp_path, monkeypatch):
    """Qwen2's q/k/v biases (random here: HF initialises them to 0) ride in the one call, added by the op the
    loop adds them with: the same bits. Without them the larger benchmark shape ran op by op."""
    qwen = build_variant(tmp_path / "qwen2", model_dir, "Qwen2ForCausalLM", hidden_size=192, intermediate_size=384,
                         num_attention_heads=3, num_key_value_heads=1, use_sliding_window=False)
    fused_tokens, fused_logits, eng = generate(qwen, monkeypatch, True)
    assert eng.model.fused_body is not None and len(eng.model.fused_body[2]) == eng.model_config.num_layers
    assert eng.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    loop_tokens, loop_logits, eng = generate(qwen, monkeypatch, False)
    assert eng.model.fused_body is None
    assert fused_tokens == loop_tokens
    for rid in loop_logits:
        assert all(torch.equal(a, b) for a, b in zip(fused_logits[rid], loop_logits[rid], strict=True)), rid


def test_the_loop_runs_where_an_op_is_not_compiled(model_dir, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FUSED_BODY", "1")
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", attention_backend="torch"))
    assert eng.model.fused_body is None  # the torch reference attention: op by op
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    assert eng.model.fused_body is None  # fp32 weights run oneDNN's linears
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", enable_lora=True))
    assert eng.model.fused_body is None  # LoRA wraps every linear
