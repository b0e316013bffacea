"""`SamplingParams` rejects every out-of-range value with a ValueError that names the field.

The HTTP server maps these messages straight to 400 responses, so the field name in the message
is part of the contract.
"""

from __future__ import annotations

import math

import pytest

from conveyor.sampling_params import SamplingParams

BAD = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("n", 0), ("n", 129),
    ("min_tokens", -1),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
    ("logprobs", -1), ("logprobs", 21),
    ("seed", "42"), ("seed", True),
    ("stop", [""]), ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_too_many_stop_strings():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])


@pytest.mark.parametrize("kw", [dict(top_p=1.0), dict(top_p=1e-9), dict(temperature=0.0), dict(top_k=-1),
                                dict(top_k=0), dict(max_tokens=None), dict(min_p=1.0), dict(logprobs=0),
                                dict(n=128), dict(repetition_penalty=2.0), dict(presence_penalty=-2.0)])
def test_boundary_values_are_accepted(kw):
    SamplingParams(**kw)


def test_stop_normalisation_and_greedy():
    assert SamplingParams(stop="###").stop_list == ["###"]
    assert SamplingParams(stop=None).stop_list == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().needs_penalties and SamplingParams(presence_penalty=0.1).needs_penalties


def test_for_sample_gives_distinct_seeds():
    sp = SamplingParams(n=3, seed=10, temperature=0.7)
    subs = [sp.for_sample(i) for i in range(3)]
    assert [s.seed for s in subs] == [10, 11, 12]
    assert all(s.n == 1 and s.temperature == 0.7 for s in subs)
    assert SamplingParams(n=2).for_sample(1).seed is None
