"""Batching across HTTP requests, client disconnects, and the waiting-queue limit."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from conveyor.server.api_server import ServerArgs

from .conftest import API_KEY, MODEL, run_server, slowed_steps, tiny_config


@pytest.fixture()
def slow_steps(server):
    """Steps of at least 20 ms while the test runs (`slowed_steps`)."""
    with slowed_steps(server):
        yield


def test_32_concurrent_streams_share_the_batch(server, slow_steps):
    """32 streams sent at once share the engine's steps. Steps are slowed to 20 ms so that the first
    requests are still running when the last ones arrive, however slowly this machine lets them in."""
    before = server.wait_idle()
    n_streams, n_tokens = 32, 40
    events: list[tuple[float, int]] = []

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.completions.create(model=MODEL, prompt=f"Stream number {i} says", max_tokens=n_tokens,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = []
        async for chunk in stream:
            events.append((time.monotonic(), i))
            text.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason is not None:
                assert chunk.choices[0].finish_reason == "length"
        return "".join(text)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n_streams)))

    texts = asyncio.run(main())
    assert len(texts) == n_streams
    after = server.wait_idle()
    assert after["conveyor:kv_cache_blocks_used"] == 0
    steps = after["conveyor:engine_steps_total"] - before["conveyor:engine_steps_total"]
    seqs = after["conveyor:engine_step_seqs_total"] - before["conveyor:engine_step_seqs_total"]
    assert seqs >= n_streams * n_tokens
    assert seqs / steps > 4, f"mean batch {seqs / steps:.2f}: the streams were not batched"
    # Interleaving: at the busiest moment many streams were between their first and last chunk.
    spans = {i: (min(t for t, j in events if j == i), max(t for t, j in events if j == i)) for i in range(n_streams)}
    overlap = max(sum(1 for a, b in spans.values() if a <= t <= b) for t, _ in events)
    assert overlap >= 8, f"at most {overlap} streams were live at once"


def test_stream_cut_midway_is_aborted_and_frees_blocks(server, client, slow_steps):
    server.wait_idle()
    before = server.scrape()
    stream = client.completions.create(model=MODEL, prompt="A long story:", max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            live = server.scrape()
            assert live["conveyor:num_requests_running"] == 1 and live["conveyor:kv_cache_blocks_used"] > 0
            break
    stream.close()
    after = server.wait_idle()
    assert after["conveyor:num_requests_running"] == 0 and after["conveyor:kv_cache_blocks_used"] == 0
    aborts = "conveyor:request_success_total{finished_reason=abort}"
    assert after[aborts] == before[aborts] + 1
    assert after["conveyor:generation_tokens_total"] - before["conveyor:generation_tokens_total"] < 480


def test_non_stream_client_timeout_is_aborted(server, slow_steps):
    server.wait_idle()
    before = server.scrape()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=2.0,
                   json={"model": MODEL, "prompt": "Wait for it", "max_tokens": 480, "ignore_eos": True})
    after = server.wait_idle()
    assert after["conveyor:num_requests_running"] == 0 and after["conveyor:kv_cache_blocks_used"] == 0
    aborts = "conveyor:request_success_total{finished_reason=abort}"
    assert after[aborts] == before[aborts] + 1


def test_queue_full_gives_429_and_static_batches_flush(tiny_llama):
    # A static batch of 4 that does not fill keeps requests waiting until the 8 s flush (long, so that a
    # busy machine still gets the second request in while the first waits).
    cfg = tiny_config(tiny_llama, scheduler="static", batch_size=4, static_flush_ms=8000.0)
    with run_server(cfg, ServerArgs(max_queued_requests=2)) as srv:
        body = {"model": MODEL, "prompt": "queued", "max_tokens": 4, "n": 2, "ignore_eos": True}
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(httpx.post(srv.base_url + "/completions", json=body,
                                                                    timeout=30)))
        t0 = time.monotonic()
        t.start()
        while srv.scrape()["conveyor:num_requests_waiting"] < 2:
            assert time.monotonic() - t0 < 6, "the first request never queued"
            time.sleep(0.02)
        r = httpx.post(srv.base_url + "/completions", json={**body, "n": 1}, timeout=5)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]
        assert r.headers["Retry-After"] == "1"
        t.join()
        # the partial batch was flushed, not stuck forever
        assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - t0 >= 7.9
        m = srv.wait_idle()
        assert m["conveyor:num_requests_waiting"] == 0 and m["conveyor:kv_cache_blocks_used"] == 0


def test_queued_prompt_tokens_limit_gives_429(tiny_llama):
    """--max-queued-tokens: prompt tokens of requests not yet started are bounded too, so a burst of
    long prompts is refused (429, Retry-After) before it fills memory; short ones still fit."""
    cfg = tiny_config(tiny_llama, scheduler="static", batch_size=4, static_flush_ms=6000.0)
    with run_server(cfg, ServerArgs(max_queued_tokens=100)) as srv:
        body = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 2, "n": 2, "ignore_eos": True}
        done: list[httpx.Response] = []

        def post(b: dict) -> threading.Thread:
            t = threading.Thread(target=lambda: done.append(httpx.post(srv.base_url + "/completions", json=b,
                                                                       timeout=30)))
            t.start()
            return t

        t0 = time.monotonic()
        first = post(body)  # 2 x 40 = 80 prompt tokens wait for the static batch to fill
        while srv.app.state.engine.queued_tokens < 80:
            assert time.monotonic() - t0 < 4, "the first request never queued"
            time.sleep(0.02)
        r = httpx.post(srv.base_url + "/completions", json={**body, "n": 1}, timeout=5)  # 80 + 40 > 100
        assert r.status_code == 429, r.text
        assert "prompt tokens queued" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
        second = post({**body, "prompt": [7] * 20, "n": 1})  # 80 + 20 fits
        first.join()
        second.join()
        assert sorted(x.status_code for x in done) == [200, 200]
        assert srv.app.state.engine.queued_tokens == 0
        m = srv.wait_idle()
        assert m["conveyor:num_requests_waiting"] == 0 and m["conveyor:kv_cache_blocks_used"] == 0


def test_request_timeout_aborts_and_frees(tiny_llama):
    """--request-timeout: a request still running at its deadline is aborted (its blocks freed) and
    answered 408 request_timeout; a stream gets an error event. Every step is slowed to 20 ms so that
    a 480-token request lasts ~10 s, far beyond the 1 s deadline, on any machine."""
    with run_server(tiny_config(tiny_llama), ServerArgs(request_timeout=1.0)) as srv:
        body = {"model": MODEL, "prompt": "Wait for it", "max_tokens": 480, "ignore_eos": True}
        with slowed_steps(srv):
            t0 = time.monotonic()
            r = httpx.post(srv.base_url + "/completions", json=body, timeout=30)
            assert r.status_code == 408, r.text
            assert r.json()["error"]["code"] == "request_timeout" and time.monotonic() - t0 < 8
            with httpx.stream("POST", srv.base_url + "/completions", json={**body, "stream": True}, timeout=30) as s:
                lines = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert '"request_timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
            m = srv.wait_idle()
            assert m["conveyor:num_requests_running"] == 0 and m["conveyor:kv_cache_blocks_used"] == 0
        # full speed again: a 4-token request has a whole 1 s budget
        ok = httpx.post(srv.base_url + "/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200  # short requests still finish in time
