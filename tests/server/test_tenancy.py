"""The tenant rule (`--tenant-key`) and the latency-target fields, from HTTP to the engine."""

from __future__ import annotations

import pytest

from conveyor.server.tenancy import TenantRule, slo_seconds


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
