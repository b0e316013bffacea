"""Real servers on free loopback ports, running the tiny random Llama.

The shared server runs uvicorn in a thread of the test process: it is a real HTTP server on a
real socket (the tests speak to it with the official `openai` client), and the test can still
reach `app.state` to inject faults. The SIGTERM test starts `python -m conveyor serve` as a
subprocess instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.config import EngineConfig
from conveyor.server.api_server import ServerArgs, build_app
from conveyor.server.launch import GracefulServer

API_KEY = "test-key"
MODEL = "tiny"
NUM_KV_BLOCKS = 160
MAX_MODEL_LEN = 512


@dataclass
class Server:
    url: str
    app: object
    server: GracefulServer
    thread: threading.Thread
    api_key: str | None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def scrape(self) -> dict[str, float]:
        """/metrics as {name or name{label=value}: value} (label sets summed under the bare name too)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
                for k, v in s.labels.items():
                    if k != "model_name":
                        key = f"{s.name}{{{k}={v}}}"
                        out[key] = out.get(key, 0.0) + s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until nothing runs or waits and no KV block is referenced; return that scrape.

        It returns as soon as the server is idle, so the generous default costs a passing test nothing
        and only gives a busy machine time to finish; a server still busy after it fails here, saying
        so, rather than in whatever assertion the caller makes next."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.scrape()
            gauges = {k: m[k] for k in ("conveyor:num_requests_running", "conveyor:num_requests_waiting",
                                        "conveyor:kv_cache_blocks_used")}
            if not any(gauges.values()):
                return m
            assert time.monotonic() < deadline, f"the server is not idle after {timeout:.0f} s: {gauges}"
            time.sleep(0.02)


def popen_server(cmd: list[str], **kw) -> subprocess.Popen:
    """Start a server process whose output goes to a temporary file, read with `server_output`.

    Not a pipe: nobody reads a pipe while the test runs, and once its 64 KiB buffer is full (log
    lines, a slow machine) the server blocks on its next write and the test times out."""
    log_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, **kw)
    proc.log_file = log_file
    return proc


def server_output(proc: subprocess.Popen) -> str:
    """Everything the server has written so far.

    With `pread`, not seek-and-read: the server writes through the same open file, so moving its
    offset back to 0 while it runs would make its next line overwrite the start of the log."""
    fd = proc.log_file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


_BOUND = re.compile(r"bound \S+:(\d+); serving there")


def bound_url(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The address of a server started with `--port 0`, read from the line it logs once bound.

    The port is the kernel's pick at the server's own bind, so no other process can take it in
    between, as Ray's did to a port a test had chosen, closed and handed to a server that bound it
    a few seconds later ("address already in use" after the replicas were up)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _BOUND.search(server_output(proc))
        if m:
            return f"http://127.0.0.1:{m.group(1)}"
        assert proc.poll() is None, server_output(proc)[-5000:]
        assert time.monotonic() < deadline, "the server did not bind:\n" + server_output(proc)[-5000:]
        time.sleep(0.05)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def tiny_config(model_dir, **overrides) -> EngineConfig:
    kw = dict(model=str(model_dir), served_model_name=MODEL, dtype="float32", device="cpu",
              num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
              max_num_batched_tokens=1024)
    kw.update(overrides)
    return EngineConfig(**kw)


@contextlib.contextmanager
def run_server(config: EngineConfig, args: ServerArgs | None = None) -> Iterator[Server]:
    """A real server in this process, its engine loop in a thread whatever the default loop is: the tests
    that use it reach into the engine (`app.state.engine.client.engine`) to slow or break its steps. Its
    Responses store is a temporary directory, never the user's own (~/.local/share/conveyor/responses)."""
    args = dataclasses.replace(args or ServerArgs(), engine_loop="thread")
    if args.responses_dir is None:
        args = dataclasses.replace(args, responses_dir=tempfile.mkdtemp(prefix="conveyor-responses-"))
    batch_tmp = None
    if args.batch_dir is None:  # a test server never opens the user's own batch store (~/.local/share)
        batch_tmp = tempfile.TemporaryDirectory(prefix="conveyor-batches-")
        args = dataclasses.replace(args, batch_dir=batch_tmp.name)
    app = build_app(config, args)
    sock = free_socket()
    port = sock.getsockname()[1]
    uv = GracefulServer(app, grace_s=1.0, log_level="warning")
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{port}", app, uv, thread, args.api_key)
    finally:
        uv.should_exit = True
        thread.join(15)
        sock.close()
        if batch_tmp is not None:
            batch_tmp.cleanup()


@contextlib.contextmanager
def slowed_steps(srv: Server, seconds: float = 0.02) -> Iterator[None]:
    """Every engine step of `srv` takes at least `seconds` inside the block, so that a 480-token request
    lasts ~10 s on any machine: a test that must see a request while it runs (cut it, time it out,
    kill the engine under it) then cannot depend on how fast this machine is."""
    engine = srv.app.state.engine.client.engine
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step
    try:
        yield
    finally:
        if engine.__dict__.get("step") is step:
            del engine.step  # back to the class's method


@pytest.fixture(scope="session")
def server(tiny_llama) -> Iterator[Server]:
    """The shared server: tiny model, 160 KV blocks, an API key, a generous queue."""
    with run_server(tiny_config(tiny_llama), ServerArgs(api_key=API_KEY, max_queued_requests=256,
                                                        log_interval=1.0)) as s:
        yield s


@pytest.fixture()
def client(server):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c
