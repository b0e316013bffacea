"""Prefix caching and parallel-sampling sharing must never change a request's tokens."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.request import make_request

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    mk = lambda caching, blocks=128: LLM(str(tiny_llama), dtype="float32", block_size=BS, num_kv_blocks=blocks,
                                         max_model_len=BS * blocks, enable_prefix_caching=caching)
    return mk(True), mk(False)


def run(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


BASE = [11 + (i * 7) % 300 for i in range(23)]


@pytest.mark.parametrize("shared", [3, 4, 5, 8, 23], ids=lambda n: f"shared{n}")
def test_shared_prefixes_of_every_length_give_identical_tokens(engines, shared):
    cached, plain = engines
    prompts = [BASE[:shared] + [300 + i] * (i + 1) for i in range(4)]
    if shared == len(BASE):
        prompts = [BASE] * 3  # the whole prompt is cached after the first
    # sequential: the later prompts find the earlier ones' blocks in the cache
    hits_before = cached.engine.kv.prefix_hits
    seq = [run(cached, [p])[0] for p in prompts]
    assert seq == run(plain, prompts)
    assert run(cached, prompts) == seq  # and batched together
    full_blocks_shared = min(shared, len(prompts[0]) - 1) // BS
    if full_blocks_shared:
        assert cached.engine.kv.prefix_hits > hits_before
    assert cached.engine.kv.pool.num_used == 0


def test_whole_prompt_cached_recomputes_only_the_last_token(engines):
    cached, _ = engines
    prompt = BASE[:16]  # exactly four full blocks
    run(cached, [prompt])
    out = cached.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 12  # three blocks; the last block holds the token to recompute


def test_eviction_mid_run_keeps_outputs_identical(tiny_llama):
    # a pool of 24 blocks: cached prefixes must be evicted to make room while requests run
    small = LLM(str(tiny_llama), dtype="float32", block_size=BS, num_kv_blocks=24, max_model_len=BS * 24)
    plain = LLM(str(tiny_llama), dtype="float32", block_size=BS, num_kv_blocks=24, max_model_len=BS * 24,
                enable_prefix_caching=False)
    families = [[50 + f] * 9 for f in range(5)]
    prompts = [families[i % 5] + [200 + i, 201 + i] for i in range(15)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = []
    for i in range(0, 15, 3):
        got += run(small, prompts[i:i + 3], params)
    assert small.engine.kv.pool.num_evictions > 0
    assert got == run(plain, prompts, params)
    assert small.engine.kv.pool.num_used == 0


def test_cache_salt_isolates_tenants(engines):
    cached, _ = engines
    eng = cached.engine
    eng.kv.pool.reset_cache()
    prompt = BASE[:13]
    for salt, expect_hit in ((None, False), (None, True), ("tenant-b", False)):
        before = eng.kv.prefix_hits
        eng.add_request(make_request(prompt, GREEDY, cache_salt=salt))
        while eng.has_unfinished_requests():
            eng.step()
        assert (eng.kv.prefix_hits > before) == expect_hit, salt


def test_parallel_samples_share_prompt_blocks(engines):
    cached, _ = engines
    eng = cached.engine
    eng.kv.pool.reset_cache()
    prompt = [9 + i % 50 for i in range(41)]  # 10 full blocks + 1 token
    reqs = eng.add_request(make_request(prompt, SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=3,
                                                                ignore_eos=True)))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.kv.pool.num_used)
    # separately they would need 4 x 11+ blocks; shared: 10 prompt blocks + a private tail each (+1 transient)
    assert peak <= 11 + 4 + 1, peak
    seeded = [SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i, ignore_eos=True) for i in range(4)]
    alone = [run(cached, [prompt], sp)[0] for sp in seeded]
    assert [r.output_token_ids for r in sorted(reqs, key=lambda r: r.index)] == alone
