"""Embedding requests in the engine: prefill-only requests sharing the scheduler with generations.

Checked against HF transformers' last hidden state (after the final norm) on the same weights: last-token
and mean pooling, chunked prompts, a mean-pooled prompt preempted half-way (its sum starts over), and
embeddings arriving among 32 streaming generations, none of which misses a step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor import LLM
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.pooling import PoolingParams
from conveyor.request import make_request
from conveyor.sampling_params import SamplingParams


def hf_embed(hf, ids: list[int], method: str) -> np.ndarray:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if method == "last" else h.mean(0)
    return (v / v.norm()).numpy()


def _engine(model, **kw) -> LLMEngine:
    cfg = dict(model=str(model), dtype="float32", device="cpu", num_kv_blocks=128, block_size=16, max_model_len=512,
               max_num_seqs=64, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.mark.parametrize("method", ["last", "mean"])
def test_llm_embed_equals_hf(tiny_llama, hf_tiny, method):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=512,
              max_num_batched_tokens=40)
    prompts = ["The quick brown fox.", list(range(3, 140)), {"prompt_token_ids": [7, 8, 9]}]
    outs = llm.embed(prompts, PoolingParams(method))
    ids = [llm.tokenizer.encode("The quick brown fox."), list(range(3, 140)), [7, 8, 9]]
    for o, x in zip(outs, ids):
        assert o.prompt_token_ids == x
        np.testing.assert_allclose(o.outputs.embedding, hf_embed(hf_tiny, x, method), atol=1e-3)
    assert llm.engine.kv.pool.num_used == 0  # every block went back


def test_mean_pooled_prompt_preempted_half_way_starts_its_sum_over(tiny_llama, hf_tiny):
    """A 20-block pool: a growing generation pushes out the (newer) embedding request mid-prompt; it is
    recomputed later and its mean is still HF's."""
    e = _engine(tiny_llama, num_kv_blocks=20, max_model_len=320, max_num_batched_tokens=32)
    e.add_request(make_request(list(range(10, 260)), SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)))
    while not any(d.new_token_ids for d in e.step().deltas):  # its 250-token prompt: 16 of the 20 blocks
        pass
    emb_ids = list(range(50, 200))
    e.add_request(make_request(emb_ids, SamplingParams(max_tokens=1), request_id="emb", pooling=PoolingParams("mean")))
    got = None
    while e.has_unfinished_requests():
        for d in e.step().deltas:
            if d.request_id == "emb" and d.finished:
                got = d.embedding
    assert e.snapshot().preemptions > 0
    np.testing.assert_allclose(got, hf_embed(hf_tiny, emb_ids, "mean"), atol=1e-3)


def test_embeddings_among_32_streams_never_stall_one(tiny_llama, hf_tiny):
    """32 generations decode while 24 embedding requests (some longer than the 64-token budget, so chunked)
    arrive over several steps: every stream that is decoding gets a token in every step, each embedding
    equals HF's, and the embeddings' blocks are freed the step they finish."""
    e = _engine(tiny_llama)
    gens = {f"g{i}": list(range(5 + i, 25 + i)) for i in range(32)}
    for rid, ids in gens.items():
        e.add_request(make_request(ids, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=1),
                                   request_id=rid))
    rng = np.random.default_rng(0)
    pending = [(f"e{i}", rng.integers(3, 390, size=int(rng.integers(5, 200))).tolist(), "last" if i % 2 else "mean")
               for i in range(24)]
    requests = list(pending)
    started: set[str] = set()
    finished: set[str] = set()
    embeddings: dict[str, list[float]] = {}
    steps_with_embeddings = 0
    while e.has_unfinished_requests():
        if started and pending:  # three new embedding requests per step once the streams run
            for rid, ids, method in pending[:3]:
                e.add_request(make_request(ids, SamplingParams(max_tokens=1), request_id=rid,
                                           pooling=PoolingParams(method)))
            del pending[:3]
        decoding = started - finished
        out = e.step()
        got = {d.request_id for d in out.deltas if d.new_token_ids}
        assert decoding <= got, f"streams {sorted(decoding - got)} got no token in a step"
        if out.stats is not None and any(r.startswith("e") for r in out.stats.request_ids):
            steps_with_embeddings += 1
        for d in out.deltas:
            if d.request_id.startswith("g") and d.new_token_ids:
                started.add(d.request_id)
            if d.finished:
                finished.add(d.request_id)
                if d.embedding is not None:
                    embeddings[d.request_id] = d.embedding
    assert steps_with_embeddings >= 5 and len(embeddings) == 24
    for rid, ids, method in requests:
        np.testing.assert_allclose(embeddings[rid], hf_embed(hf_tiny, ids, method), atol=1e-3)
    assert e.kv.pool.num_used == 0


def test_embedding_requests_take_no_grammar_and_no_n(tiny_llama):
    from conveyor.sampling_params import StructuredOutputsParams

    e = _engine(tiny_llama)
    with pytest.raises(ValueError, match="samples nothing"):
        e.add_request(make_request([1, 2, 3], SamplingParams(n=2), pooling=PoolingParams()))
    with pytest.raises(ValueError, match="samples nothing"):
        e.add_request(make_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")),
                                   pooling=PoolingParams()))
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("max")
