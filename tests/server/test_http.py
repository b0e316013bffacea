"""The HTTP toolkit the server and the Ray ingress share (`conveyor/server/http.py`)."""

from __future__ import annotations

from conveyor.engine.clients import EngineDeadError
from conveyor.server.args import RETRY_AFTER_S
from conveyor.server.async_engine import (
    EngineRestartedError,
    EngineRestartingError,
    ServerDrainingError,
    ServerShutdownError,
)
from conveyor.server.http import ApiKeys, bearer_token, engine_error, forwarded_headers


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


def test_an_engine_that_cannot_serve_is_answered_as_its_error_says():
    """One answer per engine state, whoever raises it (the endpoints, the streaming skeleton, the ingress):
    a retry is advised (Retry-After) only where asking again soon can succeed."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    cases = [(EngineDeadError("dead"), 503, "service_unavailable", "engine_dead", None),
             (EngineRestartingError("restarting"), 503, "service_unavailable", "loading", retry),
             (ServerDrainingError("draining"), 503, "service_unavailable", "draining", retry),
             (EngineRestartedError("died under it"), 500, "internal_error", "engine_restarted", None),
             (ServerShutdownError("time is up"), 503, "service_unavailable", "server_shutdown", None)]
    for exc, status, type_, code, headers in cases:
        e = engine_error(exc)
        assert (e.status, e.type, e.code, e.headers) == (status, type_, code, headers), exc
        assert e.body()["error"] == {"message": str(exc), "type": type_, "param": None, "code": code}
