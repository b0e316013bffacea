"""Stress scenarios for a running server: overload, a disconnect storm, and a soak.

    conveyor bench stress overload --url http://127.0.0.1:8000 --clients 640 --burst 1000
    conveyor bench stress storm --url http://127.0.0.1:8000 --cuts 300
    conveyor bench stress soak --url http://127.0.0.1:8000 --duration 1200

Each scenario drives the server over loopback with `httpx` (one asyncio loop, many connections),
watches what a production operator would (response codes, `/health` latency, the server's RSS,
the engine gauges in `/metrics`) and returns a result whose `problems()` lists every broken
promise; the CLI prints the result as JSON and exits 1 if there are any. The tests in
`tests/server/test_stress.py` run short versions of all three against a real server process;
docs/reliability.md has the long runs.

Prompts are random words, so any tokenizer and vocabulary work; a prompt of W words is about W
to 2W tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.http_backend import find_listening_pid, parse_prometheus, sse_lines

WORDS = ("batch block cache token step queue prefix decode stream model river cloud stone paper light "
         "garden window letter number orange silver yellow market engine signal").split()
SYSTEM_PROMPTS = [f"You are assistant number {i}. " + " ".join(random.Random(i).choices(WORDS, k=30))
                  for i in range(4)]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


# --- what every scenario watches ---------------------------------------------------------------------

class Watch:
    """Samples the server's RSS (with its children: `--engine-loop process`) and times `/health`.

    The probe runs in its own thread with its own connection, as a liveness probe would from outside:
    timed on the load's event loop it would measure the load generator's own backlog."""

    def __init__(self, url: str, pid: int | None, every_s: float = 0.05, rss_every_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.proc = psutil.Process(pid) if pid else None
        self.every_s = every_s
        self.rss_every_s = rss_every_s
        self.health: list[float] = []
        self.health_failures = 0
        self.rss: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def rss_now(self) -> int | None:
        if self.proc is None:
            return None
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return None

    async def __aenter__(self) -> Watch:
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._health_loop, self._rss_loop)]
        for t in self._threads:
            t.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            await asyncio.to_thread(t.join, 15)

    def _health_loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    if client.get("/health").status_code == 200:
                        self.health.append(time.monotonic() - t)
                    else:
                        self.health_failures += 1
                except httpx.HTTPError:
                    self.health_failures += 1
                self._stop.wait(self.every_s)

    def _rss_loop(self) -> None:
        while not self._stop.is_set():
            rss = self.rss_now()
            if rss is not None:
                self.rss.append((time.monotonic() - self.t0, rss))
            self._stop.wait(self.rss_every_s)


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    r = await client.get("/metrics", timeout=10)
    return parse_prometheus(r.text)


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll `/metrics` until nothing runs or waits and no KV block is referenced; the last values."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await gauges(client)
        idle = all(m.get(f"conveyor:{k}", 0) == 0
                   for k in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"))
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


def idle_gauges(m: dict[str, float]) -> dict[str, float]:
    return {k: m.get(f"conveyor:{k}", float("nan"))
            for k in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used")}


def new_client(url: str, api_key: str | None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, headers=headers,
                             timeout=httpx.Timeout(120.0, connect=30.0))


async def completion(client: httpx.AsyncClient, body: dict, chat: bool = False) -> tuple[int, dict]:
    """One request read to its end: (status, summary). A stream's summary says whether it ended with
    [DONE], whether an error event came, and its usage; a plain call's is its JSON."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = await client.post(path, json=body)
        return r.status_code, (r.json() if r.headers.get("content-type", "").startswith("application/json")
                               else {})
    out: dict = {"done": False, "error": None, "usage": None, "finish": set()}
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, {"error": r.text[:200]}
        async for line in sse_lines(r):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("finish_reason"):
                    out["finish"].add(c["finish_reason"])
    return 200, out


# --- overload ------------------------------------------------------------------------------------------

