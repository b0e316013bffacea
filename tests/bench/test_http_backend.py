"""The HTTP backend against a stub OpenAI-style streaming server on loopback."""

from __future__ import annotations

import asyncio
import json

from conveyor.bench.http_backend import HttpBackend, metric, parse_prometheus
from conveyor.bench.loadgen import LoadPattern, drive
from conveyor.bench.workloads import BenchRequest

METRICS = """# HELP conveyor:engine_steps_total Engine steps.
# TYPE conveyor:engine_steps_total counter
conveyor:engine_steps_total{model_name="m"} %d
conveyor:engine_step_seqs_total{model_name="m"} %d
conveyor:kv_cache_usage_perc{model_name="m"} 0.25
conveyor:prefix_cache_queries_total{model_name="m"} %d
conveyor:prefix_cache_hits_total{model_name="m"} %d
"""


class StubServer:
    """Streams one SSE chunk per token (max_tokens of them), then usage, then [DONE]."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.scrapes = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # a pooled connection closed unused
            writer.close()
            return
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")), 0)
        body = await reader.readexactly(length) if length else b""
        if path == "/metrics":
            k = self.scrapes
            self.scrapes += 1
            text = (METRICS % (10 * k, 40 * k, 100 * k, 25 * k)).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % len(text) + text)
        elif path == "/v1/models":
            text = json.dumps({"data": [{"id": "stub-model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % len(text) + text)
        else:
            req = json.loads(body)
            self.requests.append(req)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for i in range(req["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": "" if i == 1 else f"t{i}", "finish_reason": None}]}
                writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(0.01)
            usage = {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]),
                                              "completion_tokens": req["max_tokens"],
                                              "prompt_tokens_details": {"cached_tokens": 16}}}
            writer.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()
        writer.close()


def test_parse_prometheus_sums_label_sets() -> None:
    values = parse_prometheus('a_total{x="1"} 2\na_total{x="2"} 3.5\n# c\nconveyor:g 0.5\nbad line here\n')
    assert values["a_total"] == 5.5
    assert metric(values, "g") == 0.5 and metric(values, "missing") is None


def test_streaming_requests_and_metrics_deltas() -> None:
    async def main():
        stub = StubServer()
        server = await asyncio.start_server(stub.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = HttpBackend(f"http://127.0.0.1:{port}", sample_every_s=0.01)
        reqs = [BenchRequest([101, 102, 103], 5), BenchRequest([104] * 20, 3), BenchRequest([105], 1)]
        await backend.start()
        try:
            records, timing = await drive(backend, reqs, LoadPattern(concurrency=2, timeout_s=30))
        finally:
            await backend.close()
            server.close()
            await server.wait_closed()
        return stub, backend, records, timing

    stub, backend, records, timing = asyncio.run(main())
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.output_len for r in records] == [5, 3, 1]
    assert len(records[0].token_times) == 5  # the empty-text chunk is still a token arriving
    assert records[0].ttft is not None and records[0].e2e >= records[0].ttft
    assert records[0].cached_tokens == 16
    sent = {tuple(r["prompt"]): r for r in stub.requests}
    assert sent[(101, 102, 103)]["ignore_eos"] is True and sent[(101, 102, 103)]["stream"] is True
    assert sent[(101, 102, 103)]["model"] == "stub-model"
    stats = backend.engine_stats()
    assert stats.mean_batch_size == 4.0  # 40 seqs per 10 steps in every scrape delta
    assert stats.prefix_hit_rate == 0.25
    assert stats.mean_kv_usage == 0.25
    assert timing.duration > 0


def test_errors_are_recorded_not_raised() -> None:
    async def main():
        backend = HttpBackend("http://127.0.0.1:9", model="x")  # nothing listens on port 9
        import httpx

        backend.client = httpx.AsyncClient(base_url=backend.base_url)
        try:
            return await drive(backend, [BenchRequest([101], 2)], LoadPattern(request_rate=100, timeout_s=10))
        finally:
            await backend.client.aclose()

    records, _ = asyncio.run(main())
    assert not records[0].ok and "ConnectError" in records[0].error
