"""A server killed with SIGKILL in the middle of a batch, restarted on the same --batch-dir: it resumes the batch
where it stopped (lines answered before the kill are kept, those in the engine run again); stopped again the usual
way (a graceful shutdown, which aborts the lines in flight) and restarted, it finishes. The output holds every line
exactly once, whole, each the answer the request gets alone."""

from __future__ import annotations

import json
import signal
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from conveyor.server.api_server import ServerArgs

from .conftest import MODEL, bound_url, popen_server, run_server, server_output, slowed_steps, tiny_config

N = 40


def serve(tiny_llama, batch_dir):
    proc = popen_server([sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama), "--served-model-name",
                         MODEL, "--dtype", "float32", "--port", "0", "--batch-dir", str(batch_dir),
                         "--max-num-seqs", "4", "--kv-cache-memory", "0.05", "--max-model-len", "512",
                         "--disable-log-requests"])
    try:
        url = bound_url(proc)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, server_output(proc)[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:  # bound, not listening yet
                pass
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        raise


def body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"resume me {i} " * 3, "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def test_a_killed_server_resumes_its_batch_without_losing_or_repeating_a_line(tiny_llama, tmp_path):
    batch_dir = tmp_path / "batches"
    proc, url = serve(tiny_llama, batch_dir)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        text = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                   "body": body(i)}) + "\n" for i in range(N))
        f = c.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while c.batches.retrieve(b.id).request_counts.completed < 6:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # mid-job: some lines answered, some in the engine, the rest not started
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:  # what the killed server left on disk: mid-job
        status, done = db.execute("SELECT status, completed FROM batches WHERE id = ?", (b.id,)).fetchone()
        assert status == "in_progress" and 6 <= done < N, (status, done)
        assert db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ?", (b.id,)).fetchone() == (done,)
    # the restarts: in this process, which loads faster than a second `conveyor serve` (the kill needed a process);
    # the first is stopped mid-batch the usual way (SIGTERM's path: a graceful shutdown), the second finishes
    config, args = tiny_config(tiny_llama, max_num_seqs=4), ServerArgs(batch_dir=str(batch_dir))
    with run_server(config, args) as srv:
        slowed_steps(srv, 0.005).__enter__()  # kept through the shutdown below
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 60
        while (b := c.batches.retrieve(b.id)).request_counts.completed < done + 4:
            assert time.monotonic() < deadline, b
            time.sleep(0.02)
        assert b.status == "in_progress", "the batch was meant to be stopped mid-way again"
        # an interactive request still open at the stop: the shutdown gives it its grace, then aborts what is left
        # (batch lines must not be answered by that abort: they run again after the restart)
        chat = threading.Thread(target=httpx.post, args=(srv.base_url + "/completions",), kwargs=dict(
            json={"model": MODEL, "prompt": "still here", "max_tokens": 400, "ignore_eos": True}, timeout=60))
        chat.start()
        while srv.scrape()["conveyor:num_requests_running"] <= srv.scrape()["conveyor:batch_tier_seats"]:
            time.sleep(0.01)
    chat.join()
    with run_server(config, args) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while (b := c.batches.retrieve(b.id)).status != "completed":
            assert time.monotonic() < deadline, b
            time.sleep(0.05)
        assert (b.request_counts.completed, b.request_counts.failed, b.request_counts.total) == (N, 0, N)
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in out] == [f"l{i}" for i in range(N)], "every line once, in input order"
        assert {x["response"]["body"]["choices"][0]["finish_reason"] for x in out} == {"length"}, "none cut short"
        with ThreadPoolExecutor(8) as pool:
            alone = list(pool.map(lambda i: httpx.post(srv.base_url + "/completions", json=body(i), timeout=60).json()[
                "choices"][0]["text"], range(N)))
        assert [x["response"]["body"]["choices"][0]["text"] for x in out] == alone


def test_lines_running_when_the_engine_dies_run_again_on_the_new_engine(tiny_llama, tmp_path):
    """The engine's step raises mid-batch (thread mode restarts the engine): the lines that were running get no
    answer from the dead engine (500 `engine_restarted` for an interactive call) and run again on the new one,
    so the batch completes with every line answered once, none failed, each the answer the request gets alone."""
    config = tiny_config(tiny_llama, max_num_seqs=4)
    args = ServerArgs(batch_dir=str(tmp_path / "batches"), max_engine_restarts=2)
    n = 12
    with run_server(config, args) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
        text = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                   "body": body(i)}) + "\n" for i in range(n))
        f = c.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        with slowed_steps(srv, 0.01):
            b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            deadline = time.monotonic() + 60
            while srv.scrape()["conveyor:batch_tier_seats"] < 1:  # lines are in the engine's running batch
                assert time.monotonic() < deadline
                time.sleep(0.01)
            old = srv.app.state.engine.client

            def boom():
                raise RuntimeError("injected fault")

            old.engine.step = boom
            deadline = time.monotonic() + 60
            while srv.app.state.engine.client is old or srv.app.state.engine.client is None:
                assert time.monotonic() < deadline, "the engine was not restarted"
                time.sleep(0.01)
        deadline = time.monotonic() + 90
        while (b := c.batches.retrieve(b.id)).status != "completed":
            assert time.monotonic() < deadline, b
            time.sleep(0.05)
        assert (b.request_counts.completed, b.request_counts.failed) == (n, 0), b.request_counts
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"l{i}" for i in range(n)), "every line once"
        assert srv.scrape()["conveyor:engine_restarts_total{cause=exception}"] == 1
        alone = [httpx.post(srv.base_url + "/completions", json=body(i), timeout=60).json()["choices"][0]["text"]
                 for i in range(n)]
        by_id = {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in out}
        assert [by_id[f"l{i}"] for i in range(n)] == alone