@dataclass
class OverloadResult:
    clients: int
    burst: int
    duration_s: float
    statuses: dict[str, int]
    transport_errors: int
    stream_errors: int
    health_p50_s: float
    health_p99_s: float
    health_max_s: float
    health_failures: int
    rss_idle_mb: float | None
    rss_peak_mb: float | None
    rss_bound_mb: float | None
    after: dict[str, float]
    transport_error_kinds: dict[str, int] = field(default_factory=dict)  # "ExceptionType: message" -> count

    def problems(self) -> list[str]:
        out = []
        bad = {k: v for k, v in self.statuses.items() if k not in ("200", "429")}
        if bad:
            out.append(f"responses other than 200 and 429: {bad}")
        if self.transport_errors:
            out.append(f"{self.transport_errors} requests failed at the transport level: {self.transport_error_kinds}")
        if self.stream_errors:
            out.append(f"{self.stream_errors} streams carried an error event or no [DONE]")
        if not self.statuses.get("200") or not self.statuses.get("429"):
            out.append(f"expected both 200s and 429s under overload, got {self.statuses}")
        if not self.health_p99_s < 1.0:
            out.append(f"/health p99 {self.health_p99_s:.3f}s is not under 1 s")
        if self.health_failures:
            out.append(f"/health failed {self.health_failures} times")
        if self.rss_bound_mb is not None and self.rss_peak_mb > self.rss_bound_mb:
            out.append(f"RSS peaked at {self.rss_peak_mb:.0f} MB, over the bound of {self.rss_bound_mb:.0f} MB")
        if any(v != 0 for v in self.after.values()):
            out.append(f"not idle afterwards: {self.after}")
        return out


async def overload(url: str, *, clients: int = 80, duration_s: float = 20.0, burst: int = 200,
                   burst_at_s: float = 5.0, max_tokens: tuple[int, int] = (8, 32),
                   prompt_words: tuple[int, int] = (8, 64), api_key: str | None = None, pid: int | None = None,
                   rss_headroom_mb: float = 512.0, seed: int = 0) -> OverloadResult:
    """`clients` closed-loop clients (each retries a 429 after a short jittered pause, not the whole
    Retry-After, to keep the pressure on) plus, `burst_at_s` in, `burst` requests fired at once.
    Promises: only 200 and 429 (never a 5xx, a reset or a broken stream), `/health` p99 under 1 s,
    RSS under idle + `rss_headroom_mb`, and the engine idle with no KV block used afterwards."""
    rng = random.Random(seed)
    statuses: Counter[str] = Counter()
    errors = {"transport": 0, "stream": 0}
    kinds: Counter[str] = Counter()
    async with new_client(url, api_key) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(r: random.Random) -> int:
            body = {"model": model, "prompt": words(r, r.randint(*prompt_words)),
                    "max_tokens": r.randint(*max_tokens), "ignore_eos": True, "stream": r.random() < 0.5}
            try:
                status, summary = await completion(client, body)
            except httpx.HTTPError as e:
                errors["transport"] += 1
                kinds[f"{type(e).__name__}: {e} (stream={body['stream']})"] += 1
                return -1
            statuses[str(status)] += 1
            if status == 200 and body["stream"] and (summary["error"] or not summary["done"]):
                errors["stream"] += 1
            return status

        async def closed_loop(i: int, deadline: float) -> None:
            r = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                if await one(r) == 429:
                    await asyncio.sleep(r.uniform(0.02, 0.2))

        async def open_burst() -> None:
            await asyncio.sleep(burst_at_s)
            await asyncio.gather(*(one(random.Random(rng.random())) for _ in range(burst)))

        watch = Watch(url, pid)
        idle_rss = watch.rss_now()
        async with watch:
            deadline = time.monotonic() + duration_s
            await asyncio.gather(open_burst(), *(closed_loop(i, deadline) for i in range(clients)))
            after = await wait_idle(client)
    peak = max((b for _, b in watch.rss), default=None)
    mb = 2**20
    return OverloadResult(
        clients=clients, burst=burst, duration_s=duration_s, statuses=dict(statuses),
        transport_errors=errors["transport"], stream_errors=errors["stream"],
        health_p50_s=percentile(watch.health, 50), health_p99_s=percentile(watch.health, 99),
        health_max_s=max(watch.health, default=float("nan")), health_failures=watch.health_failures,
        rss_idle_mb=idle_rss / mb if idle_rss else None, rss_peak_mb=peak / mb if peak else None,
        rss_bound_mb=idle_rss / mb + rss_headroom_mb if idle_rss else None, after=idle_gauges(after),
        transport_error_kinds=dict(kinds))


