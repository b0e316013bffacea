"""`conveyor serve --replicas N`: N engine replicas on Ray Serve behind one OpenAI-compatible ingress.

    conveyor serve --replicas 2 --router prefix                  # a local Ray instance on this machine
    conveyor serve --replicas 8 --ray-address auto --replica-gpus 1   # join a running cluster

Each replica is its own Ray Serve deployment (`replica.EngineReplica`, one replica each, so the
ingress can address it and Ray restarts it when its process dies). The ingress is a FastAPI app in
this process: it checks the API key, reads the body (both by the single server's rules,
`conveyor/server/http.py`), asks the `Router` for a replica (prefix affinity or least load) and relays
the request to it, with its end-to-end headers, through a Ray Serve handle, streaming the answer back
as it comes. A background task polls every replica's load and health; `/metrics`
merges the replicas' series under a `replica` label, `/health` lists each. Ray is imported only
here: the single-process server never needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

import conveyor
from conveyor.config import EngineConfig
from conveyor.scaleout.args import add_scaleout_args  # noqa: F401 - re-exported (the CLI's old import path)
from conveyor.scaleout.lora import add_runtime_lora_routes, check_lora_modules, lora_affinity_key
from conveyor.scaleout.router import Router, prefix_text
from conveyor.server import protocol as P
from conveyor.server.args import DEFAULT_ENGINE_LOOP, RETRY_AFTER_S, ServerArgs
from conveyor.server.async_engine import ServerDrainingError, ServerShutdownError
from conveyor.server.http import ApiError, ApiKeys, engine_error, forwarded_headers, read_body, wait_disconnect
from conveyor.server.launch import GracefulServer, bind_listen_socket
from conveyor.server.lora import runtime_updating_allowed
from conveyor.server.metrics import CONTENT_TYPE

log = logging.getLogger("conveyor.scaleout")

APP_PREFIX = "conveyor-replica-"


@dataclass
class ReplicaState:
    """What the ingress knows of one replica: its handle, its last report, what it has in flight from here."""

    index: int
    handle: object
    up: bool = False
    report: dict = field(default_factory=dict)
    inflight: int = 0  # sequences sent from this ingress and not finished
    served: int = 0

    @property
    def state(self) -> str:
        """ok | restarting (its engine died and a new one is loading) | draining | dead | down (not answering)."""
        if not self.up:
            return "down"
        return self.report.get("state", "ok")

    @property
    def load(self) -> float | None:
        """Sequences on the replica: the larger of its report and this ingress's own count (fresher under bursts).
        None for a replica that takes no new requests now (down, restarting, draining): the router skips it."""
        if self.state != "ok":
            return None
        return float(max(self.inflight, self.report.get("running", 0) + self.report.get("waiting", 0)))


class _MergedReplicaMetrics(Collector):
    """The replicas' last scraped families, each sample labelled with its replica."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def update(self, texts: dict[int, str]) -> None:
        merged: dict[str, Metric] = {}
        for index, text in sorted(texts.items()):
            for fam in text_string_to_metric_families(text):
                m = merged.get(fam.name)
                if m is None:
                    m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "replica": str(index)}, s.value, s.timestamp)
        self.families = list(merged.values())

    def collect(self):
        return iter(self.families)


def _is_replica_gone(e: BaseException) -> bool:
    """The replica's process died or cannot be reached (as opposed to an error raised by its code)."""
    from ray.exceptions import RayTaskError

    return not isinstance(e, RayTaskError)  # a RayTaskError wraps an exception the replica's own code raised


