"""SIGTERM drains and exits 0; a second SIGINT exits at once. (A dead engine: test_engine_restart.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conveyor.engine.messages import Stop

from .conftest import MODEL, bound_url, free_socket, popen_server, run_server, server_output, slowed_steps, tiny_config


def _serve(tiny_llama, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama), "--port", "0",
           "--kv-cache-memory", "0.01", "--max-model-len", "512", "--served-model-name", MODEL, "--dtype", "float32",
           *extra]
    return popen_server(cmd, env={**os.environ, "CONVEYOR_API_KEY": "env-key"})


def test_sigterm_drains_then_exits_0(tiny_llama):
    """SIGTERM: the server drains. New requests get 503 draining with Retry-After and /health 503 draining
    (the socket stays open: a load balancer sees the drain), the requests in flight (one running, three
    waiting behind it: --max-num-seqs 1) all complete within --shutdown-timeout, then it exits 0."""
    proc = _serve(tiny_llama, "--shutdown-timeout", "60", "--max-num-seqs", "1")
    url = bound_url(proc)
    auth = {"Authorization": "Bearer env-key"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, server_output(proc)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from $CONVEYOR_API_KEY
        streams: dict[int, list[str]] = {}

        def stream(i: int) -> None:
            body = {"prompt": f"shutdown {i}", "max_tokens": 480, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60, headers=auth) as r:
                streams[i] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while 'conveyor:num_requests_waiting{model_name="tiny"} 3.0' not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the requests did not queue"
            time.sleep(0.005)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "draining" and h.headers["retry-after"], h.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=auth, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"], r.text
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(10)
        out = server_output(proc)
        assert rc == 0, out
        assert elapsed < 50, f"shutdown took {elapsed:.1f}s"
        for i in range(4):  # every request in flight at the signal ran to its end
            lines = streams[i]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            assert json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 480, lines[-2]
        assert "draining 4 request(s) in flight" in out and "Application shutdown complete" in out, out[-3000:]
        # the loaded server's heap was frozen out of the collector's full passes (startup.freeze_startup_heap)
        assert "objects of the loaded server frozen out of the garbage collector" in out, out
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_what_the_drain_leaves_ends_with_a_clear_error(tiny_llama):
    """A request still running when --shutdown-timeout (here 1 s) is up ends with an error event naming
    it (code server_shutdown) and [DONE]; its blocks are freed and the server stops."""
    with run_server(tiny_config(tiny_llama)) as srv:
        with slowed_steps(srv):  # 400 tokens: ~8 s, far past the 1 s drain
            lines: list[str] = []

            def stream() -> None:
                body = {"prompt": "too long", "max_tokens": 400, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=30) as r:
                    lines.extend(line for line in r.iter_lines() if line)

            t = threading.Thread(target=stream)
            t.start()
            deadline = time.monotonic() + 30
            while srv.scrape()["conveyor:num_requests_running"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            time.sleep(0.2)
            h = httpx.get(srv.url + "/health")
            assert h.status_code == 503 and h.json() == {"status": "draining", "in_flight": 1}
            t.join(30)
            srv.thread.join(30)
        assert not srv.thread.is_alive() and not srv.server.forced
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == "server_shutdown" and "--shutdown-timeout" in error["message"], error
        assert srv.app.state.engine.stats().kv_blocks_used == 0


def test_a_second_sigint_exits_at_once(tiny_llama):
    """Ctrl-C once drains (here for up to 60 s, with a long request running); Ctrl-C again stops now."""
    with run_server(tiny_config(tiny_llama)) as srv:
        srv.server.grace_s = 60.0
        with slowed_steps(srv):
            t = threading.Thread(target=lambda: httpx.post(srv.base_url + "/completions", timeout=60, json={
                "prompt": "long", "max_tokens": 400, "ignore_eos": True}))
            t.start()
            deadline = time.monotonic() + 30
            while srv.scrape()["conveyor:num_requests_running"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            srv.server.handle_exit(signal.SIGINT, None)
            time.sleep(0.3)
            assert srv.thread.is_alive() and srv.server.draining  # draining, waiting for the request
            t0 = time.monotonic()
            srv.server.handle_exit(signal.SIGINT, None)
            srv.thread.join(10)
            assert not srv.thread.is_alive() and srv.server.forced
            assert time.monotonic() - t0 < 5
            t.join(30)
        # a forced exit skips the app's shutdown: in a real process the engine thread dies with it; here, stop it
        engine = srv.app.state.engine.client
        engine.send(Stop())
        engine.join(30)


def test_engine_is_built_in_the_thread_that_steps_it(server, client):
    """The model is loaded in the engine thread (OpenMP: one team, see engine/clients.py) and stepped there."""
    loop = server.app.state.engine.client
    assert loop.thread is not threading.main_thread() and loop.thread.is_alive()
    assert loop.built_on == loop.stepped_on == loop.thread.ident
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_taken_port_fails_at_once_before_the_model_or_ray_starts(tmp_path, replicas):
    """The server binds its port first: a taken one is a one-line error (exit 2) in seconds.

    The model path does not exist, so had the server loaded first it would fail on that instead;
    and with replicas no Ray instance may have started (Ray's processes took a late-bound port)."""
    if replicas > 1:
        pytest.importorskip("ray")
    taken = free_socket()
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "conveyor", "serve", "--model", str(tmp_path / "no-such-model"),
                            "--port", str(port), "--replicas", str(replicas)],
                           capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "no-such-model" not in r.stderr, r.stderr
    assert "Ray" not in r.stdout + r.stderr


def _http_get(sock: socket.socket, path: str) -> bytes:
    """One GET on an open connection; the response's status line, or b"" if the server had closed it."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:  # closed mid-body: not a response
            return b""
        body += chunk
    return head.split(b"\r\n")[0]


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """httpx (so the openai client) reuses a connection idle for up to 5 s: the server must still
    hold it then. With uvicorn's own 5 s the two expired together, and under load a request sent
    on a connection the server was closing failed at the transport ("Server disconnected without
    sending a response"), once in a few stress runs."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert _http_get(sock, "/health") == b"HTTP/1.1 200 OK"
        time.sleep(httpx.Limits().keepalive_expiry + 1.0)
        try:
            status = _http_get(sock, "/health")
        except ConnectionError as e:
            status = repr(e).encode()
        assert status == b"HTTP/1.1 200 OK", f"an idle connection the client still counts on was closed: {status!r}"