# --- disconnect storm ----------------------------------------------------------------------------------

@dataclass
class StormResult:
    cuts: int
    cut_before_first_token: int
    cut_mid_stream: int
    cut_in_prefill: int
    finished_before_cut: int
    refused: dict[str, int]  # statuses other than 200 answered before any cut (429: the queue was full)
    good_requests: int
    good_failures: list[str]
    after: dict[str, float]
    aborted: float

    def problems(self) -> list[str]:
        out = []
        if self.good_failures:
            out.append(f"{len(self.good_failures)} well-behaved requests failed, first: {self.good_failures[0]}")
        if not self.good_requests:
            out.append("the well-behaved clients completed nothing")
        bad = {k: v for k, v in self.refused.items() if k != "429"}
        if bad:
            out.append(f"cut requests were answered with statuses other than 200 and 429: {bad}")
        if any(v != 0 for v in self.after.values()):
            out.append(f"not idle afterwards: {self.after}")
        return out


async def disconnect_storm(url: str, *, cuts: int = 300, concurrency: int = 48, good_clients: int = 16,
                           good_max_tokens: int = 24, long_prompt_words: int = 300, api_key: str | None = None,
                           seed: int = 0) -> StormResult:
    """`cuts` streaming requests, each cut at a random point, `concurrency` at a time, while
    `good_clients` well-behaved streaming clients keep going. A third of the cuts come before the
    first byte (a random 0-50 ms after sending), a third mid-stream (after 1-20 chunks), a third
    during the prefill of a long prompt. Promises: every well-behaved request ends with its
    `good_max_tokens` tokens, finish_reason "length" and [DONE]; afterwards nothing runs or waits
    and no KV block is used."""
    counts: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    good: dict = {"ok": 0, "failures": []}
    async with new_client(url, api_key) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = await aborts(client)
        stop = asyncio.Event()

        async def well_behaved(i: int) -> None:
            r = random.Random(seed * 7919 + i)
            while not stop.is_set():
                body = {"model": model, "prompt": words(r, r.randint(8, 48)), "max_tokens": good_max_tokens,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                try:
                    status, s = await completion(client, body)
                except httpx.HTTPError as e:
                    good["failures"].append(f"transport: {e!r}")
                    continue
                usage = (s.get("usage") or {}).get("completion_tokens")
                if status != 200 or not s["done"] or s["error"] or s["finish"] != {"length"} \
                        or usage != good_max_tokens:
                    good["failures"].append(f"status {status}: {str(s)[:160]}")
                else:
                    good["ok"] += 1

        async def cut(i: int, sem: asyncio.Semaphore) -> None:
            r = random.Random(seed * 104729 + i)
            mode = ("before", "mid", "prefill")[i % 3]
            n_words = long_prompt_words if mode == "prefill" else r.randint(8, 48)
            body = {"model": model, "prompt": words(r, n_words), "max_tokens": 64, "ignore_eos": True,
                    "stream": True}
            chunks = 0

            async def read() -> None:
                nonlocal chunks
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        refused[str(resp.status_code)] += 1
                        chunks = -1
                        return
                    async for line in sse_lines(resp):
                        if line.startswith("data: "):
                            chunks += 1
                            if mode == "mid" and chunks >= want:
                                return  # leaving the block closes the connection mid-stream

            want = r.randint(1, 20)
            async with sem:
                try:
                    if mode == "mid":
                        await read()
                    else:
                        await asyncio.wait_for(read(), timeout=r.uniform(0.0, 0.05 if mode == "before" else 0.15))
                except (asyncio.TimeoutError, httpx.HTTPError):
                    pass
            if chunks < 0:
                pass
            elif mode == "mid" and chunks < want:
                counts["finished"] += 1
            elif chunks == 0:
                counts["prefill" if mode == "prefill" else "before"] += 1
            elif mode == "mid":
                counts["mid"] += 1
            else:  # a 'before' or 'prefill' cut that came after a token had arrived
                counts["mid"] += 1

        sem = asyncio.Semaphore(concurrency)
        goods = [asyncio.create_task(well_behaved(i)) for i in range(good_clients)]
        await asyncio.gather(*(cut(i, sem) for i in range(cuts)))
        stop.set()
        await asyncio.gather(*goods)
        after = await wait_idle(client)
        aborted = await aborts(client) - before
    return StormResult(cuts=cuts, cut_before_first_token=counts["before"], cut_mid_stream=counts["mid"],
                       cut_in_prefill=counts["prefill"], finished_before_cut=counts["finished"],
                       refused=dict(refused),
                       good_requests=good["ok"], good_failures=good["failures"], after=idle_gauges(after),
                       aborted=aborted)


async def aborts(client: httpx.AsyncClient) -> float:
    """Sequences the server counted as finished by abort (`conveyor:request_success{finished_reason="abort"}`)."""
    text = (await client.get("/metrics", timeout=10)).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "conveyor:request_success_total" and s.labels.get("finished_reason") == "abort")


