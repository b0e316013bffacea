"""The live dashboard's data path: the page, the key-checked event stream, what the events carry, slow
viewers, the engine's KV map, and the lab's replay."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from conveyor.bench.replay import build_replay_app, replay_runs

from .conftest import MODEL

LAB_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "lab" / "results.json"


def read_events(server, stop, timeout: float = 60.0, on_setup=None) -> list[dict]:
    """Events from /dashboard/events until `stop(events)` is true (the setup event first, after which
    `on_setup()` runs: load started then is seen from its first step)."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", server.url + "/dashboard/events", headers=server.headers(), timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = "message"
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append({"kind": kind, **json.loads(line[6:])})
                if kind == "setup" and on_setup is not None:
                    on_setup()
                kind = "message"
                if stop(events) or time.monotonic() > deadline:
                    break
    return events


def load(server, n: int = 6, max_tokens: int = 24, models: list[str] | None = None) -> threading.Thread:
    """`n` concurrent completions in a background thread (request i under `models[i]` when given: then
    there are len(models) of them, else under the base model)."""
    models = models or [MODEL] * n

    def run() -> None:
        def one(i: int) -> None:
            httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": models[i], "prompt": f"dashboard {i} " * 8, "max_tokens": max_tokens,
                             "ignore_eos": True})

        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(models))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_page_is_served_and_the_stream_needs_the_key(server):
    page = httpx.get(server.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'id="occupancy"' in page.text and 'id="kvmap"' in page.text
    r = httpx.get(server.url + "/dashboard/events", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_events_carry_steps_snapshot_and_kv_map(server):
    threads = []
    try:
        events = read_events(server, lambda evs: any(e.get("kv") for e in evs)
                             and sum(len(e.get("steps", [])) for e in evs) >= 5,
                             on_setup=lambda: threads.append(load(server)))
    finally:
        for t in threads:
            t.join(60)
    setup = events[0]
    assert setup["kind"] == "setup" and setup["strategy"] == "iteration"
    assert setup["knobs"]["max_num_seqs"] == 64 and setup["kv_blocks"] == 160
    steps = [s for e in events[1:] for s in e.get("steps", [])]
    assert len(steps) >= 5
    idx, t_ms, dur_ms, tok, pf, running, waiting, kv_used, items, preempted = steps[0]
    assert tok == sum(n for _, n, _ in items) and pf <= tok and dur_ms > 0
    assert any(p for s in steps for _, _, p in s[8]) and any(not p for s in steps for _, _, p in s[8])
    assert all(isinstance(r, int) for s in steps for r, _, _ in s[8])
    kv = next(e["kv"] for e in events if e.get("kv"))
    assert kv["num_blocks"] == 160 and sum(kv["totals"].values()) == 160
    assert len(bytes.fromhex(kv["cells"])) == 160
    snap = next(e["snapshot"] for e in reversed(events) if e.get("snapshot"))
    assert snap["kv_total"] == 160


def test_counts_match_metrics_once_idle(server):
    load(server, n=3).join(60)
    m = server.wait_idle(10)
    # the minute holds whole seconds only: the one the load ran in shows up once it is over
    def filled(e: dict) -> bool:  # TTFTs are recorded when a request finishes: maybe a second after its tokens
        mn = e.get("minute", {})
        return bool(sum(mn.get("gen_tok_s", []))) and mn.get("ttft_p50_min") is not None

    events = read_events(server, lambda evs: any(filled(e) for e in evs), timeout=10)
    minute = next(e["minute"] for e in events if filled(e))
    assert minute["ttft_p50_min"] is not None and minute["itl_p50_min"] is not None
    load(server, n=2, max_tokens=8).join(60)
    server.wait_idle(10)  # the hub's snapshot is the engine's latest: with nothing running it equals /metrics
    events = read_events(server, lambda evs: any(e.get("snapshot") for e in evs), timeout=5)
    m = server.scrape()
    snap = next(e["snapshot"] for e in events if e.get("snapshot"))
    assert snap["gen_tokens"] == m["conveyor:generation_tokens_total"]
    assert snap["running"] == m["conveyor:num_requests_running"] == 0


def test_a_slow_viewer_gets_drops_not_a_backlog(server):
    hub = server.app.state.dashboard
    loop = server.app.state.engine._loop

    async def subscribe():
        return hub.subscribe()

    q = asyncio.run_coroutine_threadsafe(subscribe(), loop).result(10)
    try:
        load(server, n=8, max_tokens=48).join(60)
        deadline = time.monotonic() + 10
        while hub.viewers.get(q, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert q.qsize() <= hub.queue_size and hub.viewers[q] > 0
    finally:
        loop.call_soon_threadsafe(hub.unsubscribe, q)


def test_replay_of_the_committed_lab_results():
    runs = replay_runs(json.load(open(LAB_RESULTS)))
    assert {"static", "dynamic", "continuous", "iteration"} <= set(runs)
    steps = runs["iteration"]["steps"]
    assert len(steps) > 10 and all(len(s) == 10 for s in steps)
    assert all(steps[i][1] <= steps[i + 1][1] for i in range(len(steps) - 1))
    client = TestClient(build_replay_app(str(LAB_RESULTS)))
    assert "iframe" in client.get("/dashboard/compare").text
    assert client.get("/dashboard/replay/static.json").json()["setup"]["strategy"] == "static"
    assert client.get("/dashboard/replay/nope.json").status_code == 404


def test_an_idle_server_still_streams_the_setup_and_the_minute(server):
    server.wait_idle(10)
    events = read_events(server, lambda evs: any("minute" in e for e in evs), timeout=10)
    assert events[0]["kind"] == "setup" and events[0]["model"] == MODEL


def test_snapshot_carries_tenant_rows(server):
    """Per-tenant rows (tenant, running, waiting, tokens generated), the busiest first: while two tenants'
    requests run they show up with their counts, and once idle each one's tokens equal its per-tenant
    counter in /metrics."""
    def run(user: str, n: int) -> list[threading.Thread]:
        def one(i: int) -> None:
            httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": MODEL, "prompt": f"tenant {user} {i} " * 6, "max_tokens": 160,
                             "ignore_eos": True, "user": user})

        ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        return ts

    threads: list[threading.Thread] = []

    def busy(evs: list[dict]) -> bool:
        rows = [r for e in evs for r in (e.get("snapshot") or {}).get("tenants", [])]
        return any(r[0] == "dash-a" and r[1] + r[2] for r in rows) and any(r[0] == "dash-b" and r[1] + r[2]
                                                                           for r in rows)
    try:
        events = read_events(server, busy, on_setup=lambda: threads.extend(run("dash-a", 4) + run("dash-b", 2)))
    finally:
        for t in threads:
            t.join(60)
    assert busy(events)
    for e in events:
        rows = (e.get("snapshot") or {}).get("tenants", [])
        assert all(len(r) == 4 and isinstance(r[0], str) for r in rows)
        keys = [(-r[1] - r[2], -r[3]) for r in rows]
        assert keys == sorted(keys), "the busiest tenant first"
    m = server.wait_idle(10)
    events = read_events(server, lambda evs: any(e.get("snapshot") for e in evs), timeout=5)
    rows = {r[0]: r for r in next(e["snapshot"] for e in events if e.get("snapshot"))["tenants"]}
    for user, n in (("dash-a", 4), ("dash-b", 2)):
        assert rows[user][1:3] == [0, 0]
        assert rows[user][3] == m[f"conveyor:tenant_generation_tokens_total{{tenant={user}}}"] == 160 * n
