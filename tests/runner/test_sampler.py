"""`conveyor.runner.sampler.sample` on handcrafted logits: each knob does exactly what it says.

Distribution checks draw thousands of rows in one call (the sampler is vectorised), with torch's
global RNG seeded, so they are deterministic and their tolerances are several standard errors wide.
"""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.request import Request
from conveyor.runner.sampler import sample
from conveyor.sampling_params import SamplingParams

EOS = 5
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])  # a distribution with known cut-offs for top-k/p and min-p


def req(prompt=(9,), output=(), rid="r", **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    r.output_token_ids = list(output)
    return r


def rows(logits: torch.Tensor, n: int) -> torch.Tensor:
    return logits.repeat(n, 1)


def frequencies(tokens: list[int], v: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=v).float() / len(tokens)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


def test_greedy_is_argmax():
    logits = torch.randn(64, 50)
    out = sample(logits.clone(), [req(temperature=0.0) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 64 and out.sampled_logprobs == [None] * 64


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(32, 50)
    reqs = [req(temperature=0.0 if i % 2 else 1.0) for i in range(32)]
    out = sample(logits.clone(), reqs)
    arg = logits.argmax(-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i % 2] == [a for i, a in enumerate(arg) if i % 2]
    assert [t for i, t in enumerate(out.token_ids) if not i % 2] != [a for i, a in enumerate(arg) if not i % 2]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k=1", "top_p=tiny", "min_p=1"])
def test_degenerate_truncation_is_greedy(params):
    logits = torch.randn(256, 50) * 3
    out = sample(logits.clone(), [req(temperature=1.0, **params) for _ in range(256)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_one_follows_the_softmax():
    n = 8000
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0) for _ in range(n)])
    torch.testing.assert_close(frequencies(out.token_ids, 4), PROBS, atol=0.02, rtol=0)


def test_temperature_sharpens_and_flattens():
    n = 8000
    for t in (0.5, 2.0):
        out = sample(rows(PROBS.log(), n), [req(temperature=t) for _ in range(n)])
        want = torch.softmax(PROBS.log() / t, -1)
        torch.testing.assert_close(frequencies(out.token_ids, 4), want, atol=0.02, rtol=0)


def test_top_k_keeps_the_k_best_renormalised():
    n = 8000
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0, top_k=2) for _ in range(n)])
    torch.testing.assert_close(frequencies(out.token_ids, 4), torch.tensor([0.625, 0.375, 0, 0]), atol=0.02,
                               rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    n = 8000
    # 0.5 < 0.6, so token 1 is needed too; 0.5 + 0.3 >= 0.6, so token 2 is not
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0, top_p=0.6) for _ in range(n)])
    torch.testing.assert_close(frequencies(out.token_ids, 4), torch.tensor([0.625, 0.375, 0, 0]), atol=0.02,
                               rtol=0)
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0, top_p=0.85) for _ in range(n)])
    assert set(out.token_ids) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    n = 8000
    # threshold 0.5 * 0.5 = 0.25: tokens 0 (0.5) and 1 (0.3) survive
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0, min_p=0.5) for _ in range(n)])
    torch.testing.assert_close(frequencies(out.token_ids, 4), torch.tensor([0.625, 0.375, 0, 0]), atol=0.02,
                               rtol=0)
    out = sample(rows(PROBS.log(), n), [req(temperature=1.0) for _ in range(n)])
    assert set(out.token_ids) == {0, 1, 2, 3}


def test_temperature_gives_varied_tokens():
    logits = torch.randn(1, 100)
    out = sample(rows(logits, 200), [req(temperature=1.0) for _ in range(200)])
    assert len(set(out.token_ids)) > 10


def test_seeded_row_ignores_its_neighbours():
    """A seeded request's noise depends on (seed, position) only: same tokens alone or among random rows."""
    logits = torch.randn(1, 100)

    def draw(batch_size: int, position: int, seed: int = 42) -> list[int]:
        r = req(temperature=1.0, seed=seed, rid="seeded")
        toks = []
        for _ in range(8):
            reqs = [req(temperature=1.0, rid=f"o{i}") for i in range(batch_size)]
            reqs.insert(position, r)
            other = torch.randn(batch_size + 1, 100)
            other[position] = logits[0]
            toks.append(sample(other, reqs).token_ids[position])
            r.output_token_ids.append(toks[-1])  # the next draw is the next output position
        return toks

    alone = draw(0, 0)
    assert draw(10, 3) == alone and draw(5, 5) == alone
    assert len(set(alone)) > 1  # it really samples
    assert draw(0, 0, seed=43) != alone


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    logits[0, 6] = 9.0
    logits[0, 2] = 8.0
    early = req(temperature=0.0, min_tokens=3, stop_token_ids=[6], output=[1, 1])
    assert sample(logits.clone(), [early]).token_ids == [2]
    done = req(temperature=0.0, min_tokens=3, stop_token_ids=[6], output=[1, 1, 1])
    assert sample(logits.clone(), [done]).token_ids == [EOS]
    # ignore_eos: EOS does not end the sequence, so it need not be banned; stop ids still are
    ign = req(temperature=0.0, min_tokens=3, stop_token_ids=[6], ignore_eos=True, output=[1])
    assert sample(logits.clone(), [ign]).token_ids == [EOS]
    logits[0, EOS] = -1.0
    assert sample(logits.clone(), [ign]).token_ids == [2]