# --- soak ----------------------------------------------------------------------------------------------

@dataclass
class SoakResult:
    duration_s: float
    warmup_s: float
    requests: int
    failures: list[str]
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (t, MB) every sample
    rss_after_warmup_mb: float | None = None
    rss_max_after_warmup_mb: float | None = None
    growth: float | None = None  # max after warm-up / first after warm-up - 1
    after: dict[str, float] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        if self.failures:
            out.append(f"{len(self.failures)} requests failed, first: {self.failures[0]}")
        if self.growth is not None and not self.growth < 0.05:
            out.append(f"RSS grew {self.growth:.1%} after warm-up (limit 5%)")
        if any(v != 0 for v in self.after.values()):
            out.append(f"not idle afterwards: {self.after}")
        return out


async def soak(url: str, *, duration_s: float = 1200.0, warmup_s: float | None = None, clients: int = 12,
               rss_every_s: float = 10.0, max_tokens: tuple[int, int] = (16, 96),
               prompt_words: tuple[int, int] = (4, 40), api_key: str | None = None,
               pid: int | None = None, seed: int = 0, warmup_requests: int = 0) -> SoakResult:
    """`clients` closed-loop clients send a mix for `duration_s`, each kind a seventh of the requests:
    plain and streamed completions, chat streams, n=2, chat streams under shared system prompts
    (prefix-cache hits), logprobs, and streams cut after a random number of chunks. RSS is sampled
    every `rss_every_s`; after the warm-up (default: a third of the run) it must stay within 5% of
    its first post-warm-up sample. Every request that was not cut must succeed.

    The warm-up lasts `warmup_s` and until `warmup_requests` requests are done, and the run goes on for
    `duration_s - warmup_s` after it: on a slow or shared machine the server has seen fewer shapes by a given
    time (memory its allocator keeps for the largest ones it met), and a warm-up by the clock alone would
    read that as growth."""
    warmup_s = duration_s / 3 if warmup_s is None else warmup_s
    failures: list[str] = []
    done = Counter()
    async with new_client(url, api_key) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(r: random.Random) -> None:
            kind = r.choice(("plain", "stream", "chat", "n2", "prefix", "logprobs", "cut"))
            n_tok = r.randint(*max_tokens)
            prompt = words(r, r.randint(*prompt_words))
            body: dict = {"model": model, "max_tokens": n_tok, "ignore_eos": True}
            chat = kind == "chat" or kind == "prefix"
            if chat:
                system = r.choice(SYSTEM_PROMPTS) if kind == "prefix" else "Be brief."
                body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
                body["stream"] = True
            else:
                body["prompt"] = prompt
                body["stream"] = kind in ("stream", "cut")
                if kind == "n2":
                    body["n"] = 2
                if kind == "logprobs":
                    body["logprobs"] = 2
            if kind == "cut":
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            failures.append(f"cut: status {resp.status_code}")
                            return
                        async for line in sse_lines(resp):
                            if line.startswith("data: ") and r.random() < 0.2:
                                break
                except httpx.HTTPError:
                    pass
                done["cut"] += 1
                return
            try:
                status, s = await completion(client, body, chat=chat)
            except httpx.HTTPError as e:
                failures.append(f"{kind}: transport {e!r}")
                return
            ok = status == 200 and (not body["stream"] or (s["done"] and not s["error"]))
            if not ok:
                failures.append(f"{kind}: status {status}: {str(s)[:200]}")
            done[kind] += 1

        deadline = [math.inf]  # set when the warm-up ends
        warmed = [warmup_s]  # seconds from the watch's start to the warm-up's end

        async def closed_loop(i: int) -> None:
            r = random.Random(seed * 31 + i)
            while time.monotonic() < deadline[0]:
                await one(r)

        async def warm_up() -> None:
            await asyncio.sleep(warmup_s)
            while sum(done.values()) < warmup_requests:
                await asyncio.sleep(0.1)
            warmed[0] = time.monotonic() - watch.t0
            deadline[0] = time.monotonic() + max(duration_s - warmup_s, 0.0)

        watch = Watch(url, pid, every_s=1.0, rss_every_s=rss_every_s)
        async with watch:
            await asyncio.gather(warm_up(), *(closed_loop(i) for i in range(clients)))
            rss = watch.rss_now()
            if rss is not None:
                watch.rss.append((time.monotonic() - watch.t0, rss))
            after = await wait_idle(client)
    mb = 2**20
    series = [(round(t, 1), round(b / mb, 1)) for t, b in watch.rss]
    post = [b for t, b in series if t >= warmed[0]]
    return SoakResult(duration_s=duration_s, warmup_s=warmed[0], requests=sum(done.values()), failures=failures,
                      rss_mb=series, rss_after_warmup_mb=post[0] if post else None,
                      rss_max_after_warmup_mb=max(post) if post else None,
                      growth=max(post) / post[0] - 1 if len(post) > 1 else None, after=idle_gauges(after))


