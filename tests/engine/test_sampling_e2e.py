"""Sampling parameters through the whole engine (tiny random Llama, float32).

Stop conditions are checked against the engine's own unconstrained greedy run of the same prompt,
so each test knows exactly where the sequence must end and what text must come back.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_logits

MAX_LEN = 256


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=160, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def vocab(llm) -> int:
    return llm.engine.model_config.vocab_size


def rand_prompts(vocab: int, n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def gen(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def eos_case(llm, vocab):
    """A prompt whose greedy continuation emits EOS at index j (> 2) within 32 tokens."""
    eos = next(iter(llm.engine.eos_token_ids))
    prompts = rand_prompts(vocab, 96, seed=11)
    outs = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        if eos in toks and 2 < toks.index(eos) < 24:
            return p, toks, toks.index(eos), eos
    pytest.fail("no prompt among 96 reaches EOS greedily; the tiny model changed?")


def test_temperature_zero_is_repeatable_and_temperature_one_varies(llm, vocab):
    p = rand_prompts(vocab, 1, seed=1)[0]
    greedy = gen(llm, [p] * 4, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in greedy}) == 1
    hot = gen(llm, [p] * 8, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in hot}) >= 4


def test_seeded_request_is_independent_of_the_batch(llm, vocab):
    p = rand_prompts(vocab, 1, seed=2)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = gen(llm, [p], sp)[0].outputs[0].token_ids
    others = rand_prompts(vocab, 10, seed=3, hi=120)
    mixed_params = [SamplingParams(temperature=random.Random(i).choice([0.0, 0.7, 1.3]), max_tokens=4 + i,
                                   ignore_eos=True) for i in range(10)]
    batch = others[:4] + [p] + others[4:]
    params = mixed_params[:4] + [sp] + mixed_params[4:]
    outs = gen(llm, batch, params)
    assert outs[4].outputs[0].token_ids == alone
    other_seed = gen(llm, [p], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16,
                                              ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_returns_n_distinct_samples(llm, vocab):
    p = rand_prompts(vocab, 1, seed=4)[0]
    out = gen(llm, [p], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True))
    assert len(out) == 1
    o = out[0]
    assert [c.index for c in o.outputs] == [0, 1]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in o.outputs)
    assert o.outputs[0].token_ids != o.outputs[1].token_ids
    # sample i uses seed + i: each sample equals the single request with that seed
    for i in (0, 1):
        single = gen(llm, [p], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=10, ignore_eos=True))
        assert single[0].outputs[0].token_ids == o.outputs[i].token_ids


def test_n_greedy_samples_share_the_prompt_and_match_hf(llm, hf_tiny, vocab):
    """Siblings fork sample 0's prompt blocks; their KV must be exactly what a recompute would give."""
    prompts = rand_prompts(vocab, 3, seed=6, lo=17, hi=70)
    outs = gen(llm, prompts, SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        want = hf_greedy(hf_tiny, p, 10)
        assert [c.token_ids for c in o.outputs] == [want] * 3


def test_stop_string_truncates_text(llm, tiny_llama):
    prompts = [{"prompt": t} for t in ("The quick brown fox", "Paris is the capital", "Hello world! How")]
    base = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    checked = 0
    for prompt, full in zip(prompts, base):
        text = full.outputs[0].text
        # a stop string from the middle of the text, made of plain characters
        cands = [text[i:i + 3] for i in range(4, len(text) - 6) if text[i:i + 3].isascii()
                 and text[i:i + 3].strip() == text[i:i + 3] and "\ufffd" not in text[i:i + 3]]
        if not cands:
            continue
        stop = cands[0]
        cut = text.index(stop)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:cut]
        assert stop not in out.text
        assert out.token_ids == full.outputs[0].token_ids[:len(out.token_ids)]
        assert len(out.token_ids) < len(full.outputs[0].token_ids)
        keep = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
        assert keep.outputs[0].text == text[:cut + len(stop)]
        # before min_tokens, no stop condition applies, stop strings included (vLLM's rule)
        late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                     min_tokens=40), use_tqdm=False)[0].outputs[0]
        assert late.finish_reason == "length" and late.text == text
        checked += 1
    assert checked >= 2


def test_stop_token_ids(llm, vocab):
    p = rand_prompts(vocab, 1, seed=8)[0]
    full = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    stop_tok = full[5]
    j = full.index(stop_tok)
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                       stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == full[:j + 1]


def test_eos_stops_unless_ignored(llm, eos_case):
    p, toks, j, eos = eos_case
    stopped = gen(llm, [p], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == toks[:j + 1]
    ignored = gen(llm, [p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 32
    assert ignored.token_ids[j] == eos and ignored.token_ids == toks


def test_min_tokens_blocks_early_eos(llm, eos_case):
    p, toks, j, eos = eos_case
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=32, min_tokens=j + 3))[0].outputs[0]
    assert out.token_ids[:j] == toks[:j]
    assert out.token_ids[j] != eos  # EOS was the argmax here, but was not allowed yet
    assert eos not in out.token_ids[:j + 3]
    assert len(out.token_ids) >= j + 3


def test_logprobs_are_log_probabilities(llm, hf_tiny, vocab):
    p = rand_prompts(vocab, 1, seed=9)[0]
    for k in (0, 3, 20):
        out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=k))[0].outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == 6
        for tok, entry in zip(out.token_ids, out.logprobs):
            assert tok in entry
            assert len(entry) in (max(k, 1), k + 1)
            assert all(v <= 0 for v in entry.values())
            assert entry[tok] == max(entry.values())  # greedy: the sampled token is the most likely
        assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))
    # the first token's top-20 equal HF's log-softmax at the last prompt position
    ref = torch.log_softmax(hf_logits(hf_tiny, p)[-1], -1)
    top = ref.topk(20)
    first = out.logprobs[0]
    assert set(first) == set(top.indices.tolist())
    for t, v in zip(top.indices.tolist(), top.values.tolist()):
        assert first[t] == pytest.approx(v, abs=1e-4)
    assert float(torch.logsumexp(ref, 0)) == pytest.approx(0.0, abs=1e-5)
    assert sum(torch.tensor(list(first.values())).exp().tolist()) <= 1.0 + 1e-6
    plain = gen(llm, [p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                                     dict(presence_penalty=1.5)], ids=lambda d: next(iter(d)))
def test_penalties_change_greedy_output(llm, vocab, penalty):
    prompts = rand_prompts(vocab, 6, seed=10)
    plain = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    pen = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalty))
    changed = sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(plain, pen))
    assert changed >= 3

    def repeats(outs) -> int:
        return sum(len(o.outputs[0].token_ids) - len(set(o.outputs[0].token_ids)) for o in outs)

    if "repetition_penalty" not in penalty:  # these penalise repeated output tokens directly
        assert repeats(pen) < repeats(plain)
