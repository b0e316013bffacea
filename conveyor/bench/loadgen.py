"""The load generator: send a fixed list of requests in a closed or open loop and time every token.

Closed loop (`concurrency=C`): C workers, each sends its next request when the last one finished;
the offered load adapts to the server. Open loop (`request_rate=λ`): requests leave at
precomputed, seeded arrival times whether or not earlier ones finished, as real users do; the
server's queue absorbs the difference. Both are bounded: by the number of requests and by
`timeout_s`, after which every request still in flight is cancelled and counted as failed.

A backend (HTTP server or in-process engine) only has to implement `send`, which fills in one
`RequestRecord`; everything measured from the client side is computed from those records.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

from conveyor.bench.workloads import BenchRequest, arrival_offsets


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are `time.monotonic()` seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    due: float = 0.0  # when the load pattern wanted it sent, seconds after the start
    sent: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per streamed chunk carrying tokens
    output_len: int = 0
    end: float | None = None
    cached_tokens: int = 0
    error: str | None = None
    tenant: str | None = None  # the request's, for per-tenant results
    slo_ttft_ms: float | None = None  # the request's own targets, if it had any
    slo_tpot_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.output_len > 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times and self.sent is not None else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.sent if self.end is not None and self.sent is not None else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Backend(Protocol):
    async def start(self) -> None: ...

    async def send(self, rid: str, req: BenchRequest, rec: RequestRecord) -> None:
        """Send one request, stream it to the end, fill `rec` (set `rec.error` on failure)."""

    def end_of_input(self) -> None:
        """No more requests will come (lets a static batcher flush its last, partial batch)."""

    async def close(self) -> None: ...

    def engine_stats(self) -> dict:
        """Engine-side numbers over the run (batch size, KV usage, ...); valid after `close`."""


@dataclass
class LoadPattern:
    concurrency: int | None = None  # closed loop when set
    request_rate: float = float("inf")  # open loop otherwise; inf sends everything at once
    burstiness: float = 1.0
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "all at once" if self.request_rate == float("inf") else f"{self.request_rate:g} req/s"


@dataclass
class RunTiming:
    start: float
    end: float
    cpu_seconds: float | None  # of the serving process, over the run
    num_cpus: int

    @property
    def duration(self) -> float:
        return self.end - self.start


async def drive(backend: Backend, requests: list[BenchRequest], load: LoadPattern,
                on_done: Callable[[RequestRecord], None] | None = None,
                server_pid: int | None = None) -> tuple[list[RequestRecord], RunTiming]:
    """Send every request per `load`; return the records and the run's wall/CPU time."""
    records = [RequestRecord(i, r.prompt_len, r.max_tokens, tenant=r.tenant, slo_ttft_ms=r.slo_ttft_ms,
                             slo_tpot_ms=r.slo_tpot_ms) for i, r in enumerate(requests)]
    proc = _process(server_pid)
    cpu0 = _cpu_seconds(proc)
    start = time.monotonic()

    async def one(i: int) -> None:
        rec = records[i]
        rec.sent = time.monotonic()
        try:
            await backend.send(f"bench-{i}", requests[i], rec)
        except asyncio.CancelledError:
            rec.error = rec.error or "timeout"
            raise
        except Exception as e:  # a failed request is a measurement, not a crash
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            if rec.end is None and rec.error is None:
                rec.error = "no end"
            if on_done is not None:
                on_done(rec)

    async def closed_loop() -> None:
        it = iter(range(len(requests)))

        async def worker() -> None:
            for i in it:
                records[i].due = time.monotonic() - start
                task = asyncio.ensure_future(one(i))
                if i == len(requests) - 1:
                    await asyncio.sleep(0)  # let the last request reach the backend first
                    backend.end_of_input()
                await task

        await asyncio.gather(*(worker() for _ in range(min(load.concurrency, len(requests)))))

    tasks: list[asyncio.Task] = []  # open loop's requests in flight, cancelled on timeout

    async def open_loop() -> None:
        offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
        for i, due in enumerate(offsets):
            records[i].due = due
            delay = start + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0)  # let the last request reach the backend before saying it was the last
        backend.end_of_input()
        await asyncio.gather(*tasks)

    body = closed_loop() if load.concurrency is not None else open_loop()
    task = asyncio.ensure_future(body)
    try:
        await asyncio.wait_for(task, timeout=load.timeout_s)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rec in records:
            if rec.end is None and rec.error is None:
                rec.error = "timeout" if rec.sent is not None else "not sent (timeout)"
    end = time.monotonic()
    cpu1 = _cpu_seconds(proc)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return records, RunTiming(start, end, cpu, psutil.cpu_count() or 1)


def _process(pid: int | None) -> psutil.Process | None:
    try:
        return psutil.Process(pid if pid is not None else os.getpid())
    except (psutil.Error, ValueError):
        return None


def _cpu_seconds(proc: psutil.Process | None) -> float | None:
    """User + system CPU seconds of the process and its children (a server may fork workers)."""
    if proc is None:
        return None
    try:
        t = proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    except psutil.Error:
        return None
