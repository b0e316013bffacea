"""The ingress keeps the single server's HTTP rules: any of `--api-key k1,k2`, and the headers the tenant rules
read (`--tenant-key api-key`, `header:NAME`) reach the replica that serves the request.

Fast, without a Ray cluster: the real `Ingress` app on a real socket, in front of two real replicas
(`EngineReplica`, each the whole single-process app on the tiny model) in this process; only Ray Serve's
handle is replaced by a direct call of the replica's methods, as `Ingress` makes them. The same rules over
a real Ray cluster: `test_ray_serve.py::test_every_key_and_the_tenant_header_pass_the_ingress`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conveyor.scheduler.core import Scheduler
from conveyor.server.args import ServerArgs
from conveyor.server.tenancy import TenantRule

from ..server.conftest import MODEL, free_socket, tiny_config

pytest.importorskip("ray.serve", reason="Ray Serve is not installed; pip install 'conveyor[ray]'")


class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Stream:
    """A streaming call's answer, as a Ray Serve response generator: iterate it, or `cancel()` it."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


class LocalHandle:
    """The handle calls `Ingress` makes (`stats`, `metrics`, `options(stream=True).handle`) on a replica object
    in this process."""

    def __init__(self, replica) -> None:
        self.stats = _Call(replica.stats)
        self.metrics = _Call(replica.metrics)
        self.handle = _Call(lambda *a: _Stream(replica.handle(*a)))

    def options(self, **_):
        return self


@contextlib.contextmanager
def local_ingress(tiny_llama, sargs: ServerArgs) -> Iterator[str]:
    """The ingress with two in-process replicas, served on a free port: its URL."""
    import uvicorn

    from conveyor.scaleout.ingress import Ingress
    from conveyor.scaleout.replica import EngineReplica
    from conveyor.scaleout.router import Router

    replica_cls = EngineReplica.func_or_class
    cfg = tiny_config(tiny_llama)
    sock = free_socket()
    state: dict = {}
    loop = asyncio.new_event_loop()

    async def replicas() -> list:
        out = []
        for i in range(2):
            r = replica_cls.__new__(replica_cls)
            await r.__init__(cfg, sargs, i)  # as Ray builds it: the app without keys (the ingress checks them)
            out.append(r)
        return out

    def main() -> None:
        asyncio.set_event_loop(loop)
        reps = loop.run_until_complete(replicas())
        state["replicas"] = reps
        ingress = Ingress([LocalHandle(r) for r in reps], sargs, Router(2, "least-loaded"), MODEL,
                          poll_interval_s=0.05)
        state["server"] = uvicorn.Server(uvicorn.Config(ingress.app, lifespan="on", log_level="warning"))
        loop.run_until_complete(state["server"].serve(sockets=[sock]))
        for r in reps:
            loop.run_until_complete(r.engine.stop(timeout=5.0))

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (state.get("server") is not None and state["server"].started):
        assert thread.is_alive() and time.monotonic() < deadline, "the local ingress did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while httpx.get(url + "/health", timeout=30).json().get("status") != "ok":
            time.sleep(0.05)
        yield url
    finally:
        state["server"].should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture()
def tenants(monkeypatch) -> list[str | None]:
    """The tenant of every sequence the replicas' schedulers take in."""
    seen: list[str | None] = []
    real = Scheduler.add

    def add(self, req):
        seen.append(req.tenant)
        return real(self, req)

    monkeypatch.setattr(Scheduler, "add", add)
    return seen


def post(url: str, path: str, key: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1" + path, headers={"Authorization": f"Bearer {key}", **headers}, timeout=60,
                      json={"model": MODEL, **body})


COMPLETION = {"prompt": "hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
EMBEDDING = {"input": "hello"}


def test_every_api_key_is_accepted_behind_replicas(tiny_llama):
    with local_ingress(tiny_llama, ServerArgs(api_key="k1,k2")) as url:
        for key in ("k1", "k2"):
            assert post(url, "/completions", key, COMPLETION).status_code == 200, key
        for bad in ("k1,k2", "k3", "k"):
            assert post(url, "/completions", bad, COMPLETION).status_code == 401, bad


def test_the_tenant_header_reaches_the_replicas(tiny_llama, tenants):
    with local_ingress(tiny_llama, ServerArgs(api_key="k1", tenant_key="header:X-Team")) as url:
        assert post(url, "/completions", "k1", COMPLETION, **{"X-Team": "blue"}).status_code == 200
        assert post(url, "/embeddings", "k1", EMBEDDING, **{"X-Team": "green"}).status_code == 200
        assert post(url, "/chat/completions", "k1", CHAT).status_code == 200  # no header: the default tenant
    assert tenants == ["blue", "green", None]


def test_the_api_key_tenant_reaches_the_replicas(tiny_llama, tenants):
    with local_ingress(tiny_llama, ServerArgs(api_key="k1", tenant_key="api-key")) as url:
        assert post(url, "/completions", "k1", COMPLETION).status_code == 200
        assert post(url, "/embeddings", "k1", EMBEDDING).status_code == 200
    key_tenant = TenantRule.parse("api-key").resolve(None, {"authorization": "Bearer k1"})
    assert tenants == [key_tenant, key_tenant] and key_tenant.startswith("key-"), tenants
