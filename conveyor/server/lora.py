"""Serving LoRA adapters over HTTP, as vLLM does: `--lora-modules name=path ...` at startup, the request's
`model` naming the adapter, and (behind `--allow-runtime-lora-updating` and the API key) runtime
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`.

The HTTP side owns the names: it checks an adapter directory against the base model (`LoRASpec`,
from the engine's info) before a name becomes visible, so a bad adapter is a startup error or a 400
and never reaches the engine; the engine loads an adapter's weights on its first request and keeps
the most recently used ones (`--max-cpu-loras`). Unloading removes the name at once (new requests
for it get 404); requests already running under it finish, then the engine drops its weights.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from conveyor.config import json_object
from conveyor.lora.adapter import AdapterError, LoRASpec, check_adapter
from conveyor.lora.request import LoRARequest
from conveyor.server.http import ApiError, bad_request
from conveyor.server.serving import ServingContext

RUNTIME_ENV = "CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        obj = json_object(text, f"--lora-modules {text!r}")
        name, path = obj.get("name"), obj.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {text!r}: both a name and a path are needed")
    return name, path


class LoRARegistry:
    """The adapter names this server answers to, each with the id the engine knows it by (never reused:
    unloading and loading a name again gives it a fresh id, so no stale weights or cached K/V apply)."""

    def __init__(self, serving: ServingContext, spec: LoRASpec | None) -> None:
        self.serving = serving
        self.spec = spec
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # runtime loads check in worker threads

    def _check_name(self, name: str) -> None:
        if name in self.serving.model_names or name in self.serving.loras:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at `path` and name it; AdapterError / ValueError say why not."""
        if self.spec is None:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        self._check_name(name)
        check_adapter(path, self.spec, name)
        with self._lock:
            self._check_name(name)  # a concurrent load of the same name may have won meanwhile
            req = LoRARequest(name, next(self._ids), str(path))
            self.serving.loras[name] = req
        return req

    def remove(self, name: str) -> LoRARequest | None:
        return self.serving.loras.pop(name, None)


def register_lora_modules(serving: ServingContext, spec: LoRASpec | None, modules: list[str] | None
                          ) -> LoRARegistry:
    """Name the `--lora-modules` adapters; any bad one is a ValueError (the server does not start)."""
    registry = LoRARegistry(serving, spec)
    for text in modules or ():
        name, path = parse_lora_module(text)
        registry.add(name, path)
    return registry


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true", "yes")


def add_runtime_routes(router: APIRouter, registry: LoRARegistry, read_body) -> None:
    """vLLM's runtime load/unload endpoints on `router`, which checks the API key (only mounted when allowed:
    otherwise they are 404)."""
    serving = registry.serving

    def field(data: dict, key: str, required: bool = True) -> str | None:
        value = data.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{key}' must be a non-empty string", key)
        return value

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        data = await read_body(request)
        name, path = field(data, "lora_name"), field(data, "lora_path")
        try:  # reads the weights to check them: off the event loop
            await asyncio.to_thread(registry.add, name, path)
        except (AdapterError, ValueError) as e:
            raise bad_request(str(e), "lora_path" if isinstance(e, AdapterError) else "lora_name") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        data = await read_body(request)
        name = field(data, "lora_name")
        lora = registry.remove(name)
        if lora is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name",
                           code="lora_not_found")
        serving.aengine.unload_lora(lora.lora_int_id)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
