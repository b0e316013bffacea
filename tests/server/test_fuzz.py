"""Random bodies (right fields, any values) never crash the server or leak a KV block."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY, MODEL

# A valid body with up to two fields replaced by junk: most draws reach the engine, the rest probe validation.
junk = st.one_of(st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                 st.integers(-(2**70), 2**70), st.integers(-3, 8), st.lists(st.integers(-5, 500), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
sampling = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "top_k": st.integers(-1, 50), "min_tokens": st.integers(0, 2),
    "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.one_of(st.text(min_size=1, max_size=3),
                                                              st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "priority": st.integers(-3, 3), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
completion_valid = st.fixed_dictionaries({
    "model": st.just(MODEL), "max_tokens": st.integers(2, 6),
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 300), min_size=1, max_size=8),
                        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3))},
    optional={**sampling, "logprobs": st.integers(0, 5), "echo": st.booleans()})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.text(max_size=30)})
chat_valid = st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(2, 6),
                                    "messages": st.lists(message, min_size=1, max_size=3)},
                                   optional={**sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 4)})


def mutated(valid: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy:
    junked = st.dictionaries(st.sampled_from(fields), junk, max_size=2)
    return st.tuples(valid, junked).map(lambda t: {**t[0], **t[1]})


completion_bodies = mutated(completion_valid, ["prompt", "max_tokens", "logprobs", "echo", *sampling])
chat_bodies = mutated(chat_valid, ["messages", "max_tokens", "logprobs", "top_logprobs", *sampling])


STATUSES: dict[int, int] = {}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _check(r: httpx.Response) -> None:
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=st.one_of(completion_bodies.map(lambda b: ("/completions", b)),
                      chat_bodies.map(lambda b: ("/chat/completions", b))))
def test_random_bodies_never_crash(server, http, body):
    path, payload = body
    r = http.post(path, content=json.dumps(payload), headers={"Content-Type": "application/json"})
    STATUSES[r.status_code] = STATUSES.get(r.status_code, 0) + 1
    _check(r)


def test_after_fuzz_nothing_leaked(server, http):
    assert STATUSES.get(200, 0) > 0 and STATUSES.get(400, 0) > 0, STATUSES  # both paths were exercised
    m = server.wait_idle()
    assert m["conveyor:engine_alive"] == 1 and m["conveyor:kv_cache_blocks_used"] == 0
    assert http.post("/completions", json={"model": MODEL, "prompt": "still ok", "max_tokens": 2}).status_code == 200
