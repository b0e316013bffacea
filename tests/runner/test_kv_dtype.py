"""The int8 KV cache in the engine: capacity for the same memory, and the paths that copy or share
blocks (prefix caching, parallel sampling, preemption) working on its scales as on its values."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from tests.conftest import build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # head_dim 64 with GQA 3, as SmolLM2
    return build_tiny_llama(tmp_path_factory.mktemp("kv-int8"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024)


def test_int8_pool_holds_1_9x_the_blocks(model_dir):
    kw = dict(dtype="bfloat16", kv_cache_memory=0.01, max_model_len=256)
    bf16 = LLM(str(model_dir), **kw).engine.info
    int8 = LLM(str(model_dir), kv_cache_dtype="int8", **kw).engine.info
    assert int8.kv_cache_dtype == "int8" and bf16.kv_cache_dtype == "bfloat16"
    assert int8.num_kv_blocks >= 1.9 * bf16.num_kv_blocks, (int8.num_kv_blocks, bf16.num_kv_blocks)
    # bytes_per_block counts the fp16 scales beside the int8 K/V: they are inside the budget
    assert int8.bytes_per_block > 2 * 2 * 64 * 16  # more than bare int8 K and V of one layer's block
    assert int8.num_kv_blocks * int8.bytes_per_block <= 0.01 * 2**30


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_int8_cache_sharing_and_preemption_change_nothing(model_dir, backend):
    """Greedy siblings (n=3) share the prompt's blocks and copy the partly filled last one; prefix
    hits reuse cached blocks; a tiny pool preempts. All must give what one request alone gives."""
    prompt = list(range(20, 20 + 37))  # 2 full blocks + a partial one
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = LLM(str(model_dir), kv_cache_dtype="int8", attention_backend=backend, num_kv_blocks=64,
                enable_prefix_caching=False, max_model_len=256)
    want = alone.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(model_dir), kv_cache_dtype="int8", attention_backend=backend, num_kv_blocks=64, max_model_len=256)
    llm.generate([prompt], sp, use_tqdm=False)  # fills the prefix cache
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert llm.engine.snapshot().prefix_hits > 0
    assert [c.token_ids for c in out.outputs] == [want] * 3
    small = LLM(str(model_dir), kv_cache_dtype="int8", attention_backend=backend, num_kv_blocks=12,
                max_model_len=128, enable_prefix_caching=False)
    outs = small.generate([prompt] * 4, sp, use_tqdm=False)
    assert small.engine.snapshot().preemptions > 0
    assert all(o.outputs[0].token_ids == want for o in outs)
