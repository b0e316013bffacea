"""Speculative decoding (ngram prompt lookup): greedy outputs token-identical to decoding without it
under every scheduler, with chunked prefill, prefix-cache hits, preemption, stop conditions and
logprobs; sampled outputs with the same distribution (chi-square, on a 32-token model); and the
ngram proposer itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from conveyor import LLM, SamplingParams
from conveyor.engine.speculative import SpecBackoff, SpeculativeConfig, ngram_propose
from conveyor.runner import model_runner
from tests.conftest import build_tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "backoff": False}  # always speculate: the back-off is measured, not what these tests are about


def test_ngram_proposer_takes_the_longest_most_recent_match():
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_propose(toks, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert ngram_propose(np.array([4, 5, 6]), 3, 1, 3) == []
    assert ngram_propose(np.array([1, 2, 1]), 5, 1, 3) == [2, 1]  # stops at the end of the sequence
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse('{"method": "ngram", "k": 3}')
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "eagle"})


def test_backoff_prefers_guesses_only_while_rows_are_cheap():
    costs = {1: 0.010, 2: 0.0105, 4: 0.011, 8: 0.012, 16: 0.020, 32: 0.040, 64: 0.080, 128: 0.160}
    b = SpecBackoff(costs)
    for _ in range(200):
        b.observe(4, 3)  # 75% accepted
    assert b.worth_it(1, 0, 4)  # one stream: 5 rows cost about what 1 does
    assert not b.worth_it(64, 0, 256)  # compute-bound: 4x the rows for 1.75x the tokens
    for _ in range(500):
        b.observe(4, 0)  # nothing is accepted any more
    assert not b.worth_it(1, 0, 4)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (so guesses exist), with a shared 32-token head (prefix hits)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(32)]
    out = []
    for _ in range(n):
        base = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 14))]
        out.append(head + base * 3 + base[: rng.randrange(1, len(base))])
    return out


def _params(n: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kw = dict(temperature=0, max_tokens=rng.randrange(3, 60), logprobs=2 if i % 3 == 0 else None)
        if i % 4 == 1:
            kw["stop"] = ["e", "th"]
        if i % 5 == 2:
            kw["ignore_eos"] = True
        out.append(SamplingParams(**kw))
    return out


def _run(llm: LLM, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            assert [list(e) for e in x.logprobs] == [list(e) for e in y.logprobs]
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert all(abs(ex[t] - ey[t]) < 1e-4 for t in ex)


@pytest.mark.parametrize("scheduler", ["static", "dynamic", "continuous", "iteration"])
def test_greedy_outputs_are_identical_with_and_without_speculation(tiny_llama, scheduler):
    """Chunked prefill (a 48-token budget), prefix hits (a shared head, the batch run twice), stop
    strings, EOS, max_tokens and logprobs, under each batching strategy."""
    kw = dict(dtype="float32", num_kv_blocks=200, max_model_len=256, scheduler=scheduler, batch_size=5,
              max_num_batched_tokens=48)
    plain, spec = LLM(str(tiny_llama), **kw), LLM(str(tiny_llama), speculative_config=SPEC, **kw)
    vocab = plain.engine.model_config.vocab_size
    prompts, params = _prompts(vocab, 12, seed=1), _params(12, seed=2)
    want = _run(plain, prompts, params)
    for _ in range(2):  # the second pass starts from cached prefixes
        _same(_run(spec, prompts, params), want)
    st = spec.engine.spec_stats
    assert st.num_draft_tokens > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert spec.engine.kv.prefix_hits > 0
    assert spec.engine.kv.pool.num_used == 0  # no block left behind by rolled-back guesses


def test_greedy_outputs_survive_preemption(tiny_llama):
    roomy = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=200, max_model_len=200)
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=14, max_model_len=200, speculative_config=SPEC)
    vocab = roomy.engine.model_config.vocab_size
    prompts = _prompts(vocab, 6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)] * 6
    _same(_run(tight, prompts, params), _run(roomy, prompts, params))
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.spec_stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """32 tokens, attention switched off (o_proj = 0) and a sharpened LM head: a bigram model, whose
    next token depends on the current one only. Guesses taken from its own earlier output are then
    tokens it favours, so at temperature 1 they are accepted often (about 30%) and rejected often."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_llama(tmp_path_factory.mktemp("vocab32"), seed=3, vocab_size=32)
    f = path / "model.safetensors"
    t = load_file(str(f))
    for k in t:
        if k.endswith("o_proj.weight"):
            t[k].zero_()
    t["lm_head.weight"] *= 2.0
    save_file(t, str(f), metadata={"format": "pt"})
    return path


def _samples(llm: LLM, n: int, seed0: int) -> np.ndarray:
    # the model's own greedy continuation as the prompt: guesses come from what it did before
    start = [{"prompt_token_ids": list(range(3, 32))}]
    greedy = llm.generate(start, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    prompt = list(range(3, 32)) + greedy[0].outputs[0].token_ids
    llm.engine.spec_stats.__init__()
    params = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=4, ignore_eos=True) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outs])


