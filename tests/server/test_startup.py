"""A starting server answers at once: 503 "loading" on /health and on every API route, then 200.

The engine's load is held at a gate (a `threading.Event`) that the test opens once it has seen the
"loading" answers, so the test does not depend on how long a load takes on this machine.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor import startup
from conveyor.server.api_server import ServerArgs, build_app
from conveyor.server.launch import GracefulServer, LoadingApp

from .conftest import MODEL, free_socket, tiny_config

PHASES = {startup.STARTING, startup.LOADING_WEIGHTS, startup.COMPILING_KERNELS, startup.ALLOCATING_KV,
          startup.FILLING_KV, startup.WARMING_UP}


@contextlib.contextmanager
def loading_server(load: Callable[[], Any]) -> Iterator[tuple[str, LoadingApp, GracefulServer]]:
    failures: list[BaseException] = []
    app = LoadingApp(load, on_failure=failures.append)
    app.failures = failures
    sock = free_socket()
    uv = GracefulServer(app, grace_s=1.0, log_level="warning")
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app, uv
    finally:
        uv.should_exit = True
        thread.join(15)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_loading_then_ready(tiny_llama):
    gate = threading.Event()
    cfg = tiny_config(tiny_llama)

    def load():
        assert gate.wait(120), "the test never opened the gate"
        return build_app(cfg, ServerArgs())

    with loading_server(load) as (url, app, _):
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and h.headers["retry-after"] == "1"
        body = h.json()
        assert body["status"] == "loading" and body["phase"] in PHASES and body["elapsed_s"] >= 0
        for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("POST", "/tokenize")]:
            r = httpx.request(method, url + path, json={"model": MODEL, "messages": [], "prompt": "x"}, timeout=10)
            assert r.status_code == 503, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "loading" and err["type"] == "service_unavailable" and "loading" in err["message"]
        assert httpx.get(url + "/version", timeout=10).status_code == 200
        assert metrics(url)["conveyor:server_ready"] == 0

        gate.set()
        deadline = time.monotonic() + 120
        while (h := httpx.get(url + "/health", timeout=10)).status_code != 200:
            assert h.status_code == 503 and h.json()["status"] == "loading", h.text
            assert time.monotonic() < deadline, f"not ready after 120 s: {h.text}"
            time.sleep(0.05)
        assert h.json() == {"status": "ok"} and app.ready and app.ready_s > 0
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        m = metrics(url)
        assert m["conveyor:server_ready"] == 1 and m["conveyor:startup_seconds"] == app.ready_s


def test_failed_load_says_so():
    def load():
        raise ValueError("no model at /nowhere")

    with loading_server(load) as (url, app, _):
        deadline = time.monotonic() + 30
        while not app.failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(app.error, ValueError)  # run_server stops the server then and exits with it
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "failed" and "/nowhere" in h.json()["error"]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_stop_while_loading():
    gate = threading.Event()

    def load():
        gate.wait(60)
        raise RuntimeError("the test's load is over")

    try:
        with loading_server(load) as (url, app, _):
            assert httpx.get(url + "/health", timeout=10).json()["status"] == "loading"
        assert not app.ready  # the server stopped cleanly with its engine never up
    finally:
        gate.set()


def test_serve_with_a_bad_model_answers_then_exits_with_the_error(tmp_path):
    """`conveyor serve`: the port answers while the engine loads; a load that fails ends the server with the
    CLI's one-line error and exit code 2, as before the load moved behind the port."""
    proc = subprocess.run([sys.executable, "-m", "conveyor", "serve", "--port", "0", "--model",
                           str(tmp_path / "no-such-model")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "serving there" in proc.stderr and "conveyor: error: unknown model name or path" in proc.stderr, proc.stderr