def test_logprobs_are_log_softmax_with_top_k_entries():
    torch.manual_seed(0)
    logits = torch.randn(3, 30) * 2
    reqs = [req(temperature=0.0, logprobs=0), req(temperature=0.0, logprobs=4), req(temperature=1.0, logprobs=4)]
    out = sample(logits.clone(), reqs)
    ref = torch.log_softmax(logits, -1)
    for i, r in enumerate(reqs):
        entry = out.logprobs[i]
        tok = out.token_ids[i]
        k = r.params.logprobs
        top = ref[i].topk(k).indices.tolist() if k else []
        assert set(entry) == set(top) | {tok}
        assert len(entry) in (k, k + 1)
        for t, lp in entry.items():
            assert lp <= 0
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-5)
        assert out.sampled_logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-5)
    # the full distribution (k = vocabulary) sums to one
    small = torch.randn(1, 20)
    full = sample(small.clone(), [req(temperature=0.0, logprobs=20)]).logprobs[0]
    assert len(full) == 20
    assert torch.logsumexp(torch.tensor(list(full.values())), 0).item() == pytest.approx(0.0, abs=1e-5)


def penalised_reference(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float,
                        pres: float) -> torch.Tensor:
    """vLLM's rule, one token at a time: repetition over prompt + output, frequency/presence over output."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= freq * output.count(t) + pres
    return x


@pytest.mark.parametrize("rep,freq,pres", [(2.0, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (1.5, 0.3, -0.4)])
def test_penalties_hit_exactly_the_right_tokens(rep, freq, pres):
    v = 10
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, -0.5, 1.0, 3.0, -2.0, 0.0, 0.25]])
    prompt, output = [0, 1, 3], [2, 2, 6, 1]
    r = req(prompt=prompt, output=output, temperature=0.0, logprobs=v, repetition_penalty=rep,
            frequency_penalty=freq, presence_penalty=pres)
    out = sample(logits.clone(), [r])
    want = penalised_reference(logits[0], prompt, output, rep, freq, pres)
    want_lp = torch.log_softmax(want, -1)
    got_lp = torch.tensor([out.logprobs[0][t] for t in range(v)])
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    assert out.token_ids == [int(want.argmax())]
    untouched = [t for t in range(v) if t not in prompt + output]
    # tokens never seen keep their logits: their log-prob gaps are unchanged
    base = torch.log_softmax(logits[0], -1)
    gaps_got = got_lp[untouched] - got_lp[untouched[0]]
    gaps_base = base[untouched] - base[untouched[0]]
    torch.testing.assert_close(gaps_got, gaps_base, atol=1e-5, rtol=0)


def test_penalties_change_the_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    plain = sample(logits.clone(), [req(prompt=[3], output=[0], temperature=0.0)]).token_ids
    assert plain == [0]
    for kw in (dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=0.5)):
        assert sample(logits.clone(), [req(prompt=[3], output=[0], temperature=0.0, **kw)]).token_ids == [1], kw
    # presence/frequency look at generated tokens only; the prompt alone does not trigger them
    assert sample(logits.clone(), [req(prompt=[0], temperature=0.0, presence_penalty=2.0)]).token_ids == [0]
    # a penalised row does not leak into its unpenalised neighbour
    both = sample(rows(logits, 2), [req(prompt=[3], output=[0], temperature=0.0, frequency_penalty=1.0),
                                    req(prompt=[3], output=[0], temperature=0.0)]).token_ids
    assert both == [1, 0]


def test_sampling_is_exact_for_a_seeded_request_between_calls():
    """Same seed, same logits: the same token sequence, call after call (reproducibility)."""
    logits = torch.randn(1, 64)
    a, b = req(temperature=0.8, top_p=0.9, seed=7), req(temperature=0.8, top_p=0.9, seed=7)
    ta = [sample(logits.clone(), [a]).token_ids[0] for _ in range(10)]
    tb = [sample(logits.clone(), [b]).token_ids[0] for _ in range(10)]
    assert ta == tb
    assert not math.isnan(sum(ta))
