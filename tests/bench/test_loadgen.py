"""The load generator's loops with a fake backend: concurrency caps, arrival times, timeouts."""

from __future__ import annotations

import asyncio
import time

from conveyor.bench.loadgen import LoadPattern, RequestRecord, drive
from conveyor.bench.workloads import BenchRequest


class FakeBackend:
    """Streams `max_tokens` tokens, one every `delay` seconds; `hang` never finishes."""

    def __init__(self, delay: float = 0.005, hang: bool = False) -> None:
        self.delay, self.hang = delay, hang
        self.in_flight = self.max_in_flight = 0
        self.sent_at: list[float] = []
        self.ended_after: int | None = None

    async def start(self) -> None: ...

    async def send(self, rid: str, req: BenchRequest, rec: RequestRecord) -> None:
        self.sent_at.append(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hang:
                await asyncio.sleep(3600)
            for _ in range(req.max_tokens):
                await asyncio.sleep(self.delay)
                rec.token_times.append(time.monotonic())
                rec.output_len += 1
            rec.end = time.monotonic()
        finally:
            self.in_flight -= 1

    def end_of_input(self) -> None:
        self.ended_after = len(self.sent_at)

    async def close(self) -> None: ...

    def engine_stats(self):
        from conveyor.bench.result import EngineRunStats

        return EngineRunStats()


REQS = [BenchRequest([101] * 4, 3) for _ in range(10)]


def test_closed_loop_caps_concurrency_and_signals_the_last_request() -> None:
    backend = FakeBackend()
    records, timing = asyncio.run(drive(backend, REQS, LoadPattern(concurrency=3, timeout_s=30)))
    assert all(r.ok for r in records)
    assert backend.max_in_flight == 3
    assert backend.ended_after == 10  # told after the last request was sent, not before
    assert all(r.ttft > 0 and len(r.itls) == 2 for r in records)


def test_open_loop_respects_arrival_times() -> None:
    backend = FakeBackend()
    records, timing = asyncio.run(drive(backend, REQS, LoadPattern(request_rate=50, seed=2, timeout_s=30)))
    assert all(r.ok for r in records)
    for rec in records:
        assert rec.sent - timing.start >= rec.due - 1e-3  # never early
    assert records[-1].due > 0.05  # 10 requests at 50/s take a while to arrive
    assert backend.ended_after == 10


def test_timeout_cancels_what_is_left() -> None:
    backend = FakeBackend(hang=True)
    t0 = time.monotonic()
    records, _ = asyncio.run(drive(backend, REQS, LoadPattern(request_rate=10, timeout_s=0.3)))
    assert time.monotonic() - t0 < 5
    errors = {r.error for r in records}
    assert errors <= {"timeout", "not sent (timeout)"} and "timeout" in errors and not any(r.ok for r in records)
    assert backend.in_flight == 0  # every started request was cancelled
