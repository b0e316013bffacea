"""The HTTP toolkit the server and the Ray ingress share (`conveyor/server/http.py`)."""

from __future__ import annotations

from conveyor.server.http import ApiKeys, bearer_token, forwarded_headers


def test_api_keys_take_any_of_several_and_nothing_else():
    keys = ApiKeys("k1,k2")
    assert keys and keys.accepts("k1") and keys.accepts("k2")
    assert not any(keys.accepts(t) for t in ("k1,k2", "k", "k12", "", "K1"))
    assert not ApiKeys(None) and not ApiKeys("")  # no keys: no check


def test_bearer_token_is_parsed_once_for_every_rule():
    assert bearer_token({"authorization": "Bearer sk-1"}) == "sk-1"
    assert bearer_token({"authorization": "bearer sk-1"}) == "sk-1"
    assert bearer_token({"authorization": "Basic abc"}) == bearer_token({}) == ""


def test_an_ingress_forwards_end_to_end_headers_only():
    given = [("authorization", "Bearer k"), ("x-team", "blue"), ("content-type", "application/json"),
             ("user-agent", "t"), ("connection", "keep-alive"), ("host", "a:1"), ("content-length", "5"),
             ("Transfer-Encoding", "chunked"), ("keep-alive", "timeout=5")]
    assert forwarded_headers(given) == given[:4]
