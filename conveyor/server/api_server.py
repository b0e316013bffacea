"""`conveyor serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    conveyor serve --model smollm2-135m --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 16}'

The engine runs in its own thread (`AsyncEngine`); this module only wires the routes: each endpoint
is its own module over the shared serving base (`serving.py`), the HTTP rules (keys, bodies, errors)
come from `http.py`, and starting and stopping the process is `launch.py`'s. Errors always use
OpenAI's {"error": {...}} body.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import APIRouter, Depends, FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

import conveyor
from conveyor.config import EngineConfig
from conveyor.engine.clients import EngineClient, InlineEngineClient, ProcessEngineClient, ThreadEngineClient
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.messages import Stop
from conveyor.pooling import default_pooling
from conveyor.server import protocol as P
from conveyor.server.admin import install_admin_routes
from conveyor.server.args import KEEP_ALIVE_S, RETRY_AFTER_S, ServerArgs, add_server_args
from conveyor.server.async_engine import AsyncEngine
from conveyor.server.batch.api import BatchService
from conveyor.server.chat import OpenAIServingChat
from conveyor.server.completions import OpenAIServingCompletion
from conveyor.server.dashboard import DashboardHub, dashboard_html, dashboard_setup
from conveyor.server.embeddings import OpenAIServingEmbedding
from conveyor.server.http import ApiError, ApiKeys, read_json
from conveyor.server.lora import (
    add_runtime_routes,
    parse_lora_module,
    register_lora_modules,
    runtime_updating_allowed,
)
from conveyor.server.metrics import CONTENT_TYPE, ServerMetrics
from conveyor.server.responses import OpenAIServingResponses, install_responses_routes
from conveyor.server.responses_store import ResponseStore
from conveyor.server.serving import ServingContext, ServingOptions
from conveyor.server.tenancy import TenantRule
from conveyor.server.tokenization import OpenAIServingTokenization
from conveyor.server.tools import check_tool_args, load_chat_template

__all__ = ["KEEP_ALIVE_S", "ServerArgs", "add_server_args", "build_app", "make_client", "Endpoints"]

log = logging.getLogger("conveyor.server")


@dataclass
class Endpoints:
    """The server's endpoints over their one shared context (`app.state.serving`)."""

    ctx: ServingContext
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding
    tokenization: OpenAIServingTokenization
    responses: OpenAIServingResponses

    @classmethod
    def create(cls, ctx: ServingContext, store: ResponseStore | None = None, keyed: bool = False) -> Endpoints:
        """`store`: where /v1/responses keeps answers (default: the user's data directory, opened on first
        use); `keyed`: the server checks API keys (a stored response then belongs to the key that made it)."""
        chat = OpenAIServingChat(ctx)
        return cls(ctx, OpenAIServingCompletion(ctx), chat, OpenAIServingEmbedding(ctx),
                   OpenAIServingTokenization(ctx),
                   OpenAIServingResponses(chat, store if store is not None else ResponseStore(None), keyed))

    @property
    def tokenizer(self):
        """The endpoints' (private) tokenizer."""
        return self.ctx.tokenizer


def make_client(config: EngineConfig, where: str, engine: LLMEngine | None = None,
                tokenizer: object | None = None) -> EngineClient:
    """Start the engine loop `where` (thread | process | inline); `engine`: an already built engine;
    `tokenizer`: the HTTP side's, already loaded (a process client would load its own)."""
    if where == "process":
        if engine is not None:
            raise ValueError("an engine built in this process cannot run in another one")
        return ProcessEngineClient(config, tokenizer=tokenizer)
    if where == "inline":
        return InlineEngineClient(engine or LLMEngine(config))
    if where != "thread":
        raise ValueError(f"engine loop must be thread, process or inline, got {where!r}")
    # thread: the model is built in the thread that will step it (OpenMP: see engine/clients.py)
    return ThreadEngineClient(engine if engine is not None else (lambda: LLMEngine(config)))


def respawner(config: EngineConfig, args: ServerArgs, first: EngineClient):
    """How the server starts a new engine after the engine died: the same configuration, with `overrides`
    (the batching strategy switched live), in the same kind of loop; None for `--engine-loop inline`
    (an engine stepped on the event loop is not restarted). Holds nothing of `first` but its tokenizer: a
    reference to the first engine would keep its memory after it died."""
    if args.engine_loop == "inline":
        return None
    tokenizer, where = first.tokenizer, args.engine_loop

    def respawn(overrides: dict) -> EngineClient:
        return make_client(replace(config, **overrides), where, tokenizer=tokenizer)

    return respawn


