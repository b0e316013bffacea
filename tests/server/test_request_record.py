"""One request record from every endpoint: whichever endpoint a request comes through, its per-request fields
(`user` or the server's tenant rule, `priority`, `cache_salt`, the latency targets) reach the scheduler the
same way. Adding an endpoint means adding it to `ENDPOINTS`."""

from __future__ import annotations

import threading

import httpx
import pytest

from conveyor.scheduler.core import Scheduler
from conveyor.server.api_server import ServerArgs

from .conftest import MODEL, run_server, tiny_config

ENDPOINTS = {
    "completions": ("/completions", {"prompt": "hello there", "max_tokens": 2}),
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}),
    "embeddings": ("/embeddings", {"input": "hello there"}),
}
FIELDS = {"user": "alice", "priority": 3, "cache_salt": "salt-a", "slo_ttft_ms": 250, "slo_tpot_ms": 40.5}


@pytest.fixture()
def scheduled(monkeypatch) -> list[tuple]:
    """What `Scheduler.add` receives, as (tenant, priority, cache_salt, slo_ttft_s, slo_tpot_s) per sequence."""
    seen: list[tuple] = []
    lock = threading.Lock()
    real = Scheduler.add

    def add(self, req):
        with lock:
            seen.append((req.tenant_id, req.priority, req.cache_salt, req.slo_ttft_s, req.slo_tpot_s))
        return real(self, req)

    monkeypatch.setattr(Scheduler, "add", add)
    return seen


def walk(url: str, headers: dict[str, str], fields: dict, seen: list[tuple]) -> dict[str, tuple]:
    """Send the same fields through every endpoint: {endpoint: what the scheduler got}."""
    out = {}
    for name, (path, body) in ENDPOINTS.items():
        del seen[:]
        r = httpx.post(url + "/v1" + path, headers=headers, timeout=60, json={"model": MODEL, **body, **fields})
        assert r.status_code == 200, (name, r.text)
        assert len(seen) == 1, (name, seen)
        out[name] = seen[0]
    return out


def test_every_endpoint_hands_the_scheduler_the_same_fields(server, scheduled):
    got = walk(server.url, server.headers(), FIELDS, scheduled)
    assert set(got.values()) == {("alice", 3, "salt-a", 0.25, 0.0405)}, got
    got = walk(server.url, server.headers(), {}, scheduled)  # none given: the defaults, the same everywhere
    assert set(got.values()) == {("default", 0, None, None, None)}, got


@pytest.fixture(scope="module")
def keyed_server(tiny_llama, request):
    """Two API keys, the tenant by a header (or by key), and default latency targets."""
    rule = request.param
    with run_server(tiny_config(tiny_llama, slo_ttft_ms=900.0, slo_tpot_ms=90.0),
                    ServerArgs(api_key="k1,k2", tenant_key=rule)) as s:
        yield s


@pytest.mark.parametrize("keyed_server", ["header:X-Team"], indirect=True)
def test_the_tenant_header_rule_holds_on_every_endpoint(keyed_server, scheduled):
    """`--tenant-key header:NAME`: the header names the tenant on every endpoint, embeddings included; the
    server's default targets fill in for a request without its own."""
    for key in ("k1", "k2"):  # either key is accepted
        got = walk(keyed_server.url, {"Authorization": f"Bearer {key}", "X-Team": "blue"},
                   {"user": "ignored", "priority": 1}, scheduled)
        assert set(got.values()) == {("blue", 1, None, 0.9, 0.09)}, got


@pytest.mark.parametrize("keyed_server", ["api-key"], indirect=True)
def test_the_api_key_rule_holds_on_every_endpoint(keyed_server, scheduled):
    tenants = set()
    for key in ("k1", "k2"):
        got = walk(keyed_server.url, {"Authorization": f"Bearer {key}"}, {"slo_ttft_ms": 100}, scheduled)
        assert len(set(got.values())) == 1, got
        tenant, _, _, ttft, tpot = next(iter(got.values()))
        assert tenant.startswith("key-") and key not in tenant and (ttft, tpot) == (0.1, 0.09), got
        tenants.add(tenant)
    assert len(tenants) == 2
    bad = httpx.post(keyed_server.url + "/v1/embeddings", headers={"Authorization": "Bearer k1,k2"}, timeout=30,
                     json={"model": MODEL, "input": "x"})
    assert bad.status_code == 401
