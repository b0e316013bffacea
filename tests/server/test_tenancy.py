"""The tenant rule (`--tenant-key`) and the latency-target fields, from HTTP to the engine."""

from __future__ import annotations

import pytest

from conveyor.request import slo_seconds
from conveyor.server.tenancy import TenantRule


def test_tenant_rule_sources():
    headers = {"authorization": "Bearer sk-one", "x-team": "blue"}
    assert TenantRule.parse("user").resolve("alice", headers) == "alice"
    assert TenantRule.parse("user").resolve(None, headers) is None  # the default tenant
    assert TenantRule.parse("header:X-Team").resolve("alice", headers) == "blue"
    assert TenantRule.parse("header:X-Missing").resolve("alice", headers) is None
    key = TenantRule.parse("api-key").resolve("alice", headers)
    assert key.startswith("key-") and "sk-one" not in key, "an API key must never become a visible name"
    assert key != TenantRule.parse("api-key").resolve(None, {"authorization": "Bearer sk-two"})
    assert len(TenantRule().resolve("x" * 1000, {})) == 256
    for bad in ("users", "header:", "api_key"):
        with pytest.raises(ValueError):
            TenantRule.parse(bad)


def test_slo_seconds():
    assert slo_seconds(250.0) == 0.25
    assert slo_seconds(None) is None


def test_tenant_labels_are_bounded():
    from conveyor.server.metrics import TenantLabels

    label = TenantLabels(max_tenants=2)
    assert [label(t) for t in ("a", None, "c", "a", "other", "d")] == ["a", "default", "other", "a", "other",
                                                                       "other"]


def test_tenant_and_targets_reach_the_engine_and_the_metrics(server, client):
    engine = server.app.state.engine.client.engine
    seen = []
    real = engine.add_request

    def recording(request):
        seen.append((request.tenant, request.slo_ttft_s, request.slo_tpot_s))
        return real(request)

    engine.add_request = recording
    try:
        before = server.scrape()
        client.completions.create(model="tiny", prompt="hi", max_tokens=5, user="alice",
                                  extra_body={"ignore_eos": True, "slo_ttft_ms": 250, "slo_tpot_ms": 40.5})
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"ignore_eos": True})
        after = server.wait_idle()
    finally:
        del engine.add_request
    assert seen == [("alice", 0.25, 0.0405), (None, None, None)]
    gen = "conveyor:tenant_generation_tokens_total{tenant=%s}"
    assert after[gen % "alice"] - before.get(gen % "alice", 0) == 5
    assert after[gen % "default"] - before.get(gen % "default", 0) == 3
    ttft = "conveyor:tenant_time_to_first_token_seconds_count{tenant=alice}"
    assert after[ttft] - before.get(ttft, 0) == 1
    assert after["conveyor:tenant_prompt_tokens_total{tenant=alice}"] > 0


@pytest.mark.parametrize("field,value", [("slo_ttft_ms", -1), ("slo_ttft_ms", 0), ("slo_tpot_ms", "40"),
                                         ("slo_tpot_ms", True), ("user", 5)])
def test_bad_targets_and_tenants_are_400(server, field, value):
    import httpx

    r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert httpx.get(server.url + "/health").status_code == 200
