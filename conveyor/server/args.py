"""The server's own flags and settings (`ServerArgs`), apart from the app so that parsing the command
line imports neither torch nor FastAPI (`conveyor serve --help` answers at once).

Each setting is declared once, as a `ServerArgs` field whose metadata (`flag(...)`) says how it appears
on the command line: `add_server_args` generates the flags from the fields, with the fields' defaults,
and `ServerArgs.from_namespace` reads them back.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from conveyor.config import EngineConfig

# How long an idle keep-alive connection stays open. Longer than the idle expiry of the usual clients
# (httpx, so the openai package: 5 s; Node's undici: 4 s; aiohttp: 15 s): with uvicorn's own 5 s, a
# client could send its next request on a connection the server was closing at that moment, and
# under load (a busy event loop fires the close late and reads the request later still) it got
# "Server disconnected without sending a response" for a request the server never saw.
KEEP_ALIVE_S = 20.0

ENGINE_LOOPS = ("thread", "process", "inline")  # conveyor/engine/clients.py
DEFAULT_ENGINE_LOOP = "thread"  # docs/engine-loop.md has the measurements behind it; the one place to change it
RETRY_AFTER_S = 1  # what a server that is loading, restarting its engine or draining tells clients to wait
SERVER_GROUPS = {"server": "server", "tools": "tools and templates", "embeddings": "embeddings",  # --help order
                 "responses": "the Responses API's store", "batch": "Batch API (/v1/files, /v1/batches)"}


def flag(default: Any, help: str | Callable[[], str] = "", group: str = "server", env: str | None = None,
         **argparse_kw: Any) -> Any:
    """A `ServerArgs` field with its command-line flag: `help` (text, or a function that builds it when the
    parser is built), its --help `group`, an environment variable `env` that overrides the default on the
    command line, and any other `add_argument` keywords (type, choices, action, nargs, metavar)."""
    return field(default=default, metadata={"help": help, "group": group, "env": env, "argparse": argparse_kw})


def _env_value(name: str, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.lower() in ("1", "true", "yes") if isinstance(default, bool) else raw


def _chat_template_help() -> str:
    from conveyor.server.tools import builtin_templates

    return ("a Jinja chat template to use instead of the tokenizer's: a file, Jinja text, or a shipped "
            f"one by name ({', '.join(builtin_templates())}: SmolLM2 with tools, Hermes format)")


def _tool_parser_help() -> str:
    from conveyor.server.tool_parsers import TOOL_PARSERS

    return f"how tool calls are read from model text for \"auto\": {', '.join(sorted(TOOL_PARSERS))}"


def _pooling_choices() -> tuple[str, ...]:
    from conveyor.pooling import POOLING_METHODS

    return POOLING_METHODS


@dataclass
class ServerArgs:
    """The server's own knobs (engine knobs live in `EngineConfig`), each declared once with its flag."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "port to listen on (0: any free port, written to the log)", type=int)
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on /v1 (default: $CONVEYOR_API_KEY)",
                               env="CONVEYOR_API_KEY")
    max_queued_requests: int | None = flag(
        1024, "waiting sequences beyond which new requests get 429 with Retry-After", type=int)
    max_queued_tokens: int | None = flag(
        None, "prompt tokens of requests not yet started (queued or in prefill) beyond which new requests get 429 "
        "with Retry-After; bounds what a burst of long prompts holds (default: no limit besides "
        "--max-queued-requests)", type=int)
    engine_loop: str = flag(
        DEFAULT_ENGINE_LOOP, "where the engine loop runs: a thread of the server process, its own process, or the "
        "event loop itself (the naive design, for comparison); docs/engine-loop.md has the measurements behind the "
        "choice, docs/reliability.md what each survives (a process can be killed and restarted; in a thread, only "
        "a step that raises can)", choices=ENGINE_LOOPS)
    max_request_bytes: int = flag(8 * 2**20, "larger bodies get 413", type=int)
    shutdown_timeout: float = flag(
        10.0, "on SIGTERM or a first Ctrl-C, seconds in-flight requests get to finish while new ones get 503 "
        "draining; then what is left ends with an error and the server exits 0 (a second Ctrl-C exits at once)",
        type=float)
    max_engine_restarts: int = flag(
        5, "when the engine dies (its process killed or crashed, a step raised) the server fails the requests that "
        "were running, keeps the waiting ones and starts a new engine; more than this many engine deaths within "
        "--engine-restart-window seconds is a crash loop: the server exits 1 for its supervisor to act (0: exit on "
        "the first death)", type=int)
    engine_restart_window: float = flag(
        600.0, "the window, in seconds, over which --max-engine-restarts counts engine deaths", type=float)
    request_timeout: float | None = flag(
        None, "seconds from arrival after which a request still running is aborted and its blocks freed: 408 "
        "request_timeout, or an error event in its stream (default: none)", type=float)
    log_interval: float = flag(10.0, "seconds between engine stats log lines", type=float)
    disable_log_requests: bool = flag(False, "no per-request log line", action="store_true")
    uvicorn_log_level: str = flag("info", "uvicorn's own log level")
    tenant_key: str = flag(
        "user", "what names a request's tenant: user (the OpenAI 'user' field), api-key (the key it presented; "
        "list several with --api-key k1,k2) or header:NAME; requests without one share the default tenant "
        "(conveyor/server/tenancy.py)")
    metrics_max_tenants: int = flag(
        16, "tenants that get series of their own in the per-tenant /metrics (the first ones seen); later "
        "tenants are counted under tenant=\"other\"", type=int)
    lora_modules: list[str] | None = flag(
        None, "LoRA adapters (PEFT directories) to serve, each as name=path or vLLM's JSON "
        '\'{"name": ..., "path": ...}\'; a request\'s "model" picks one (needs --enable-lora)',
        nargs="+", metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = flag(
        False, "mount vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; default: "
        "$CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING)", env="CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING", action="store_true")
    timeout_keep_alive: float = flag(
        KEEP_ALIVE_S, "seconds an idle keep-alive connection stays open; keep it above your clients' idle expiry "
        "(httpx and openai: 5 s)", type=float)
    # tools and embeddings: conveyor/server/tools.py, embeddings.py
    chat_template: str | None = flag(None, _chat_template_help, "tools")
    enable_auto_tool_choice: bool = flag(
        False, 'serve tool_choice="auto": the model\'s text is read for tool calls by --tool-call-parser', "tools",
        action="store_true")
    tool_call_parser: str | None = flag(None, _tool_parser_help, "tools")
    pooling: str | None = flag(
        None, "/v1/embeddings pooling over the last hidden states (default: the model's sentence-transformers "
        "pooling config if it has one, else the last token)", "embeddings", choices=_pooling_choices)
    # /v1/responses: conveyor/server/responses_store.py
    responses_dir: str | None = flag(
        None, "directory of the SQLite database that keeps /v1/responses answers for previous_response_id and "
        "GET /v1/responses/{id}; several servers may share it (default: $CONVEYOR_RESPONSES_DIR, else "
        "$XDG_DATA_HOME/conveyor/responses, else ~/.local/share/conveyor/responses)", "responses",
        env="CONVEYOR_RESPONSES_DIR")
    responses_max_stored: int = flag(
        10000, "stored responses kept, the oldest dropped first (0: store none; previous_response_id then finds "
        "nothing)", "responses", type=int)
    responses_max_age_days: float = flag(30.0, "days a stored response is kept", "responses", type=float)

    # the Batch API: conveyor/server/batch/
    batch_dir: str | None = flag(
        None, "where batch files, jobs and each line's result are kept (SQLite and a files folder); a restarted "
        "server resumes the unfinished batches of its model it finds there (default: the user's data directory, "
        "~/.local/share/conveyor/batches on Linux)", "batch")
    batch_max_file_bytes: int = flag(200 * 2**20, "largest batch file an upload may bring (413 past it)", "batch",
                                     type=int)
    batch_max_lines: int = flag(50_000, "most requests (lines) in one batch file (400 past it)", "batch", type=int)
    batch_max_disk_bytes: int = flag(
        10 * 2**30, "most bytes --batch-dir may hold, inputs, results and outputs together; an upload that would go "
        "past it gets 413", "batch", type=int)
    batch_max_inflight: int | None = flag(
        None, "batch lines handed to the engine at once, across all batches (default: 2 x --max-num-seqs): enough "
        "to fill every seat interactive work leaves, few enough that a cancel is prompt", "batch", type=int)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def add_server_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s own flags, one per `ServerArgs` field, plus `--served-model-name` (an `EngineConfig` field
    that only a server has a use for)."""
    groups = {key: p.add_argument_group(title) for key, title in SERVER_GROUPS.items()}
    groups["server"].add_argument("--served-model-name", default=EngineConfig.served_model_name,
                                  help="the model name clients send and see (default: the --model value)")
    for f in fields(ServerArgs):
        meta = f.metadata
        kw = dict(meta["argparse"])
        if callable(kw.get("choices")):
            kw["choices"] = list(kw["choices"]())
        text = meta["help"]() if callable(meta["help"]) else meta["help"]
        default = _env_value(meta["env"], f.default) if meta["env"] else f.default
        groups[meta["group"]].add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=default,
                                           help=text or None, **kw)
