"""The server's own flags and settings (`ServerArgs`), apart from the app so that parsing the command
line imports neither torch nor FastAPI (`conveyor serve --help` answers at once)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

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
    chat_template: str | None = None  # tools and embeddings: conveyor/server/tools.py, embeddings.py
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    pooling: str | None = None
    tenant_key: str = "user"  # user | api-key | header:NAME (conveyor/server/tenancy.py)
    metrics_max_tenants: int = 16  # tenants with their own /metrics series; the rest count as "other"
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
    g.add_argument("--tenant-key", default="user",
                   help="what names a request's tenant: user (the OpenAI 'user' field), api-key (the key it "
                        "presented; list several with --api-key k1,k2) or header:NAME; requests without one "
                        "share the default tenant (default: user)")
    g.add_argument("--metrics-max-tenants", type=int, default=16,
                   help="tenants that get series of their own in the per-tenant /metrics (the first ones seen); "
                        "later tenants are counted under tenant=\"other\" (default: 16)")
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
    from conveyor.server.tools import add_tool_args

    add_tool_args(p)
