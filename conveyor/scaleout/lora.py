"""LoRA adapters behind `serve --replicas N` (docs/lora.md).

Every replica builds the single server's app from the same `ServerArgs`, so `--lora-modules` reach each
replica as they are, a request whose `model` names an adapter runs on whichever replica the router
picks, and `/v1/models` (relayed to one replica) lists the adapters with their parent. What the
ingress adds:
- `check_lora_modules`: the flags and each adapter's directory and config are checked here, before Ray
  starts, so a bad `--lora-modules` entry stops `serve --replicas` at once with the single server's
  message instead of after N replicas failed to deploy (the replicas check the weights' shapes again);
- `add_runtime_lora_routes`: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` go to
  every replica, since any of them may get the next request for the adapter;
- `lora_affinity_key`: the prefix router keys an adapter's prompts by adapter too, because a prefix
  cached under one adapter never serves another (the KV block hash holds the adapter).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from conveyor.config import EngineConfig
from conveyor.server.api_server import ServerArgs


def check_lora_modules(cfg: EngineConfig, sargs: ServerArgs) -> None:
    """A ValueError (before any replica starts) for what every replica would refuse at startup."""
    if not sargs.lora_modules:
        return
    from conveyor.lora.adapter import LoRASpec, check_config, read_config
    from conveyor.server.lora import parse_lora_module

    if not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    spec = LoRASpec(num_layers=0, shapes={}, max_lora_rank=cfg.max_lora_rank)  # shapes: checked on the replicas
    names: set[str] = set()
    for text in sargs.lora_modules:
        name, path = parse_lora_module(text)
        if name in names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        names.add(name)
        check_config(read_config(Path(path), name), name, spec)


def lora_affinity_key(model: object, base_model: str, text: str | None) -> str | None:
    """The prefix router's text for a request: an adapter's name goes before its prompt (the base
    model's requests keep their plain text)."""
    if text is None or not isinstance(model, str) or model == base_model:
        return text
    return f"lora:{model}\x1d{text}"


def add_runtime_lora_routes(app: FastAPI, ingress) -> None:
    """Load or unload an adapter on every replica; the answer is the first replica's that failed, else
    the first one's (a refused load is refused alike everywhere: the same check on the same files)."""

    async def broadcast(request: Request) -> Response:
        ingress.check_key(request)
        body = await ingress.read_body(request)
        answers = [await ingress.relay(request, body, replica=r.index) for r in ingress.replicas]  # one at a time
        bad = [a for a in answers if a.status_code != 200]
        return bad[0] if bad else answers[0]

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        app.add_api_route(path, broadcast, methods=["POST"])

