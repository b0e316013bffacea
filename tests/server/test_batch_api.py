"""The Batch API with the official `openai` client on one real server (tiny model): files, batches, answers equal
to the same requests sent one by one (errors included), tenancy, limits, cancel, expiry, metrics, the dashboard,
the interactive queue limits, and `conveyor batch run` giving the same answers offline."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx
import openai
import pytest

from conveyor.server.api_server import ServerArgs

from .conftest import MAX_MODEL_LEN, MODEL, run_server, slowed_steps, tiny_config
from .test_dashboard import read_events

KEYS = ("key-a", "key-b")
MAX_LINES = 40


@pytest.fixture(scope="module")
def srv(tiny_llama, tmp_path_factory):
    args = ServerArgs(api_key=",".join(KEYS), batch_dir=str(tmp_path_factory.mktemp("batches")),
                      batch_max_file_bytes=64 * 1024, batch_max_lines=MAX_LINES, max_queued_requests=4,
                      batch_max_inflight=16)
    # batch lines get whole steps 0.2 s after interactive work (the rule is the scheduler's: tests/scheduler)
    with run_server(tiny_config(tiny_llama, max_num_seqs=8, batch_tier_quiet_s=0.2), args) as s:
        yield s


def client_for(srv, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture()
def client(srv):
    with client_for(srv) as c:
        yield c


def jsonl(lines: list) -> bytes:
    return ("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n").encode()


def line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def chat_body(i: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"tell me about item {i}"}], "max_tokens": 6,
            "temperature": 0, **extra}


def wait_for(client, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"), timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.05)


def run_batch(client, lines: list, endpoint: str = "/v1/chat/completions", **kw):
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)
    assert b.status == "validating" and b.request_counts.total == len(lines)
    return f, wait_for(client, b.id)


def read_lines(client, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def direct(srv, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(srv.base_url + path, json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60)
    return r.status_code, r.json()


def same_answer(a: dict, b: dict) -> None:
    """Two answers of one endpoint, ids, timestamps and prefix-cache hits aside."""

    def kept(x: dict) -> dict:
        usage = {k: v for k, v in (x.get("usage") or {}).items() if k != "prompt_tokens_details"}
        return {**{k: v for k, v in x.items() if k not in ("id", "created")}, "usage": usage}

    assert kept(a) == kept(b)


def test_a_batch_answers_each_line_as_its_endpoint_would(srv, client):
    """Valid lines are answered as the same requests sent one by one (greedy); each bad line goes to the error file
    with the error its endpoint gives (bad sampling, unknown model, over the context), or a 400 naming what is wrong
    with the line itself, and never stops the others."""
    valid = [line(f"r{i}", "/v1/chat/completions", chat_body(i)) for i in range(6)]
    bad = [line("bad-temperature", "/v1/chat/completions", chat_body(0, temperature=-1)),
           line("unknown-model", "/v1/chat/completions", {**chat_body(1), "model": "no-such-model"}),
           line("too-long", "/v1/chat/completions", chat_body(2, max_tokens=MAX_MODEL_LEN)),
           line("wrong-url", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
           line("unknown-url", "/v1/images/generations", {"prompt": "a cat"}),
           line("streams", "/v1/chat/completions", chat_body(3, stream=True)),
           line("r0", "/v1/chat/completions", chat_body(0)),  # a second r0
           "{not json",
           json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": chat_body(4)})]  # no custom_id
    lines = valid[:3] + bad + valid[3:]
    f, b = run_batch(client, lines, metadata={"job": "nightly"})
    assert b.status == "completed" and b.metadata == {"job": "nightly"}
    assert (b.request_counts.completed, b.request_counts.failed, b.request_counts.total) == (6, len(bad), len(lines))
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.input_file_id == f.id
    assert b.usage.output_tokens == 6 * 6 and b.usage.input_tokens > 0

    out = read_lines(client, b.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(6)]
    assert len({x["id"] for x in out}) == 6 and all(x["error"] is None for x in out)
    for x, ln in zip(out, valid):
        assert x["response"]["status_code"] == 200
        status, alone = direct(srv, "/chat/completions", ln["body"])
        assert status == 200
        same_answer(x["response"]["body"], alone)
        assert x["response"]["request_id"] == x["response"]["body"]["id"]

    errs = {(x["custom_id"], x["response"]["body"]["error"]["param"]): x["response"] for x in
            read_lines(client, b.error_file_id)}
    assert len(errs) == len(bad)
    for cid, body in (("bad-temperature", bad[0]["body"]), ("unknown-model", bad[1]["body"]),
                      ("too-long", bad[2]["body"])):
        status, alone = direct(srv, "/chat/completions", body)
        assert status in (400, 404)
        (resp,) = [r for (c, _), r in errs.items() if c == cid]
        assert (resp["status_code"], resp["body"]) == (status, alone), cid
    params = {c: p for c, p in errs}
    assert params["wrong-url"] == "url" and params["unknown-url"] == "url" and params["streams"] == "stream"
    assert (("r0", "custom_id") in errs and (None, None) in errs and (None, "custom_id") in errs)
    # lines that are not requests at all are also in the batch's own errors, by line number
    assert [e.line for e in b.errors.data] == list(range(3 + 3 + 1, 3 + len(bad) + 1))
    assert srv.scrape()["conveyor:batch_lines_total{status=failed}"] >= len(bad)


def test_completions_and_embeddings_batches(srv, client):
    prompts = ["the cat", "the dog", "a tree"]
    cmpl = [line(f"c{i}", "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 5, "temperature": 0,
                                              "n": 1 + i % 2}) for i, p in enumerate(prompts)]
    _, b = run_batch(client, cmpl, "/v1/completions")
    assert b.request_counts.completed == 3 and b.error_file_id is None
    for x, ln in zip(read_lines(client, b.output_file_id), cmpl):
        same_answer(x["response"]["body"], direct(srv, "/completions", ln["body"])[1])
    emb = [line(f"e{i}", "/v1/embeddings", {"model": MODEL, "input": [p, p + " again"]}) for i, p in enumerate(prompts)]
    _, b = run_batch(client, emb, "/v1/embeddings")
    assert b.request_counts.completed == 3
    for x, ln in zip(read_lines(client, b.output_file_id), emb):
        got, alone = x["response"]["body"], direct(srv, "/embeddings", ln["body"])[1]
        for g, a in zip(got["data"], alone["data"]):
            assert g["embedding"] == pytest.approx(a["embedding"], abs=1e-6)
        assert got["usage"] == alone["usage"]


def test_files(srv, client):
    content = jsonl([line("x", "/v1/completions", {"model": MODEL, "prompt": "hi"})])
    ids = [client.files.create(file=(f"f{i}.jsonl", content), purpose="batch").id for i in range(3)]
    got = client.files.retrieve(ids[0])
    assert (got.filename, got.bytes, got.purpose, got.object) == ("f0.jsonl", len(content), "batch", "file")
    assert client.files.content(ids[1]).content == content
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    assert client.files.list(limit=2, after=ids[1]).data[0].id == ids[0]
    assert {f.id for f in client.files.list(limit=1, purpose="batch").iter_pages() for f in f.data} >= set(ids)
    with client_for(srv, KEYS[1]) as other:  # another key sees none of them
        assert ids[0] not in {f.id for f in other.files.list()}
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):
            other.files.delete(ids[0])
    assert client.files.delete(ids[2]).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[2])


@pytest.mark.parametrize("content,status,says", [
    (b"\xff\xfe not text at all", 400, "UTF-8"),
    (b"just some words\nand more words\n", 400, "not JSONL"),
    (b"\n\n", 400, "empty"),
    (jsonl(["{}"] * (MAX_LINES + 1)), 400, "--batch-max-lines"),
    (b"{}\n" * (64 * 1024 // 3 + 1), 413, "--batch-max-file-bytes"),
])
def test_uploads_that_are_refused(client, content, status, says):
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("f.jsonl", content), purpose="batch")
    assert e.value.status_code == status and says in e.value.message


def test_upload_checks(srv, client):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("f.jsonl", b"{}\n"), purpose="fine-tune")
    service = srv.app.state.batch
    used = service.store.disk_bytes()
    service.max_disk_bytes = used + 100
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("f.jsonl", b'{"a": 1}\n' * 20), purpose="batch")
        assert e.value.status_code == 413 and "--batch-max-disk-bytes" in e.value.message
    finally:
        service.max_disk_bytes = 10 * 2**30
    r = httpx.post(srv.base_url + "/files", headers={"Authorization": f"Bearer {KEYS[0]}"}, json={"purpose": "batch"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    assert httpx.post(srv.base_url + "/files", files={"file": b"{}"}, data={"purpose": "batch"}).status_code == 401


def test_batch_creation_checks_and_listing(srv, client):
    f = client.files.create(file=("in.jsonl", jsonl([line("a", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                                                      "max_tokens": 2})])),
                            purpose="batch")
    for kw, param in (({"endpoint": "/v1/moderations"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                      ({"metadata": {"k": "v" * 600}}, "metadata"), ({"input_file_id": "file-nope"}, "input_file_id")):
        args = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h", **kw}
        with pytest.raises(openai.APIStatusError) as e:
            client.batches.create(**args)
        assert e.value.body["param"] == param
    made = [client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
            for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    assert made[0] in [b.id for b in client.batches.list(limit=2, after=made[1]).data]
    assert set(made) <= {b.id for b in client.batches.list(limit=1)}  # the client follows the pages
    with client_for(srv, KEYS[1]) as other:
        assert not set(made) & {b.id for b in other.batches.list()}
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(made[0])
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(made[0])
    for bid in made:
        wait_for(client, bid)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(made[0])


def long_lines(n: int, max_tokens: int = 200) -> list[dict]:
    return [line(f"l{i}", "/v1/completions", {"model": MODEL, "prompt": f"line {i} " * 4, "max_tokens": max_tokens,
                                              "ignore_eos": True, "temperature": 0}) for i in range(n)]


def test_interactive_requests_beside_a_running_batch(srv, client):
    """Batch lines fill every seat and wait in the engine past --max-queued-requests (4): interactive requests are
    neither refused (429) nor kept waiting for the batch; the batch tier's seats show in /metrics and on the
    dashboard with its progress. Then a cancel is prompt: lines in flight are aborted, the answers so far kept."""
    with slowed_steps(srv, 0.01):
        f = client.files.create(file=("long.jsonl", jsonl(long_lines(24))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while True:
            m = srv.scrape()
            if m["conveyor:batch_tier_seats"] == 8 and m["conveyor:batch_tier_waiting"] >= 5:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        assert 8 < m["conveyor:batch_queue_depth"] <= 24 and m["conveyor:batch_lines_in_flight"] == 16
        for i in range(6):  # more than the interactive queue limit, one after another and all at once
            r = client.completions.create(model=MODEL, prompt=f"quick {i}", max_tokens=3)
            assert r.choices[0].finish_reason in ("stop", "length")
        events = read_events(dataclasses.replace(srv, api_key=KEYS[0]),
                             lambda evs: any("batch" in e and e["batch"]["batches"] for e in evs))
        view = [e for e in events if "batch" in e][-1]
        assert view["batch"]["batches"][0]["id"] == b.id and view["batch"]["in_flight"] == 16
        assert any(e.get("snapshot", {}).get("batch_tier", {}).get("running") for e in events)
        assert client.batches.retrieve(b.id).status == "in_progress"
        t0 = time.monotonic()
        assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
        b = wait_for(client, b.id, timeout=10)
        assert b.status == "cancelled" and time.monotonic() - t0 < 5
    srv.wait_idle()
    out = read_lines(client, b.output_file_id)
    assert len(out) == b.request_counts.completed < 24


def test_an_expired_batch_writes_what_never_ran_as_batch_expired(srv, client):
    with slowed_steps(srv, 0.01):
        f = client.files.create(file=("long.jsonl", jsonl(long_lines(20, 100))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(client, b.id, ("in_progress",))
        loop = srv.app.state.engine.loop
        loop.call_soon_threadsafe(srv.app.state.batch.runner.expire, b.id)
        b = wait_for(client, b.id, timeout=10)
    assert b.status == "expired" and b.expired_at
    expired = [x for x in read_lines(client, b.error_file_id) if x["error"]]
    assert expired and all(x["error"]["code"] == "batch_expired" and x["response"] is None for x in expired)
    answered = {x["custom_id"] for x in read_lines(client, b.output_file_id)}
    assert answered.isdisjoint(x["custom_id"] for x in expired)
    assert len(answered) + len(expired) == 20 == b.request_counts.total
    assert srv.scrape()["conveyor:batch_lines_total{status=expired}"] >= len(expired)
    srv.wait_idle()


def test_the_offline_run_gives_the_servers_answers(srv, client, tiny_llama, tmp_path):
    """`conveyor batch run` on the same file: the same answers (greedy), errors included, in input order."""
    from conveyor.cli import main

    lines = [line(f"r{i}", "/v1/chat/completions", chat_body(i, max_tokens=8)) for i in range(4)]
    lines.insert(2, line("bad", "/v1/chat/completions", chat_body(0, top_p=7)))
    _, b = run_batch(client, lines)
    served = {x["custom_id"]: x["response"] for x in read_lines(client, b.output_file_id)
              + read_lines(client, b.error_file_id)}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(jsonl(lines))
    assert main(["batch", "run", str(src), "-o", str(dst), "--model", str(tiny_llama), "--served-model-name", MODEL,
                 "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                 "--kv-cache-memory", "0.02", "--no-progress"]) == 0
    offline = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [x["custom_id"] for x in offline] == [ln["custom_id"] for ln in lines]
    for x in offline:
        mine, theirs = x["response"], served[x["custom_id"]]
        assert mine["status_code"] == theirs["status_code"]
        if mine["status_code"] == 200:
            same_answer(mine["body"], theirs["body"])
        else:
            assert mine["body"] == theirs["body"]


def test_lines_run_in_the_batch_tier(srv, client, monkeypatch):
    """What the scheduler gets from a batch line: the batch tier, no latency targets, the body's user as tenant."""
    from conveyor.request import Tier
    from conveyor.scheduler.core import Scheduler

    seen = []
    real = Scheduler.add

    def add(self, req):
        seen.append((req.tier, req.tenant, req.slo_ttft_s, req.priority))
        return real(self, req)

    monkeypatch.setattr(Scheduler, "add", add)
    run_batch(client, [line("t", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u1",
                                                     "slo_ttft_ms": 100, "priority": 2})], "/v1/completions")
    assert seen == [(Tier.BATCH, "u1", None, 2)]
