"""One engine replica as a Ray Serve deployment: the whole single-process server, behind a handle.

Each replica builds the same FastAPI app that `conveyor serve` runs (`build_app`), so validation,
errors in OpenAI's format, streaming, timeouts, 429s and metrics are exactly those of one server.
The ingress does not speak HTTP to it: it calls `handle` with the request's method, path, headers
and body through a Ray Serve handle, and this replica runs the request through the app in
process (`asgi_call`) and streams the response back as `{"status", "headers"}` then body chunks.
When the ingress's client goes away, Ray cancels this generator and the app sees a disconnect,
which aborts the engine request and frees its KV blocks, as it would on a direct connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

from ray import serve

from conveyor.config import EngineConfig
from conveyor.server.api_server import build_app
from conveyor.server.args import ServerArgs


async def asgi_call(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                    disconnected: asyncio.Event) -> AsyncIterator[dict | bytes]:
    """Run one HTTP request through an ASGI app in this process: yield the response head, then its body.

    The request body is delivered at once; after that `receive` blocks until `disconnected` is set
    (or this generator is closed), which the app sees as the client going away.
    """
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("ingress", 0), "server": ("replica", 0),
    }
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout=5.0)


@serve.deployment(max_ongoing_requests=100_000, health_check_period_s=2.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class EngineReplica:
    """A Ray Serve replica holding one engine and the app around it (API key checks stay in the ingress)."""

    async def __init__(self, engine_config: EngineConfig, server_args: ServerArgs, index: int) -> None:
        self.index = index
        self.app = build_app(engine_config, replace(server_args, api_key=None))
        self.engine = self.app.state.engine
        await self.engine.start()

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
                     ) -> AsyncIterator[dict | bytes]:
        """One HTTP request through this replica's app, streamed (see `asgi_call`)."""
        async for item in asgi_call(self.app, method, path, headers, body, asyncio.Event()):
            yield item

    async def stats(self) -> dict:
        """What the ingress routes and reports on: load, prefix-cache counters, where this replica lives."""
        s = self.engine.stats()
        # ok | restarting | draining | dead: the ingress routes new requests only to "ok" replicas
        state = self.engine.health()[1]["status"]
        return {"replica": self.index, "alive": self.engine.alive, "state": state, "error": self.engine.error,
                "running": s.running,
                "waiting": s.waiting, "kv_cache_usage": s.kv_usage, "prefix_cache_queries": s.prefix_queries,
                "prefix_cache_hits": s.prefix_hits, "pid": os.getpid(), "node": socket.gethostname()}

    async def metrics(self) -> str:
        """This replica's Prometheus text; the ingress adds the `replica` label and merges."""
        return self.app.state.metrics.render().decode()

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose check raises: an engine dead for good (a crash loop) means a new
        replica. An engine that restarts by itself (`AsyncEngine`) or a replica that drains is not sick: the
        ingress only stops routing to it meanwhile."""
        if self.engine.state == "dead":
            raise RuntimeError(f"the engine is dead: {self.engine.error!r}")

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await self.engine.stop(timeout=2.0)
