"""An HTTP backend: streaming `POST /v1/completions` against a running conveyor (or vLLM) server.

Prompts go as token-id lists so the server tokenizes nothing and lengths hold; `ignore_eos` and
`max_tokens` fix the output length. Every SSE chunk that carries a choice is one token event (a
server may stream empty text while the detokenizer holds back a partial UTF-8 character; that
still is a token arriving). The final usage chunk gives the exact token count.

Engine-side numbers come from `/metrics` (Prometheus text): counters are differenced over the run,
gauges are sampled while it runs. Beside each sample the backend times a `GET /health`: what a
liveness probe sees while the server is busy (`health_latency_s` in the result).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from urllib.parse import urlparse

import httpx
import psutil

from conveyor.bench.loadgen import RequestRecord
from conveyor.bench.result import EngineRunStats, Summary
from conveyor.bench.workloads import BenchRequest


async def sse_lines(resp: httpx.Response):
    """The lines of a server-sent-events stream, split only where SSE splits them: CR LF, CR or LF.

    Not httpx's `aiter_lines`: it splits with `str.splitlines`, which also breaks at U+0085, U+2028 and
    U+2029, so a server that sends a token holding one of them raw (JSON allows it) would have its chunk
    cut in two unparseable halves and the run would count an error that is the client's.
    """
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        hold = buf.endswith("\r")  # its LF may come in the next piece: keep the CR back until then
        *lines, rest = _SSE_EOL.split(buf[:-1] if hold else buf)
        buf = rest + ("\r" if hold else "")
        for line in lines:
            yield line
    if buf:
        yield buf.rstrip("\r")


_SSE_EOL = re.compile(r"\r\n|\r|\n")
METRIC_PREFIXES = ("conveyor:", "conveyor_", "vllm:")


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value, summed over label sets (one model per server, so sums are totals)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        if not name_part:
            continue
        name = name_part.split("{", 1)[0].strip()
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def metric(values: dict[str, float], name: str) -> float | None:
    """Look a metric up under any known prefix (`conveyor:x`, vLLM's `vllm:x`, ...)."""
    for prefix in METRIC_PREFIXES:
        if prefix + name in values:
            return values[prefix + name]
    return None


def find_listening_pid(url: str) -> int | None:
    """The pid of the local process listening on the URL's port, for CPU accounting (None if unknown)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.Error, OSError):
        return None
    return None


class HttpBackend:
    def __init__(self, base_url: str, model: str | None = None, sample_every_s: float = 0.2,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.sample_every_s = sample_every_s
        self.client: httpx.AsyncClient | None = None
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.gauge_samples: list[dict[str, float]] = []
        self.health_latencies: list[float] = []
        self._sampler: asyncio.Task | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(base_url=self.base_url, limits=limits, headers=self.headers,
                                        timeout=httpx.Timeout(None, connect=10.0))
        if self.model is None:
            resp = await self.client.get("/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        self.before = await self.scrape()
        self._sampler = asyncio.create_task(self._sample_loop())

    async def scrape(self) -> dict[str, float]:
        try:
            resp = await self.client.get("/metrics")
            return parse_prometheus(resp.text) if resp.status_code == 200 else {}
        except httpx.HTTPError:
            return {}

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sample_every_s)
            t0 = time.monotonic()
            try:
                if (await self.client.get("/health")).status_code == 200:
                    self.health_latencies.append(time.monotonic() - t0)
            except httpx.HTTPError:
                pass
            values = await self.scrape()
            if values:
                self.gauge_samples.append(values)

    async def send(self, rid: str, req: BenchRequest, rec: RequestRecord) -> None:
        payload = {
            "model": req.lora or self.model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.tenant is not None:
            payload["user"] = req.tenant
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(req, name) is not None:
                payload[name] = getattr(req, name)
        usage = None
        async with self.client.stream("POST", "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    return
                if chunk.get("choices"):
                    rec.token_times.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        rec.end = time.monotonic()
        rec.output_len = int(usage["completion_tokens"]) if usage else len(rec.token_times)
        details = (usage or {}).get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)

    def end_of_input(self) -> None:
        pass

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            try:
                await self._sampler
            except asyncio.CancelledError:
                pass
        if self.client is not None:
            self.after = await self.scrape()
            await self.client.aclose()

    def engine_stats(self) -> EngineRunStats:
        """Mean batch size, KV usage and prefix-cache hit rate over the run, from /metrics."""
        def delta(name: str) -> float | None:
            a, b = metric(self.before, name), metric(self.after, name)
            return b - a if a is not None and b is not None else None

        steps, seqs = delta("engine_steps_total"), delta("engine_step_seqs_total")
        queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
        kv = [v for v in (metric(s, "kv_cache_usage_perc") for s in self.gauge_samples) if v is not None]
        running = [v for v in (metric(s, "num_requests_running") for s in self.gauge_samples) if v is not None]
        return EngineRunStats(
            source="/metrics",
            num_steps=int(steps) if steps is not None else None,
            mean_batch_size=seqs / steps if steps else (sum(running) / len(running) if running else None),
            mean_kv_usage=sum(kv) / len(kv) if kv else None,
            peak_kv_usage=max(kv) if kv else None,
            prefix_hit_rate=hits / queries if queries else None,
            num_preemptions=delta("num_preemptions_total"),
            health_latency_s=Summary.of(self.health_latencies),
        )