def build_app(engine_config: EngineConfig, server_args: ServerArgs | argparse.Namespace | None = None,
              engine: LLMEngine | None = None) -> FastAPI:
    """Load the engine (unless given) and wire the routes; the engine thread starts with the app."""
    args = server_args if isinstance(server_args, ServerArgs) else (
        ServerArgs.from_namespace(server_args) if server_args is not None else ServerArgs())
    # tool and template flags fail here, before the model loads
    tool_parser = check_tool_args(args.enable_auto_tool_choice, args.tool_call_parser)
    chat_template = load_chat_template(args.chat_template)
    if args.lora_modules:  # what can be checked before the model loads
        if not engine_config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for text in args.lora_modules:
            parse_lora_module(text)
    client = make_client(engine_config, args.engine_loop, engine)
    info = client.info
    aengine = AsyncEngine(client, max_queued_requests=args.max_queued_requests, log_interval_s=args.log_interval,
                          max_queued_tokens=args.max_queued_tokens, respawn=respawner(engine_config, args, client),
                          max_restarts=args.max_engine_restarts, restart_window_s=args.engine_restart_window)
    metrics = ServerMetrics(info.model_name, aengine.stats, info, max_tenants=args.metrics_max_tenants,
                            config=engine_config)
    aengine.metrics = metrics
    options = ServingOptions(request_timeout=args.request_timeout, chat_template=chat_template, tool_parser=tool_parser,
                             pooling=args.pooling or default_pooling(engine_config.model),
                             tenant_rule=TenantRule.parse(args.tenant_key))
    store = ResponseStore(args.responses_dir, args.responses_max_stored, args.responses_max_age_days * 86400.0)
    serving = Endpoints.create(ServingContext(aengine, [info.model_name], options), store, bool(args.api_key))
    ctx = serving.ctx
    try:  # a bad adapter is a startup error: stop the engine loop that is built and waiting
        loras = register_lora_modules(ctx, info.lora, args.lora_modules)
    except ValueError:
        client.send(Stop())
        if not isinstance(client, InlineEngineClient):
            client.start()
            client.join(10)
        raise
    batch = BatchService(ctx, args.batch_dir, args.batch_max_file_bytes, args.batch_max_lines,
                         args.batch_max_disk_bytes, args.batch_max_inflight or 2 * engine_config.max_num_seqs,
                         registry=metrics.registry)
    hub = DashboardHub(aengine, dashboard_setup(engine_config, info))
    hub.sources["batch"] = batch.dashboard_view
    aengine.observers.append(hub.observe)
    metrics.listeners.append(hub)
    logging.getLogger("conveyor.server.requests").disabled = args.disable_log_requests

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await aengine.start()
        await batch.start()
        yield
        await batch.stop()
        hub.close()
        await aengine.stop(timeout=10.0)
        store.close()

    app = FastAPI(title="conveyor", version=conveyor.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine = aengine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.args = args
    app.state.dashboard = hub
    app.state.batch = batch

    # every route that needs the API key lives on this router: the check is said once, as its dependency
    keyed = APIRouter(dependencies=[Depends(ApiKeys(args.api_key).check)])

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

    @keyed.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions.create(await read_json(request, args.max_request_bytes), request)

    @keyed.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat.create(await read_json(request, args.max_request_bytes), request)

    @keyed.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serving.embeddings.create(await read_json(request, args.max_request_bytes), request)

    install_responses_routes(keyed, serving.responses, lambda request: read_json(request, args.max_request_bytes))

    @keyed.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving.tokenization.tokenize_endpoint(await read_json(request, args.max_request_bytes))

    @keyed.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving.tokenization.detokenize_endpoint(await read_json(request, args.max_request_bytes))

    @keyed.get("/v1/models")
    async def models(request: Request) -> Response:
        cards = [P.ModelCard(id=name, root=engine_config.model, max_model_len=info.max_model_len)
                 for name in ctx.model_names]
        cards += [P.ModelCard(id=name, root=lora.lora_path, parent=ctx.model_names[0],
                              max_model_len=info.max_model_len) for name, lora in list(ctx.loras.items())]
        return Response(P.ModelList(data=cards).model_dump_json(), media_type="application/json")

    if runtime_updating_allowed(args.allow_runtime_lora_updating):
        add_runtime_routes(keyed, loras, lambda request: read_json(request, args.max_request_bytes))

    @app.get("/health")
    async def health() -> Response:
        status, body = aengine.health()  # ok; restarting (with its phase) or draining, with Retry-After; dead
        retry = status == 503 and body["status"] in ("restarting", "draining")
        return JSONResponse(body, status_code=status, headers={"Retry-After": str(RETRY_AFTER_S)} if retry else None)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": conveyor.__version__})

    @app.get("/dashboard")
    async def dashboard() -> Response:
        """The live view (static page; its data stream below is checked like the API)."""
        return HTMLResponse(dashboard_html())

    @keyed.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    install_admin_routes(keyed, aengine, lambda request: read_json(request, args.max_request_bytes))
    batch.install(keyed, args.max_request_bytes)
    app.include_router(keyed)

    return app


