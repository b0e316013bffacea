"""Batch invariance under LoRA: a request under an adapter gets the same bits alone and in a crowd.

An adapter's rows form one segment per step, as short as one decode row or as long as a prompt chunk
of many requests; the compiled kernel computes each row alone whatever the segment, so the probe's
tokens and per-step logprobs must equal its solo run bit for bit, in a crowd of 60 requests under the
same adapter (prefill segments of hundreds of rows, decode segments of dozens), another adapter and the
base model. Before the kernel took long segments they went to torch's matmuls, and this failed.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from conveyor.lora import LoRARequest
from tests.conftest import build_tiny_llama
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-invariance")
    # SmolLM2's head shape and dimensions the packed bf16 linears take (multiples of 32)
    model = build_tiny_llama(root / "model", hidden_size=192, intermediate_size=384, num_attention_heads=3,
                             num_key_value_heads=1, max_position_embeddings=1024)
    a = make_adapter(model, root / "a", 8, ALL_PROJECTIONS, seed=1)
    b = make_adapter(model, root / "b", 4, ["q_proj", "v_proj"], seed=2)
    return model, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))


def test_adapter_rows_are_batch_invariant(setup):
    model, a, b = setup
    llm = LLM(str(model), num_kv_blocks=2048, max_model_len=512, enable_lora=True, max_loras=2,
              max_num_seqs=80, enable_prefix_caching=False)
    assert llm.engine.info.lora_kernel and llm.engine.info.batch_invariant
    rng = random.Random(0)
    probe = [rng.randrange(10, 300) for _ in range(37)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(prompts, loras):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]

    alone = run([probe], [a])[0]
    crowd = [[rng.randrange(10, 300) for _ in range(rng.randrange(20, 120))] for _ in range(60)]
    loras = [a if i % 4 else (b if i % 8 else None) for i in range(60)]
    got = run(crowd[:17] + [probe] + crowd[17:], loras[:17] + [a] + loras[17:])[17]
    assert got[0] == alone[0]
    assert repr(got[1]) == repr(alone[1])  # the logprobs, bit for bit
    assert llm.engine.snapshot().kv_blocks_used == 0
