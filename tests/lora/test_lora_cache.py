"""The prefix cache knows the adapter: a prefix computed under one adapter never serves another (its
K/V differ), and under the same adapter it is reused as any prefix is."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from conveyor.kv_cache import KVCacheManager
from conveyor.lora import LoRARequest
from conveyor.request import Request
from tests.lora.peft_adapters import make_adapter


def _req(rid: str, tokens: list[int], lora_key: str | None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), lora_key=lora_key)


def test_block_hashes_differ_by_adapter():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    a1, a2, b, base = (kv.prefix_block_hashes(_req(r, tokens, k)) for r, k in
                       (("a1", "adapter-a"), ("a2", "adapter-a"), ("b", "adapter-b"), ("base", None)))
    assert len(a1) == 3
    assert a1 == a2
    assert not set(a1) & set(b) and not set(a1) & set(base) and not set(b) & set(base)


@pytest.fixture(scope="module")
def two_adapters(tiny_llama, tmp_path_factory) -> tuple[LoRARequest, LoRARequest]:
    root = tmp_path_factory.mktemp("cache-adapters")
    a = make_adapter(tiny_llama, root / "a", 4, ["k_proj", "v_proj"], seed=1)
    b = make_adapter(tiny_llama, root / "b", 4, ["k_proj", "v_proj"], seed=2)
    return LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))


def test_same_prompt_shares_blocks_only_under_the_same_adapter(tiny_llama, two_adapters):
    a, b = two_adapters
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True,
              max_loras=2)
    prompt = [random.Random(0).randrange(300) for _ in range(50)]  # three full blocks of 16 to reuse
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def cached(lora) -> int:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
        return out.metrics.num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # a's blocks hold a's K/V: never b's
    assert cached(None) == 0  # nor the base model's
    assert cached(a) == 48 and cached(b) == 48 and cached(None) == 48  # each reuses its own
    # the same adapter under another name and id (same files) is the same weights: it may share
    assert cached(LoRARequest("a-again", 7, a.lora_path)) == 48
