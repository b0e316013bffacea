"""The dashboard shows LoRA adapters: those of the running batch, the resident (loaded) ones and those
waiting, from the engine's snapshot; checked on the event stream and in a real browser (Playwright, as
test_dashboard_browser.py; skipped with the reason where it or Chromium is missing)."""

from __future__ import annotations

import threading

import httpx
import pytest

from conveyor.server.api_server import ServerArgs
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter

from .conftest import API_KEY, MODEL, run_server, tiny_config
from .test_dashboard import load, read_events
from .test_dashboard_browser import ARTIFACTS, browser  # noqa: F401 - the browser fixture


@pytest.fixture(scope="module")
def lora_dashboard_server(tiny_llama, tmp_path_factory):
    """Two adapters, one per step (max_loras 1), both kept loaded."""
    root = tmp_path_factory.mktemp("dash-adapters")
    dirs = {n: make_adapter(tiny_llama, root / n, 4, ALL_PROJECTIONS, seed=60 + i) for i, n in enumerate("ab")}
    cfg = tiny_config(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=2)
    with run_server(cfg, ServerArgs(api_key=API_KEY, lora_modules=[f"{n}={p}" for n, p in dirs.items()])) as s:
        yield s


def test_events_show_batch_resident_and_waiting_adapters(lora_dashboard_server):
    srv = lora_dashboard_server
    threads: list[threading.Thread] = []

    def busy(evs: list[dict]) -> bool:
        loras = [e["snapshot"]["lora"] for e in evs if e.get("snapshot")]
        both_loaded = any(set(lo["loaded"]) == {"a", "b"} for lo in loras)
        return any(lo["running"] for lo in loras) and any(lo["waiting"] for lo in loras) and both_loaded

    try:
        events = read_events(srv, busy, on_setup=lambda: threads.append(
            load(srv, models=["a", "b", "a", "b", MODEL, "a"])))
    finally:
        for t in threads:
            t.join(60)
    assert events[0]["kind"] == "setup" and events[0]["max_loras"] == 1
    loras = [e["snapshot"]["lora"] for e in events if e.get("snapshot")]
    running = next(lo for lo in loras if lo["running"])
    assert set(running["running"]) <= {"a", "b"} and len(running["running"]) == 1  # max_loras 1: one adapter runs
    assert set(running["running"]) <= set(running["loaded"])  # what runs is resident
    # b's adapter loads when its request reaches the engine, which may come after the first running snapshot
    assert any(set(lo["loaded"]) == {"a", "b"} for lo in loras)
    waiting = next(lo for lo in loras if lo["waiting"])
    assert set(waiting["waiting"]) <= {"a", "b"}
    srv.wait_idle()
    idle = read_events(srv, lambda evs: any(e.get("snapshot") for e in evs), timeout=10)
    lo = next(e["snapshot"]["lora"] for e in idle if e.get("snapshot"))
    assert lo == {"running": {}, "waiting": {}, "loaded": lo["loaded"]} and set(lo["loaded"]) == {"a", "b"}


def test_no_lora_no_adapter_fields(server):
    events = read_events(server, lambda evs: any(e.get("snapshot") for e in evs), timeout=10)
    assert "max_loras" not in events[0]
    assert all("lora" not in e["snapshot"] for e in events if e.get("snapshot"))


def test_page_lists_adapters_in_batch_and_resident(browser, lora_dashboard_server):  # noqa: F811
    srv = lora_dashboard_server
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(f"{srv.url}/dashboard#key={API_KEY}")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=30_000)
    assert page.is_visible("#lora") and "at most 1 per step" in page.text_content("#lora-caption")
    stop = threading.Event()

    def client_loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            httpx.post(srv.base_url + "/completions", headers=srv.headers(), timeout=60, json={
                "model": "ab"[i % 2], "prompt": f"browser {i} {n} " * 4, "max_tokens": 24, "ignore_eos": True})

    clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(6)]
    for t in clients:
        t.start()
    try:
        page.wait_for_selector('#lora-rows tr[data-state="in batch"]', timeout=60_000)
        row = page.locator('#lora-rows tr[data-state="in batch"]').first
        assert row.get_attribute("data-adapter") in ("a", "b") and int(row.locator("td.running").text_content()) > 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-lora.png"), full_page=True)
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    srv.wait_idle()
    page.wait_for_function("[...document.querySelectorAll('#lora-rows tr')].map(r => r.dataset.state).join() "
                           "=== 'resident,resident'", timeout=15_000)
    names = page.eval_on_selector_all("#lora-rows tr", "rows => rows.map(r => r.dataset.adapter)")
    assert names == ["a", "b"]
    page.close()


def test_the_page_hides_the_adapters_without_lora(browser, server):  # noqa: F811
    page = browser.new_page()
    page.goto(f"{server.url}/dashboard#key={API_KEY}")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=30_000)
    assert not page.is_visible("#lora")
    page.close()
