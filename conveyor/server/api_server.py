"""`conveyor serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    conveyor serve --model smollm2-135m --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 16}'

The engine runs in its own thread (`AsyncEngine`); this module only parses, validates, routes
and formats. Errors always use OpenAI's {"error": {...}} body.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

import conveyor
from conveyor.config import EngineConfig
from conveyor.engine.engine_loop import (
    EngineClient,
    InlineEngineClient,
    ProcessEngineClient,
    Stop,
    ThreadEngineClient,
    dump_stacks_on_sigusr1,
)
from conveyor.engine.llm_engine import LLMEngine
from conveyor.server import protocol as P
from conveyor.server.async_engine import AsyncEngine
from conveyor.server.dashboard import DashboardHub, dashboard_html, dashboard_setup
from conveyor.server.lora import (
    add_runtime_routes,
    parse_lora_module,
    register_lora_modules,
    runtime_updating_allowed,
)
from conveyor.server.metrics import CONTENT_TYPE, ServerMetrics
from conveyor.server.serving import ApiError, OpenAIServing, bad_request

log = logging.getLogger("conveyor.server")

# How long an idle keep-alive connection stays open. Longer than the idle expiry of the usual clients
# (httpx, so the openai package: 5 s; Node's undici: 4 s; aiohttp: 15 s): with uvicorn's own 5 s, a
# client could send its next request on a connection the server was closing at that moment, and
# under load (a busy event loop fires the close late and reads the request later still) it got
# "Server disconnected without sending a response" for a request the server never saw.
KEEP_ALIVE_S = 20.0


@dataclass
class ServerArgs:
    """The server's own knobs (engine knobs live in `EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = 1024
    max_queued_tokens: int | None = None
    engine_loop: str = "thread"  # thread | process | inline (see conveyor/engine/engine_loop.py)
    max_request_bytes: int = 8 * 2**20
    shutdown_timeout: float = 10.0
    request_timeout: float | None = None
    log_interval: float = 10.0
    disable_log_requests: bool = False
    uvicorn_log_level: str = "info"
    timeout_keep_alive: float = KEEP_ALIVE_S
    lora_modules: list[str] | None = None  # name=path of LoRA adapters to serve (conveyor/server/lora.py)
    allow_runtime_lora_updating: bool = False  # mount /v1/load_lora_adapter and /v1/unload_lora_adapter

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the --model value)")
    g.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $CONVEYOR_API_KEY)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting sequences beyond which new requests get 429 with Retry-After (default: 1024)")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens of requests not yet started (queued or in prefill) beyond which new "
                        "requests get 429 with Retry-After; bounds what a burst of long prompts holds (default: "
                        "no limit besides --max-queued-requests)")
    g.add_argument("--engine-loop", default="thread", choices=["thread", "process", "inline"],
                   help="where the engine loop runs: a thread of the server process, its own process, or the "
                        "event loop itself (the naive design, for comparison); docs/engine-loop.md has the "
                        "measurements behind the default (default: thread)")
    g.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="larger bodies get 413")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds from arrival after which a request still running is aborted and its blocks freed: "
                        "408 request_timeout, or an error event in its stream (default: none)")
    g.add_argument("--log-interval", type=float, default=10.0, help="seconds between engine stats log lines")
    g.add_argument("--disable-log-requests", action="store_true", help="no per-request log line")
    g.add_argument("--uvicorn-log-level", default="info")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve, each as name=path or vLLM's JSON "
                        '\'{"name": ..., "path": ...}\'; a request\'s "model" picks one (needs --enable-lora)')
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true", "yes"),
                   help="mount vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; "
                        "default: $CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING)")
    g.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open; keep it above your clients' idle "
                        f"expiry (httpx and openai: 5 s) (default: {KEEP_ALIVE_S:g})")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past `limit` bytes, 400 unless it parses to an object."""
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > 16 * limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
        elif size > 16 * limit:
            break
    if size > limit:  # read (and dropped) the rest first, so the client sees this answer, not a reset
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def make_client(config: EngineConfig, where: str, engine: LLMEngine | None = None) -> EngineClient:
    """Start the engine loop `where` (thread | process | inline); `engine`: an already built engine."""
    if where == "process":
        if engine is not None:
            raise ValueError("an engine built in this process cannot run in another one")
        return ProcessEngineClient(config)
    if where == "inline":
        return InlineEngineClient(engine or LLMEngine(config))
    if where != "thread":
        raise ValueError(f"engine loop must be thread, process or inline, got {where!r}")
    # thread: the model is built in the thread that will step it (OpenMP: see engine_loop.py)
    return ThreadEngineClient(engine if engine is not None else (lambda: LLMEngine(config)))


def build_app(engine_config: EngineConfig, server_args: ServerArgs | argparse.Namespace | None = None,
              engine: LLMEngine | None = None) -> FastAPI:
    """Load the engine (unless given) and wire the routes; the engine thread starts with the app."""
    args = server_args if isinstance(server_args, ServerArgs) else (
        ServerArgs.from_namespace(server_args) if server_args is not None else ServerArgs())
    if args.lora_modules:  # what can be checked before the model loads
        if not engine_config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for text in args.lora_modules:
            parse_lora_module(text)
    client = make_client(engine_config, args.engine_loop, engine)
    info = client.info
    aengine = AsyncEngine(client, max_queued_requests=args.max_queued_requests, log_interval_s=args.log_interval,
                          max_queued_tokens=args.max_queued_tokens)
    metrics = ServerMetrics(info.model_name, aengine.stats, info)
    aengine.metrics = metrics
    serving = OpenAIServing(aengine, [info.model_name], args.request_timeout)
    try:  # a bad adapter is a startup error: stop the engine loop that is built and waiting
        loras = register_lora_modules(serving, info.lora, args.lora_modules)
    except ValueError:
        client.send(Stop())
        if not isinstance(client, InlineEngineClient):
            client.start()
            client.join(10)
        raise
    hub = DashboardHub(client, dashboard_setup(engine_config, info))
    aengine.observers.append(hub.observe)
    metrics.listeners.append(hub)
    logging.getLogger("conveyor.server.requests").disabled = args.disable_log_requests

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await aengine.start()
        yield
        hub.close()
        await aengine.stop(timeout=10.0)

    app = FastAPI(title="conveyor", version=conveyor.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine = aengine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.args = args
    app.state.dashboard = hub

    def check_key(request: Request) -> None:
        if not args.api_key:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), args.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(P.error_body(str(e.detail), "invalid_request_error", code=str(e.status_code)),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}", "internal_error",
                                         code="internal_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        return await serving.completions(await read_json(request, args.max_request_bytes), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        return await serving.chat(await read_json(request, args.max_request_bytes), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_key(request)
        return await serving.tokenize_endpoint(await read_json(request, args.max_request_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_key(request)
        return await serving.detokenize_endpoint(await read_json(request, args.max_request_bytes))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)
        cards = [P.ModelCard(id=name, root=engine_config.model, max_model_len=info.max_model_len)
                 for name in serving.model_names]
        cards += [P.ModelCard(id=name, root=lora.lora_path, parent=serving.model_names[0],
                              max_model_len=info.max_model_len) for name, lora in list(serving.loras.items())]
        return Response(P.ModelList(data=cards).model_dump_json(), media_type="application/json")

    if runtime_updating_allowed(args.allow_runtime_lora_updating):
        add_runtime_routes(app, loras, check_key, lambda request: read_json(request, args.max_request_bytes))

    @app.get("/health")
    async def health() -> Response:
        if aengine.alive:
            return JSONResponse({"status": "ok"})
        why = f"the engine is dead: {aengine.error!r}" if aengine.error else "the engine is not running"
        return JSONResponse(P.error_body(why, "service_unavailable", code="engine_dead"), status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": conveyor.__version__})

    @app.get("/dashboard")
    async def dashboard() -> Response:
        """The live view (static page; its data stream below is checked like the API)."""
        return HTMLResponse(dashboard_html())

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        check_key(request)
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, plus a clean end for in-flight requests on SIGTERM/SIGINT.

    uvicorn stops accepting and waits `timeout_graceful_shutdown` for open connections, then
    cancels them mid-body. Here requests get `grace_s` seconds to finish, then the engine aborts
    them with finish_reason "abort" (streams still end with [DONE]); uvicorn's own timeout is a
    little longer so it only ever has finished responses to wait for.
    """

    def __init__(self, app: FastAPI, grace_s: float, **config_kw) -> None:
        config_kw.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + 2.0, lifespan="on", **config_kw))
        self.aengine: AsyncEngine = app.state.engine
        self.app_state = app.state
        self.grace_s = grace_s

    async def shutdown(self, *args, **kwargs) -> None:
        self.app_state.dashboard.close()  # dashboard streams never end by themselves
        drain = asyncio.ensure_future(self.aengine.abort_all_after(self.grace_s))
        try:
            await super().shutdown(*args, **kwargs)
        finally:
            drain.cancel()


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind the server's address before the slow part of startup (loading weights, starting replicas).

    Binding late leaves the port free for the tens of seconds a model or a Ray cluster takes to come
    up, and Ray's own processes open sockets on ports the kernel picks in that window: the server
    then died at the very end with "address already in use". Binding first also makes a taken
    port fail in a second instead of after the load, and `--port 0` picks a free one. The socket is
    not inheritable, so neither the engine process nor Ray's workers hold it open after we exit."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT leftovers do not block
    try:
        sock.bind(addr)
    except OSError as e:  # a ValueError: the CLI reports it in one line, as it does a bad flag
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? pick --port)") from None
    # the real port, which `--port 0` only tells here (and scripts that start a server read it from this line)
    bound = sock.getsockname()[1]
    log.info("bound %s:%d; serving there as soon as the engine is up", host, bound)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get `--shutdown-timeout` seconds, then exit 0."""
    from conveyor.cli import engine_config_from_args

    if getattr(args, "log_level", "WARNING").upper() == "WARNING":  # the CLI default: a server logs at INFO
        logging.getLogger("conveyor").setLevel(logging.INFO)
    cfg = engine_config_from_args(args, populate_default=True, served_model_name=args.served_model_name)
    sargs = ServerArgs.from_namespace(args)
    sock = bind_listen_socket(sargs.host, sargs.port)
    app = build_app(cfg, sargs)
    server = GracefulServer(app, sargs.shutdown_timeout, host=sargs.host, port=sargs.port,
                            log_level=sargs.uvicorn_log_level, access_log=False,
                            timeout_keep_alive=sargs.timeout_keep_alive)
    # uvicorn re-raises the signal it caught once its graceful shutdown is done; with these no-op
    # handlers in place underneath its own, that re-raise is swallowed and we return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    dump_stacks_on_sigusr1()
    with sock:
        server.run(sockets=[sock])
    return 0 if server.started else 1