def _p_values(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Chi-square test of homogeneity per output position (positions 1..3 are verified guesses)."""
    out = []
    for pos in range(1, a.shape[1]):
        table = np.array([np.bincount(a[:, pos], minlength=32), np.bincount(b[:, pos], minlength=32)])
        table = table[:, table.sum(axis=0) >= 10]  # drop tokens too rare to count
        out.append(chi2_contingency(table).pvalue)
    return out


def test_sampled_outputs_keep_their_distribution(small_vocab, monkeypatch):
    n = 3000
    kw = dict(dtype="float32", num_kv_blocks=1200, max_model_len=96, max_num_seqs=256)
    plain = _samples(LLM(str(small_vocab), **kw), n, 10_000)  # other seeds per arm: independent samples
    spec_llm = LLM(str(small_vocab), speculative_config=SPEC, **kw)
    spec = _samples(spec_llm, n, 20_000)
    st = spec_llm.engine.spec_stats
    assert st.num_draft_tokens > n and 0.1 < st.acceptance_rate < 0.9, st  # both paths taken, often
    print("p-values, plain vs speculative:", _p_values(plain, spec), st)
    assert min(_p_values(plain, spec)) > 1e-3, _p_values(plain, spec)

    # the test can fail: a verifier that keeps every guess changes the distribution, and is caught
    real_verify = model_runner.verify

    def keep_all(rows, items):
        res = real_verify(rows, items)
        for i, it in enumerate([it for it in items if it.samples]):
            if it.num_draft:
                res.token_ids[i] = list(it.request.spec_token_ids[:it.num_draft]) + [res.token_ids[i][-1]]
                res.logprobs[i] = [None] * len(res.token_ids[i])
                res.sampled_logprobs[i] = [None] * len(res.token_ids[i])
        return res

    broken_llm = LLM(str(small_vocab), speculative_config=SPEC, **kw)
    monkeypatch.setattr(model_runner, "verify", keep_all)
    broken = _samples(broken_llm, n, 30_000)
    print("p-values, plain vs keep-every-guess:", _p_values(plain, broken))
    assert min(_p_values(plain, broken)) < 1e-6


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """The tiny model with noise added to every weight: a draft that is right only sometimes."""
    import torch
    from safetensors.torch import load_file, save_file

    path = build_tiny_llama(tmp_path_factory.mktemp("draft-model"))  # seed 0: the same weights as tiny_llama
    f = path / "model.safetensors"
    g = torch.Generator().manual_seed(1)
    t = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) for k, v in load_file(str(f)).items()}
    save_file(t, str(f), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("scheduler", ["continuous", "iteration"])
def test_draft_model_guesses_keep_greedy_outputs(tiny_llama, other_tiny, scheduler):
    kw = dict(dtype="float32", num_kv_blocks=200, max_model_len=256, scheduler=scheduler, max_num_batched_tokens=48)
    plain = LLM(str(tiny_llama), **kw)
    vocab = plain.engine.model_config.vocab_size
    prompts, params = _prompts(vocab, 10, seed=3), _params(10, seed=4)
    want = _run(plain, prompts, params)
    for draft, accept_all, layers in ((str(tiny_llama), True, None), (str(other_tiny), False, None),
                                      (str(tiny_llama), False, 1)):  # the last: layer skip, its first layer
        spec = LLM(str(tiny_llama), speculative_config={"model": draft, "num_speculative_tokens": 3,
                                                         "num_layers": layers, "backoff": False}, **kw)
        assert spec.engine.spec.method == "draft"
        for _ in range(2):
            _same(_run(spec, prompts, params), want)
        st = spec.engine.spec_stats
        assert st.num_draft_tokens > 0
        if accept_all:  # the target as its own draft: every guess is what greedy decoding does next (the
            # count stops where a sequence did: guesses after its stop string or EOS are not output)
            assert st.num_accepted_tokens >= 0.95 * st.num_draft_tokens
        else:
            assert st.num_accepted_tokens < st.num_draft_tokens
        spec.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(spec.engine.draft.tables) == 0  # finished sequences' draft blocks were returned
        assert spec.engine.draft.pool.num_used == 0


def test_draft_model_sampling_keeps_its_distribution(small_vocab):
    n = 3000
    kw = dict(dtype="float32", num_kv_blocks=1200, max_model_len=96, max_num_seqs=256)
    plain = _samples(LLM(str(small_vocab), **kw), n, 40_000)
    spec_llm = LLM(str(small_vocab), speculative_config={"model": str(small_vocab), "num_speculative_tokens": 3,
                                                         "backoff": False}, **kw)
    spec = _samples(spec_llm, n, 50_000)
    st = spec_llm.engine.spec_stats
    assert st.num_draft_tokens > n and 0.1 < st.acceptance_rate < 0.95, st
    assert min(_p_values(plain, spec)) > 1e-3, _p_values(plain, spec)


def test_seeded_sampling_is_reproducible_with_speculation(small_vocab):
    """A seeded request's noise is keyed by (seed, position), so its output depends neither on its batch
    nor on speculation: the same tokens with and without guesses."""
    kw = dict(dtype="float32", num_kv_blocks=200, max_model_len=256)
    llm = LLM(str(small_vocab), speculative_config=SPEC, **kw)
    prompts = [list(range(3, 32)) + [5 + i, 6, 7] for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True) for s in range(4)]
    first = _run(llm, prompts, params)
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]  # other batches, same seeds
    plain = _run(LLM(str(small_vocab), **kw), prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in alone] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
