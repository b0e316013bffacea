"""Malformed and hostile requests: each gets the right status and an OpenAI error body; nothing leaks."""

from __future__ import annotations

import json

import httpx

from .conftest import API_KEY, MAX_MODEL_LEN, MODEL

OK_MSGS = [{"role": "user", "content": "hi"}]


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": OK_MSGS, "max_tokens": 4, **kw}


AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}

# (name, method, path, headers, body (dict -> JSON, str/bytes -> raw), status, param or None)
CASES = [
    ("bad json", "POST", "/completions", JSON, '{"prompt": ', 400, None),
    ("body is a list", "POST", "/completions", JSON, "[1, 2]", 400, None),
    ("body is a string", "POST", "/completions", JSON, '"hello"', 400, None),
    ("empty body", "POST", "/completions", JSON, b"", 400, None),
    ("invalid utf-8", "POST", "/completions", JSON, b'{"prompt": "\xff\xfe"}', 400, None),
    ("deep nesting", "POST", "/completions", JSON, "[" * 100_000 + "]" * 100_000, 400, None),
    ("5000-digit int", "POST", "/completions", JSON, '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", 400, None),
    ("missing prompt", "POST", "/completions", JSON, {"model": MODEL}, 400, "prompt"),
    ("prompt is a number", "POST", "/completions", JSON, comp(prompt=123), 400, "prompt"),
    ("prompt empty string", "POST", "/completions", JSON, comp(prompt=""), 400, "prompt"),
    ("prompt empty list", "POST", "/completions", JSON, comp(prompt=[]), 400, "prompt"),
    ("prompt mixed list", "POST", "/completions", JSON, comp(prompt=["a", 1]), 400, "prompt"),
    ("negative token id", "POST", "/completions", JSON, comp(prompt=[-1, 5]), 400, "prompt"),
    ("token id past vocab", "POST", "/completions", JSON, comp(prompt=[10**6]), 400, "prompt"),
    ("token id overflow", "POST", "/completions", JSON, comp(prompt=[2**70]), 400, "prompt"),
    ("empty inner token list", "POST", "/completions", JSON, comp(prompt=[[1, 2], []]), 400, "prompt"),
    ("max_tokens string", "POST", "/completions", JSON, comp(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens negative", "POST", "/completions", JSON, comp(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens zero", "POST", "/completions", JSON, comp(max_tokens=0), 400, "max_tokens"),
    ("max_tokens huge", "POST", "/completions", JSON, comp(max_tokens=10**20), 400, "max_tokens"),
    ("max_tokens bool", "POST", "/completions", JSON, comp(max_tokens=True), 400, "max_tokens"),
    ("max_tokens float", "POST", "/completions", JSON, comp(max_tokens=3.5), 400, "max_tokens"),
    ("temperature NaN", "POST", "/completions", JSON, '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", "POST", "/completions", JSON, '{"prompt": "x", "temperature": Infinity}', 400,
     "temperature"),
    ("temperature 1e999", "POST", "/completions", JSON, '{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("temperature negative", "POST", "/completions", JSON, comp(temperature=-1), 400, "temperature"),
    ("temperature string", "POST", "/completions", JSON, comp(temperature="hot"), 400, "temperature"),
    ("top_p zero", "POST", "/completions", JSON, comp(top_p=0), 400, "top_p"),
    ("top_p above one", "POST", "/completions", JSON, comp(top_p=1.5), 400, "top_p"),
    ("n zero", "POST", "/completions", JSON, comp(n=0), 400, "n"),
    ("n huge", "POST", "/completions", JSON, comp(n=100000), 400, "n"),
    ("logprobs too many", "POST", "/completions", JSON, comp(logprobs=100), 400, "logprobs"),
    ("stop empty string", "POST", "/completions", JSON, comp(stop=[""]), 400, "stop"),
    ("stop too many", "POST", "/completions", JSON, comp(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("stop wrong type", "POST", "/completions", JSON, comp(stop=5), 400, "stop"),
    ("presence_penalty 5", "POST", "/completions", JSON, comp(presence_penalty=5), 400, "presence_penalty"),
    ("repetition_penalty 0", "POST", "/completions", JSON, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed string", "POST", "/completions", JSON, comp(seed="abc"), 400, "seed"),
    ("seed overflow", "POST", "/completions", JSON, comp(seed=2**70), 400, "seed"),
    ("top_k -5", "POST", "/completions", JSON, comp(top_k=-5), 400, "top_k"),
    ("top_k overflow", "POST", "/completions", JSON, comp(top_k=2**80), 400, "top_k"),
    ("min_p 2", "POST", "/completions", JSON, comp(min_p=2.0), 400, "min_p"),
    ("min_tokens > max_tokens", "POST", "/completions", JSON, comp(min_tokens=10), 400, "min_tokens"),
    ("stop_token_ids past vocab", "POST", "/completions", JSON, comp(stop_token_ids=[10**6], min_tokens=2), 400,
     "stop_token_ids"),
    ("stream not bool", "POST", "/completions", JSON, comp(stream="yes"), 400, "stream"),
    ("stream_options not object", "POST", "/completions", JSON, comp(stream=True, stream_options=3), 400,
     "stream_options"),
    ("priority string", "POST", "/completions", JSON, comp(priority="high"), 400, "priority"),
    ("prompt too long", "POST", "/completions", JSON, comp(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("prompt + max_tokens too long", "POST", "/completions", JSON,
     comp(prompt=[5] * (MAX_MODEL_LEN - 10), max_tokens=100), 400, "max_tokens"),
    ("long text prompt", "POST", "/completions", JSON, comp(prompt="word " * 200_000), 400, "prompt"),
    ("10 MB prompt", "POST", "/completions", JSON, comp(prompt="x" * 10_000_000), 413, None),
    ("unknown model", "POST", "/completions", JSON, comp(model="gpt-17"), 404, "model"),
    ("missing key", "POST", "/completions", {"Content-Type": "application/json"}, comp(), 401, None),
    ("wrong key", "POST", "/completions", {"Authorization": "Bearer nope"}, comp(), 401, None),
    ("key without Bearer", "POST", "/completions", {"Authorization": API_KEY}, comp(), 401, None),
    ("models without key", "GET", "/models", {}, None, 401, None),
    ("unknown route", "POST", "/nope", JSON, comp(), 404, None),
    ("GET a POST route", "GET", "/completions", AUTH, None, 405, None),
    ("chat no messages field", "POST", "/chat/completions", JSON, {"model": MODEL}, 400, "messages"),
    ("chat empty messages", "POST", "/chat/completions", JSON, chat(messages=[]), 400, "messages"),
    ("chat messages not list", "POST", "/chat/completions", JSON, chat(messages="hi"), 400, "messages"),
    ("chat unknown role", "POST", "/chat/completions", JSON, chat(messages=[{"role": "wizard", "content": "x"}]),
     400, "messages.0.role"),
    ("chat missing role", "POST", "/chat/completions", JSON, chat(messages=[{"content": "x"}]), 400,
     "messages.0.role"),
    ("chat content number", "POST", "/chat/completions", JSON, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content"),
    ("chat bad content part", "POST", "/chat/completions", JSON,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), 400,
     "messages.0.content"),
    ("chat top_logprobs w/o logprobs", "POST", "/chat/completions", JSON, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat top_logprobs too many", "POST", "/chat/completions", JSON, chat(logprobs=True, top_logprobs=50), 400,
     "top_logprobs"),
    ("chat max_completion_tokens 0", "POST", "/chat/completions", JSON, chat(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("chat huge message", "POST", "/chat/completions", JSON,
     chat(messages=[{"role": "user", "content": "a " * 1_000_000}]), 400, "messages"),
    ("chat frequency_penalty NaN", "POST", "/chat/completions", JSON,
     '{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": NaN}', 400, "frequency_penalty"),
]


def _send(c: httpx.Client, server, method: str, path: str, headers: dict, body) -> httpx.Response:
    url = server.base_url + path
    if body is None:
        return c.request(method, url, headers=headers)
    content = json.dumps(body) if isinstance(body, dict) else body
    return c.request(method, url, headers=headers, content=content)


def test_hostile_requests(server):
    assert len(CASES) >= 30
    before = server.wait_idle()
    problems = []
    with httpx.Client(timeout=60) as c:
        for name, method, path, headers, body, status, param in CASES:
            r = _send(c, server, method, path, headers, body)
            if r.status_code != status:
                problems.append(f"{name}: status {r.status_code} != {status}: {r.text[:200]}")
                continue
            try:
                err = r.json()["error"]
            except Exception:
                problems.append(f"{name}: not an OpenAI error body: {r.text[:200]}")
                continue
            if set(err) != {"message", "type", "param", "code"} or not isinstance(err["message"], str):
                problems.append(f"{name}: malformed error {err}")
            elif param is not None and err["param"] != param:
                problems.append(f"{name}: param {err['param']!r} != {param!r} ({err['message']})")
        assert not problems, "\n".join(problems)
        # health and metrics stay open without a key; the server still serves
        assert c.get(server.url + "/health").status_code == 200
        assert c.get(server.url + "/metrics").status_code == 200
        ok = c.post(server.base_url + "/completions", headers=AUTH, json=comp(max_tokens=3))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
        ok = c.post(server.base_url + "/chat/completions", headers=AUTH, json=chat(max_tokens=3, stream=True))
        assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
    after = server.wait_idle()
    assert after["conveyor:kv_cache_blocks_used"] == 0
    assert after["conveyor:num_requests_running"] == 0 and after["conveyor:num_requests_waiting"] == 0
    assert after["conveyor:engine_alive"] == 1
    # none of the rejected requests reached the engine: only the two good ones added prompt tokens
    assert after["conveyor:request_success_total"] - before["conveyor:request_success_total"] == 2


OPEN_PATHS = {"/health", "/version", "/dashboard", "/metrics"}  # what a probe or a browser reads without a key


def test_every_route_but_the_open_ones_asks_for_the_key(server):
    """Walks the app's own route table, so a route added later without the key check fails here."""
    from starlette.routing import Route

    def flat(routes) -> list[Route]:  # FastAPI 0.165 keeps an included router as one entry of its own
        out = []
        for r in routes:
            inner = getattr(r, "original_router", None)
            out += flat(inner.routes) if inner is not None else [r] if isinstance(r, Route) else []
        return out

    routes = flat(server.app.routes)
    assert {r.path for r in routes} >= OPEN_PATHS | {"/v1/completions", "/v1/batches", "/v1/responses"}
    open_, keyless = [], []
    with httpx.Client(timeout=30) as c:
        for route in routes:
            path = route.path.replace("{", "").replace("}", "")  # path parameters: any value will do
            for method in sorted(route.methods - {"HEAD"}):
                r = c.request(method, server.url + path, headers={"Authorization": "Bearer wrong"})
                if route.path in OPEN_PATHS:
                    if r.status_code == 401:
                        keyless.append(f"{method} {route.path}")
                elif r.status_code != 401 or r.json()["error"]["code"] != "invalid_api_key":
                    open_.append(f"{method} {route.path}: {r.status_code}")
    assert not open_, f"routes answered without the API key: {open_}"
    assert not keyless, f"open routes asked for a key: {keyless}"