# --- command line ---------------------------------------------------------------------------------------

def add_stress_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("stress", parents=[common],
                       help="overload, disconnect-storm and soak checks against a running server")
    p.add_argument("scenario", choices=("overload", "storm", "soak"),
                   help="overload: 10x clients plus a burst; storm: streams cut at random points beside "
                        "well-behaved clients; soak: a long mixed load watching RSS")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("CONVEYOR_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else $CONVEYOR_API_KEY)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid, for RSS (default: whoever listens on the port)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of load (default: overload 20, soak 1200)")
    p.add_argument("--clients", type=int, default=None,
                   help="closed-loop clients (default: overload 80, storm 16 well-behaved, soak 12)")
    p.add_argument("--burst", type=int, default=200, help="overload: requests fired at once 5 s in")
    p.add_argument("--cuts", type=int, default=300, help="storm: streams cut at random points")
    p.add_argument("--long-prompt-words", type=int, default=300,
                   help="storm: words in the long prompts cut during prefill (must fit the model's context)")
    p.add_argument("--rss-every", type=float, default=10.0, help="soak: seconds between RSS samples")
    p.add_argument("--out", default=None, help="also write the result JSON here")


def cmd_stress(args: argparse.Namespace) -> int:
    pid = args.server_pid or find_listening_pid(args.url)
    if args.scenario == "overload":
        coro = overload(args.url, clients=args.clients or 80, duration_s=args.duration or 20.0, burst=args.burst,
                        api_key=args.api_key, pid=pid)
    elif args.scenario == "storm":
        coro = disconnect_storm(args.url, cuts=args.cuts, good_clients=args.clients or 16, api_key=args.api_key,
                                long_prompt_words=args.long_prompt_words)
    else:
        coro = soak(args.url, duration_s=args.duration or 1200.0, clients=args.clients or 12,
                    rss_every_s=args.rss_every, api_key=args.api_key, pid=pid)
    result = asyncio.run(coro)
    text = json.dumps({**asdict(result), "problems": result.problems()}, indent=2, default=str)
    print(text)
    if args.out:
        with contextlib.suppress(OSError), open(args.out, "w") as f:
            f.write(text + "\n")
    if result.problems():
        print("FAILED: " + "; ".join(result.problems()), file=sys.stderr)
        return 1
    return 0
