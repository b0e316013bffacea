"""The lab's LoRA load: one workload spread over N adapters of the base model (docs/lora.md).

    conveyor bench run --in-process --model M --enable-lora --max-loras 4 --max-cpu-loras 16 \\
        --lora-modules a=/adapters/a b=/adapters/b ... --lora-spread 16 --concurrency 64
    conveyor bench run --url http://127.0.0.1:8000 --lora-spread 16      # a server started with --lora-modules

Request i runs under adapter `i % N`, so every adapter gets the same share of the load whatever the
workload, and the same seed gives the same requests for any N (only their adapter differs): runs with
1, 4 and 16 adapters, or none, compare batching over adapters, not different prompts. In-process the
adapters are loaded before the clock starts (a load from disk is not what the run measures); over
HTTP the request's `model` names the adapter, as a client of vLLM's server does.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from conveyor.bench.result import RunResult
from conveyor.bench.workloads import BenchRequest
from conveyor.lora.request import LoRARequest

log = logging.getLogger("conveyor.bench")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to spread the load over: name=path (in-process: loaded here, needs "
                        "--enable-lora) or, against --url, the names the server serves (name or name=path)")
    g.add_argument("--lora-spread", type=int, default=None, metavar="N",
                   help="spread the requests over the first N adapters, request i under adapter i %% N "
                        "(default: all of --lora-modules; 0: the base model only). Over HTTP without "
                        "--lora-modules the adapters come from the server's /v1/models")


def parse_modules(texts: list[str] | None, need_paths: bool) -> list[tuple[str, str | None]]:
    """`name=path` (or vLLM's JSON form) entries as (name, path); a bare name (HTTP only) has no path."""
    out: list[tuple[str, str | None]] = []
    for text in texts or ():
        if "=" not in text and not text.lstrip().startswith("{"):
            if need_paths:
                raise ValueError(f"--lora-modules {text!r}: in-process runs need name=path")
            out.append((text, None))
            continue
        from conveyor.server.lora import parse_lora_module

        out.append(parse_lora_module(text))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be distinct, got {names}")
    return out


def choose(modules: list[tuple[str, str | None]], spread: int | None) -> list[tuple[str, str | None]]:
    """The adapters the load goes to: the first `spread` of `modules` (all when None)."""
    n = len(modules) if spread is None else spread
    if n < 0:
        raise ValueError(f"--lora-spread must be >= 0, got {n}")
    if n > len(modules):
        raise ValueError(f"--lora-spread {n} needs at least {n} adapters, got {len(modules)}")
    return modules[:n]


def spread(requests: list[BenchRequest], names: list[str]) -> list[BenchRequest]:
    """Request i under adapter `names[i % N]` (no names: unchanged, the base model)."""
    if not names:
        return requests
    return [dataclasses.replace(r, lora=names[i % len(names)]) for i, r in enumerate(requests)]


def lora_requests(modules: list[tuple[str, str | None]]) -> dict[str, LoRARequest]:
    """In-process: each adapter's `LoRARequest` (ids 1..N in the given order)."""
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules)}


def preload(engine, loras: dict[str, LoRARequest]) -> None:
    """Load every adapter before the run (a bad one fails here, with its reason), and say when
    `--max-cpu-loras` is too small to keep them all: the run would then reload them from disk."""
    if not engine.config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for lora in loras.values():
        engine.load_lora(lora)
    keep = engine.config.max_cpu_loras or engine.config.max_loras  # as the engine's LoRA manager keeps
    if len(loras) > keep:
        log.warning("%d adapters but --max-cpu-loras %d: adapters no request holds are dropped and loaded "
                    "again from disk during the run", len(loras), keep)


def http_adapters(url: str, api_key: str | None) -> list[tuple[str, str | None]]:
    """The adapters a server serves: the /v1/models cards that have a parent (vLLM's form)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return [(m["id"], m.get("root")) for m in resp.json()["data"] if m.get("parent")]


def per_adapter(res: RunResult, requests: list[BenchRequest]) -> dict[str, dict]:
    """Completed requests, output tokens and output tok/s per adapter ("" for the base model)."""
    out: dict[str, dict] = {}
    for entry in res.requests:
        name = requests[entry["index"]].lora or ""
        d = out.setdefault(name, {"requests": 0, "completed": 0, "output_tokens": 0})
        d["requests"] += 1
        if entry["error"] is None and entry["output_len"] > 0:
            d["completed"] += 1
            d["output_tokens"] += entry["output_len"]
    for d in out.values():
        d["output_tok_s"] = d["output_tokens"] / res.duration_s if res.duration_s else 0.0
    return out


def format_lora(meta: dict) -> str:
    """The run's adapter spread, one line per adapter, under the result's table."""
    info = meta.get("lora") or {}
    rows = info.get("per_adapter") or {}
    if not info.get("adapters"):
        return ""
    lines = [f"LoRA: {len(info['adapters'])} adapters, requests spread round-robin"]
    for name, d in sorted(rows.items()):
        lines.append(f"  {name or '(base)':<24} {d['completed']:>5}/{d['requests']:<5} requests "
                     f"{d['output_tok_s']:>10.1f} output tok/s")
    return "\n".join(lines)
