"""Streaming load against a running `conveyor serve`: TTFT p50/p99 and output tok/s per concurrency.

    conveyor serve &                       # SmolLM2-135M by default, on 127.0.0.1:8000
    python benchmarks/serve_load.py --concurrency 1 16 64

Each of C clients streams `/v1/completions` requests back to back (greedy, `ignore_eos`, so every
request produces exactly --max-tokens tokens) until C x --requests-per-client requests are done.
TTFT is measured at the client: from sending the request to the first chunk carrying text. Output
tok/s is all generated tokens over the wall time of the round. Meanwhile a probe times GET /health
every --probe-interval seconds: what a liveness check sees while the engine is busy. The client
speaks raw SSE over httpx to keep its own CPU use small (it shares the machine with the server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten year old.",
    "List five things to pack for a weekend hiking trip and say why.",
    "What are the main differences between Python and C?",
    "Describe the water cycle in a few sentences.",
    "Give me three ideas for a birthday party at the beach.",
    "Summarize the plot of a detective novel you would like to read.",
    "How does a refrigerator keep food cold?",
]


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int
    itl: list[float]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Sample:
    """One streamed request, timed from sending it. A pooled keep-alive connection that the server
    closed just as we reused it fails before the response headers arrive; that attempt is retried."""
    for attempt in range(3):
        t0 = time.perf_counter()
        cm = client.stream("POST", url, json=body, headers=headers)
        try:
            r = await cm.__aenter__()
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == 2:
                raise
            continue
        try:
            return await _read_stream(r, t0)
        finally:
            await cm.__aexit__(None, None, None)
    raise AssertionError("unreachable")


async def _read_stream(r: httpx.Response, t0: float) -> Sample:
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
    first = last = None
    itl: list[float] = []
    tokens = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
    end = time.perf_counter()
    return Sample(ttft=(first or end) - t0, e2e=end - t0, tokens=tokens, itl=itl)


async def run_round(args: argparse.Namespace, concurrency: int) -> dict:
    url = args.url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    total = concurrency * args.requests_per_client
    todo = list(range(total))
    samples: list[Sample] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            body = {"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if args.model is None:
                del body["model"]
            samples.append(await one_request(client, url, body, headers))

    probes: list[float] = []

    async def probe_loop(client: httpx.AsyncClient) -> None:
        """How long /health takes while the engine is busy: a liveness probe's view of the server."""
        while True:
            t = time.perf_counter()
            await client.get(args.url.rstrip("/") + "/health")
            probes.append(time.perf_counter() - t)
            await asyncio.sleep(args.probe_interval)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        prober = asyncio.ensure_future(probe_loop(client)) if args.probe_interval > 0 else None
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        if prober is not None:
            prober.cancel()
    ttft = [s.ttft for s in samples]
    itl = [x for s in samples for x in s.itl]
    out_tokens = sum(s.tokens for s in samples)
    return {"concurrency": concurrency, "requests": len(samples), "wall_s": wall,
            "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99),
            "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
            "e2e_p50_s": statistics.median(s.e2e for s in samples), "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall, "health_p50_ms": 1000 * pct(probes, 50),
            "health_max_ms": 1000 * max(probes, default=float("nan"))}


async def scrape_batch(url: str) -> tuple[float, float]:
    """(engine steps, sequences over steps) from /metrics, to report the mean batch of a round."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(url.rstrip("/") + "/metrics")).text
    vals = {}
    for line in text.splitlines():
        for name in ("conveyor:engine_steps_total", "conveyor:engine_step_seqs_total"):
            if line.startswith(name + "{"):
                vals[name] = float(line.rsplit(" ", 1)[1])
    return vals.get("conveyor:engine_steps_total", 0.0), vals.get("conveyor:engine_step_seqs_total", 0.0)


async def main_async(args: argparse.Namespace) -> list[dict]:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(args.url.rstrip("/") + "/health")
        r.raise_for_status()
    warm = argparse.Namespace(**{**vars(args), "requests_per_client": 1, "max_tokens": 4})
    await run_round(warm, 1)  # first-request costs (allocations, caches) stay out of the numbers
    results = []
    for c in args.concurrency:
        s0, q0 = await scrape_batch(args.url)
        res = await run_round(args, c)
        s1, q1 = await scrape_batch(args.url)
        res["mean_batch"] = (q1 - q0) / (s1 - s0) if s1 > s0 else float("nan")
        results.append(res)
        print(f"clients {c:3d}: {res['requests']:4d} req in {res['wall_s']:6.1f}s | "
              f"TTFT p50 {res['ttft_p50_ms']:7.0f} ms p99 {res['ttft_p99_ms']:7.0f} ms | "
              f"ITL p50 {res['itl_p50_ms']:5.0f} ms | "
              f"output {res['output_tok_s']:6.1f} tok/s | mean batch {res['mean_batch']:.1f} | "
              f"/health p50 {res['health_p50_ms']:.0f} ms max {res['health_max_ms']:.0f} ms", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--probe-interval", type=float, default=0.2,
                   help="seconds between /health probes during a round (0: no probes)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