class Ingress:
    """Routing, relaying and the replicas' view; `app` is the FastAPI app to serve."""

    def __init__(self, handles: list, args: ServerArgs, router: Router, model_name: str,
                 poll_interval_s: float = 0.5) -> None:
        self.replicas = [ReplicaState(i, h) for i, h in enumerate(handles)]
        self.args = args
        self.router = router
        self.model_name = model_name
        self.poll_interval_s = poll_interval_s
        self.api_keys = ApiKeys(args.api_key)
        self.registry = CollectorRegistry(auto_describe=True)
        self.replica_metrics = _MergedReplicaMetrics()
        self.registry.register(self.replica_metrics)
        self.routed = Counter("conveyor:router_requests", "Requests the ingress sent to each replica, by reason.",
                              ["replica", "reason"], registry=self.registry)
        self.replica_up = Gauge("conveyor:replica_up", "1 while the replica answers the ingress's polls.",
                                ["replica"], registry=self.registry)
        self.relay_errors = Counter("conveyor:replica_errors", "Requests that ended because their replica failed.",
                                    ["replica"], registry=self.registry)
        self._ready = asyncio.Event()
        self.draining = False
        self._open: dict[int, Callable[[str], None]] = {}  # relays of engine work in flight -> how to end one
        self._relay_ids = itertools.count()
        self.app = self._build_app()
        self.app.state.drainable = self  # GracefulServer drains the ingress on SIGTERM

    # --- draining (SIGTERM: launch.GracefulServer) ----------------------------------------------------
    def drain(self) -> None:
        """Take no new requests (503 draining, `/health` 503 draining); relays in flight go on."""
        if not self.draining:
            self.draining = True
            log.info("draining: no new requests; %d in flight", len(self._open))

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def end_in_flight(self, why: str) -> int:
        """End every relay still open: its replica request is cancelled (aborted there) and the client gets
        503 server_shutdown (an error event in a stream)."""
        enders = list(self._open.values())
        if enders:
            log.warning("ending %d in-flight request(s): %s", len(enders), why)
        for end in enders:
            end(why)
        return len(enders)

    # --- replica state ------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        async def one(r: ReplicaState) -> None:
            try:
                r.report = await asyncio.wait_for(r.handle.stats.remote(), timeout=max(2.0, 4 * self.poll_interval_s))
                # a replica whose engine restarts or that drains still answers: up, but not routed to (`load`)
                r.up = r.report.get("state", "ok" if r.report.get("alive") else "dead") != "dead"
            except Exception as e:  # dead, restarting, or not yet up: not routable until it answers again
                if r.up:
                    log.warning("replica %d stopped answering: %r", r.index, e)
                r.up = False
            self.replica_up.labels(str(r.index)).set(float(r.up))

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def poll_forever(self) -> None:
        while True:
            await self.poll_once()
            self._ready.set()
            await asyncio.sleep(self.poll_interval_s)

    def loads(self) -> list[float | None]:
        return [r.load for r in self.replicas]

    # --- relaying -------------------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """The single server's key rule (`--api-key k1,k2`: any of the keys); replicas never check keys."""
        self.api_keys.check(request)

    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.args.max_request_bytes)

    async def relay(self, request: Request, body: bytes = b"", replica: int | None = None) -> Response:
        """Send the request to the replica the router picks (or to `replica`) and stream its answer back."""
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None  # the replica answers the 400
        n = data.get("n", 1) if isinstance(data, dict) else 1
        n = n if isinstance(n, int) and 0 < n <= 1024 else 1
        path = request.url.path
        if replica is None and self.draining:
            raise engine_error(ServerDrainingError("the server is shutting down and takes no new requests"))
        if replica is None:
            model = data.get("model") if isinstance(data, dict) else None
            key = lora_affinity_key(model, self.model_name, prefix_text(path, data))
            decision = self.router.pick(key, self.loads())
            if decision is None:
                raise ApiError(503, "no engine replica is available; retry shortly", "service_unavailable",
                               code="no_replica")
            r = self.replicas[decision.replica]
            self.routed.labels(str(r.index), decision.reason).inc()
            r.served += 1
        else:  # not engine work (the dashboard's stream): no routing, no load
            r, n = self.replicas[replica], 0
        headers = forwarded_headers(request.headers.items())  # the replica's rules see what the client sent
        gen = r.handle.options(stream=True).handle.remote(request.method, path, headers, body)
        r.inflight += n
        closed = False
        ended_why: str | None = None  # the drain's time ran out: why this relay was ended
        relay_id = next(self._relay_ids)

        def end(why: str) -> None:
            nonlocal ended_why
            ended_why = why
            gen.cancel()

        if n:
            self._open[relay_id] = end

        def finish() -> None:
            nonlocal closed
            if not closed:
                closed = True
                r.inflight -= n
                self._open.pop(relay_id, None)

        def shutdown_error(why: str) -> ApiError:  # the single server's answer when a drain ends a request
            return engine_error(ServerShutdownError(why))

        head_task = asyncio.ensure_future(gen.__anext__())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({head_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not head_task.done():  # the client left before the answer started: abort on the replica
            head_task.cancel()
            gen.cancel()
            finish()
            return Response(status_code=499)
        try:
            head = head_task.result()
        except StopAsyncIteration:  # an answer without a head: the replica's app misbehaved, it is not gone
            finish()
            raise ApiError(502, f"engine replica {r.index} sent no response", "internal_error",
                           code="replica_failed") from None
        except Exception as e:
            finish()
            if ended_why is not None:
                raise shutdown_error(ended_why) from None
            self._replica_failed(r, e)
            raise ApiError(503, f"engine replica {r.index} failed: {type(e).__name__}; retry", "service_unavailable",
                           code="replica_failed") from None
        out_headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        out_headers["x-conveyor-replica"] = str(r.index)  # which replica answered: for logs, tests and curious users
        streaming = out_headers.get("content-type", "").startswith("text/event-stream")

        ended = False

        async def rest() -> AsyncIterator[bytes]:
            nonlocal ended
            try:
                async for chunk in gen:
                    yield chunk
            except Exception as e:  # the replica died mid-answer (or the drain ended it): an error event and the end
                if ended_why is not None:
                    err = shutdown_error(ended_why).body()
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                    ended = True
                    return
                self._replica_failed(r, e)
                if streaming:
                    err = P.error_body(f"engine replica {r.index} failed mid-stream: {type(e).__name__}",
                                       "service_unavailable", code="replica_failed")
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            ended = True

        def close() -> None:  # runs however the response ends, even if `rest` never started
            if not ended:
                gen.cancel()  # the client left: Ray cancels the replica's generator, which aborts the request
            finish()

        if not streaming:  # one body: read it whole, so a replica failure can still become a 503
            chunks = []
            try:
                async for chunk in gen:
                    chunks.append(chunk)
            except Exception as e:
                if ended_why is not None:
                    raise shutdown_error(ended_why) from None
                self._replica_failed(r, e)
                raise ApiError(503, f"engine replica {r.index} failed: {type(e).__name__}; retry",
                               "service_unavailable", code="replica_failed") from None
            finally:
                finish()
            return Response(b"".join(chunks), status_code=head["status"], headers=out_headers)
        return _RelayResponse(rest(), close, status_code=head["status"], headers=out_headers)

    def _replica_failed(self, r: ReplicaState, e: BaseException) -> None:
        self.relay_errors.labels(str(r.index)).inc()
        if _is_replica_gone(e):
            log.warning("replica %d failed a request: %r; not routing to it until it answers again", r.index, e)
            r.up = False
        else:
            log.error("replica %d raised: %r", r.index, e)

    # --- the app ------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            poller = asyncio.create_task(self.poll_forever())
            yield
            poller.cancel()

        app = FastAPI(title="conveyor (replicas)", version=conveyor.__version__, lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)
        app.state.ingress = self

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

        async def post(request: Request) -> Response:
            self.check_key(request)
            return await self.relay(request, await self.read_body(request))

        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
            app.add_api_route(path, post, methods=["POST"])
        if runtime_updating_allowed(self.args.allow_runtime_lora_updating):
            add_runtime_lora_routes(app, self)  # on every replica

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            self.check_key(request)
            return await self.relay(request)

        @app.get("/dashboard")
        async def dashboard() -> Response:
            """One replica's live view (`?replica=i`, default 0): the single server's page, relayed."""
            from conveyor.server.dashboard import dashboard_html

            return HTMLResponse(dashboard_html())

        @app.get("/dashboard/events")
        async def dashboard_events(request: Request, replica: int = 0) -> Response:
            self.check_key(request)
            if not 0 <= replica < len(self.replicas):
                raise ApiError(400, f"replica must be in [0, {len(self.replicas)}), got {replica}", param="replica")
            return await self.relay(request, replica=replica)

        @app.get("/health")
        async def health() -> Response:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=30)
            except asyncio.TimeoutError:
                return JSONResponse(P.error_body("the replicas have not answered yet", "service_unavailable",
                                                 code="starting"), status_code=503)
            reps = [{"replica": r.index, "status": r.state, "served_from_here": r.served,
                     **{k: r.report.get(k) for k in ("pid", "node", "running", "waiting", "kv_cache_usage", "error")}}
                    for r in self.replicas]
            if self.draining:
                return JSONResponse({"status": "draining", "in_flight": self.in_flight, "replicas": reps},
                                    status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
            routable = sum(r.state == "ok" for r in self.replicas)
            status = "ok" if routable == len(self.replicas) else ("degraded" if routable else "down")
            return JSONResponse({"status": status, "router": self.router.policy, "replicas": reps},
                                status_code=200 if routable else 503)

        @app.get("/version")
        async def version() -> Response:
            return JSONResponse({"version": conveyor.__version__})

        @app.get("/metrics")
        async def metrics() -> Response:
            async def one(r: ReplicaState) -> tuple[int, str | None]:
                try:
                    return r.index, await asyncio.wait_for(r.handle.metrics.remote(), timeout=5.0)
                except Exception:
                    return r.index, None

            texts = await asyncio.gather(*(one(r) for r in self.replicas))
            self.replica_metrics.update({i: t for i, t in texts if t is not None})
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

        return app


class _RelayResponse(StreamingResponse):
    """A relayed stream that always runs `on_close`, even when Starlette cancels it before it started."""

    def __init__(self, content: AsyncIterator[bytes], on_close, **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def replica_engine_config(cfg: EngineConfig, index: int, replicas: int) -> EngineConfig:
    """Replica `index`'s engine options: everyone's, except that a disk tier (--kv-disk-dir) gets a subdirectory
    per replica and an equal share of --kv-disk-gib. Replicas never share one tier directory: each keeps its
    own index and LRU of the files under its own cap, and a tier's directory lock would leave every replica
    but the first without a tier. A replica that Ray restarts has the same index, so it finds its own tier."""
    if not cfg.kv_disk_dir:
        return cfg
    return dataclasses.replace(cfg, kv_disk_dir=os.path.join(cfg.kv_disk_dir, f"replica-{index}"),
                               kv_disk_gib=cfg.kv_disk_gib / replicas)


def _replica_options(args: argparse.Namespace) -> dict:
    gpus = args.replica_gpus
    if gpus is None:
        import torch

        gpus = 1.0 if args.device != "cpu" and torch.cuda.is_available() else 0.0
    return {"num_cpus": args.replica_cpus, "num_gpus": gpus}


def run_replicated_server(args: argparse.Namespace) -> int:
    """Deploy `--replicas` engines on Ray Serve, serve the ingress here until SIGTERM/SIGINT, then clean up."""
    try:
        import ray
        from ray import serve
        from ray.serve.api import RunTarget
    except ImportError:
        raise ValueError("--replicas > 1 needs Ray Serve: pip install 'conveyor[ray]'") from None
    from conveyor.engine.args import engine_config_from_args
    from conveyor.scaleout.replica import EngineReplica

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.engine_loop not in ("thread", DEFAULT_ENGINE_LOOP):
        raise ValueError("with --replicas each replica runs its engine loop in a thread (--engine-loop thread)")
    args.engine_loop = "thread"  # each replica is a process of its own already
    if getattr(args, "log_level", "WARNING").upper() == "WARNING":
        logging.getLogger("conveyor").setLevel(logging.INFO)
    # replicas on one node size their pools from the same free memory at once: committing them all at
    # startup could turn that overcommit into an OOM, so they stay lazy unless asked
    cfg = engine_config_from_args(args, served_model_name=args.served_model_name)
    if cfg.threads is None and args.device != "cuda":
        cfg.threads = max(1, int(args.replica_cpus))
    sargs = ServerArgs.from_namespace(args)
    check_lora_modules(cfg, sargs)  # before Ray: a bad adapter stops here, not in N replicas
    router = Router(args.replicas, args.router or "prefix", imbalance=args.router_imbalance)
    sock = bind_listen_socket(sargs.host, sargs.port)  # before Ray: its processes take ports as they start

    address = args.ray_address or "local"  # "local": a new instance, even where RAY_ADDRESS names a cluster
    started_ray = address == "local"
    if started_ray:  # Ray runs its workers at nice 15 by default: an engine replica is not background work
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=True)
    serve.start(proxy_location="Disabled")
    prefix = f"{APP_PREFIX}{uuid.uuid4().hex[:6]}-"  # two ingresses on one cluster must not replace each other's
    names = [f"{prefix}{i}" for i in range(args.replicas)]
    t0 = time.monotonic()
    try:
        options = _replica_options(args)
        serve.run_many([RunTarget(EngineReplica.options(name="engine", ray_actor_options=options).bind(
                                      replica_engine_config(cfg, i, args.replicas), sargs, i),
                                  name=name, route_prefix=None, logging_config={"enable_access_log": False})
                        for i, name in enumerate(names)])
        log.info("%d replicas up in %.1fs (%s each)", args.replicas, time.monotonic() - t0, options)
        handles = [serve.get_app_handle(name) for name in names]
        ingress = Ingress(handles, sargs, router, cfg.served_model_name or cfg.model)
        # SIGTERM or a first Ctrl-C drains the ingress (503 draining, relays in flight get --shutdown-timeout)
        server = GracefulServer(ingress.app, sargs.shutdown_timeout, host=sargs.host, port=sargs.port,
                                log_level=sargs.uvicorn_log_level, access_log=False,
                                timeout_keep_alive=sargs.timeout_keep_alive)
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it handled: swallowed here
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
        if server.forced:
            return 130
        return 0 if server.started else 1
    finally:
        sock.close()
        if started_ray:  # our own local cluster: stopping Ray stops every replica with it
            ray.shutdown()
        else:  # a shared cluster: remove our applications, leave the rest alone
            for name in names:
                with contextlib.suppress(Exception):
                    serve.delete(name, _blocking=False)
