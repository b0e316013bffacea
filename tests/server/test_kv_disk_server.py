"""The disk tier behind the HTTP API: a restarted server answers a prompt it served before from disk
(`usage.prompt_tokens_details.cached_tokens`), with the same tokens, and says so in /metrics and on the
dashboard's event stream."""

from __future__ import annotations

import json

import httpx

from conveyor.kv_cache.disk_tier import DiskTierStats
from conveyor.server.dashboard import kv_disk_view
from conveyor.server.metrics import EngineStats, ServerMetrics

from .conftest import MODEL, run_server, tiny_config

PROMPT = list(range(200, 340))  # 140 tokens: 8 full blocks of 16


def complete(srv, salt: str | None = None) -> tuple[list, int]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    # the tokens (this model runs the torch attention path, whose last bits depend on the query length, as
    # with any prefix-cache hit; tests/engine/test_kv_disk.py checks logprobs bit for bit on the kernel path)
    return out["choices"][0]["logprobs"]["tokens"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restarted_server_serves_the_prompt_from_disk(tiny_llama, tmp_path):
    cfg = tiny_config(tiny_llama, kv_disk_dir=str(tmp_path / "tier"), kv_disk_load="always")
    with run_server(cfg) as srv:
        cold, cached = complete(srv, salt="t1")
        assert cached == 0
        m = srv.wait_idle()
        assert m["conveyor:kv_disk_capacity_bytes"] == 16 * 2**30 and m["conveyor:kv_disk_loads_total"] == 0
        client = srv.app.state.engine.client
    client.join(60)  # the engine loop has ended and closed its tier (a busy machine may need the time)
    assert not client.thread.is_alive()
    with run_server(cfg) as srv:  # the same model and configuration, a new process's worth of state
        warm, cached = complete(srv, salt="t1")
        assert cached == 128 and warm == cold
        assert complete(srv, salt="t2")[1] == 0  # another tenant's salt: nothing from disk either
        m = srv.wait_idle()
        assert m["conveyor:kv_disk_loads_total"] == 8 and m["conveyor:kv_disk_hits_total"] == 8
        assert m["conveyor:kv_disk_blocks"] >= 16 and m["conveyor:kv_disk_corrupt_total"] == 0
        assert m["conveyor:kv_disk_writing"] == 1 and m["conveyor:kv_disk_load_seconds_total"] > 0
        with httpx.stream("GET", srv.url + "/dashboard/events", timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and "snapshot" in (ev := json.loads(line[6:])):
                    assert ev["snapshot"]["kv_disk"]["loads"] == 8
                    break


def test_no_tier_no_series():
    text = ServerMetrics("m", lambda: EngineStats()).render().decode()
    assert "kv_disk" not in text
    d = DiskTierStats("/x", 100, 3, 30, 4, 3, 0.5, 1, 7, 70, 0.01, 2, 1, 1, True, 0.1, 2.0)
    text = ServerMetrics("m", lambda: EngineStats(kv_disk=d)).render().decode()
    for series in ("conveyor:kv_disk_blocks{", "conveyor:kv_disk_loads_total{", "conveyor:kv_disk_evictions_total{",
                   "conveyor:kv_disk_write_drops_total{", "conveyor:kv_disk_recomputed_total{",
                   "conveyor:kv_disk_write_cpu_seconds_total{"):
        assert series in text
    assert kv_disk_view(d)["load_ms"] == round(1e3 * 0.5 / 3, 3)
