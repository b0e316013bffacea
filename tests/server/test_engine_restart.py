"""The engine comes back by itself: killed with SIGKILL at random points under load (its own process), or a
step that raises (in a thread of the server); what every client gets meanwhile; and a crash loop that exits.

The rules (docs/reliability.md, "When the engine dies"): a request that was running when the engine died
fails with 500 `engine_restarted` (an error event in a stream); one that had not started runs on the new
engine; a new one gets 503 `loading` with Retry-After while the engine restarts; `/health` says
`restarting` with the startup phase; `conveyor:engine_restarts_total` counts the restarts by cause; the
new engine answers exactly as a fresh server would; more than `--max-engine-restarts` deaths within
`--engine-restart-window` seconds and the server exits 1.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest

from conveyor.server.api_server import ServerArgs
from tests.engine.insides import a_kv_tensor

from .conftest import MODEL, bound_url, popen_server, run_server, server_output, slowed_steps, tiny_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process tests assume Linux")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def f(x):"]


def engine_pids(proc: subprocess.Popen) -> list[int]:
    """The server's live engine process(es): forked from its forkserver, so its grandchildren."""
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.ppid() != proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def samples(url: str, name: str) -> dict[tuple, float]:
    """The samples of metric `name`, keyed by their labels other than model_name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return out


def metric_sum(url: str, name: str) -> float:
    """The sum of `name`'s samples, read with a regex (the polling loops below run it every few ms)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def greedy(url: str, prompt: str, model: str = MODEL) -> str:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": model, "prompt": prompt, "max_tokens": 24,
                                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@dataclass
class Outcome:
    kind: str  # ok | restarted | loading | bad
    sent: float
    done: float
    detail: str = ""


def one_request(url: str, stream: bool, max_tokens: int, i: int) -> Outcome:
    """One request, judged by the rules: a complete answer (all `max_tokens` tokens, finish_reason length,
    and [DONE] for a stream), 500 engine_restarted (an error event then [DONE] in a stream), or 503 loading
    with Retry-After. Anything else (a hang, a cut stream, a short answer, another status) is "bad"."""
    body = {"model": MODEL, "prompt": f"request {i}: " + PROMPTS[i % 3], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    sent = time.monotonic()

    def verdict(kind: str, detail: str = "") -> Outcome:
        return Outcome(kind, sent, time.monotonic(), detail)

    try:
        if not stream:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            if r.status_code == 200:
                out = r.json()
                ok = out["usage"]["completion_tokens"] == max_tokens and out["choices"][0]["finish_reason"] == "length"
                return verdict("ok" if ok else "bad", r.text[:300])
            code = r.json().get("error", {}).get("code")
            if r.status_code == 500 and code == "engine_restarted":
                return verdict("restarted")
            if r.status_code == 503 and code == "loading" and r.headers.get("retry-after"):
                return verdict("loading")
            return verdict("bad", f"{r.status_code} {r.text[:300]}")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                r.read()
                code = r.json().get("error", {}).get("code")
                if r.status_code == 503 and code == "loading" and r.headers.get("retry-after"):
                    return verdict("loading")
                return verdict("bad", f"{r.status_code} {r.text[:300]}")
            lines = [line for line in r.iter_lines() if line]
        if not lines or lines[-1] != "data: [DONE]":
            return verdict("bad", f"stream without [DONE]: {lines[-3:]}")
        events = [json.loads(line[6:]) for line in lines[:-1]]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            ok = len(errors) == 1 and errors[0]["code"] == "engine_restarted" and "error" in events[-1]
            return verdict("restarted" if ok else "bad", json.dumps(errors)[:300])
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        usage = events[-1].get("usage") or {}
        ok = finish == ["length"] and usage.get("completion_tokens") == max_tokens
        return verdict("ok" if ok else "bad", f"finish {finish}, usage {usage}")
    except Exception as e:  # a timeout (a hang), a cut connection
        return verdict("bad", repr(e))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, server_output(proc)[-5000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up:\n" + server_output(proc)[-5000:]
        time.sleep(0.02)


def test_engine_process_killed_seven_times_under_load_then_a_crash_loop_exits_1(tiny_llama):
    """One server (`--engine-loop process`, 3 sequences at a time, 7 restarts allowed), 6 clients sending
    streamed and plain requests without pause, and the engine process SIGKILLed seven times at random moments
    (each once the server is back and requests are running; one of them the new engine right after a kill,
    which may still be loading: a failed start, counted like a death).
    Every request must end by the rules, requests waiting at a kill must complete on the new engine, and
    the new engine must answer as a fresh one. One more kill is a crash loop: the server exits 1."""
    kills = 7
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama), "--port", "0",
           "--kv-cache-memory", "0.01", "--max-model-len", "512", "--served-model-name", MODEL, "--dtype", "float32",
           "--engine-loop", "process", "--max-num-seqs", "3", "--max-engine-restarts", str(kills),
           "--engine-restart-window", "600", "--disable-log-requests", "--log-interval", "1000",
           "--uvicorn-log-level", "warning"]
    proc = popen_server(cmd)
    try:
        url = bound_url(proc)
        wait_healthy(url, proc)
        fresh = {p: greedy(url, p) for p in PROMPTS}  # what a fresh server answers

        stop = threading.Event()
        outcomes: list[Outcome] = []
        health: list[tuple[float, int, dict]] = []

        def client(k: int) -> None:
            rng = random.Random(k)
            i = k * 10_000
            while not stop.is_set():
                out = one_request(url, stream=rng.random() < 0.5, max_tokens=rng.randint(16, 160), i=i)
                outcomes.append(out)
                i += 1
                if out.kind == "loading":
                    time.sleep(0.05)

        def probe() -> None:
            while not stop.is_set():
                try:
                    r = httpx.get(url + "/health", timeout=5)
                    health.append((time.monotonic(), r.status_code, r.json()))
                except httpx.TransportError:
                    pass
                time.sleep(0.01)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)] + [threading.Thread(target=probe)]
        for t in threads:
            t.start()
        kill_times: list[float] = []
        rng = random.Random(48)
        served = lambda: sum(o.kind == "ok" for o in outcomes)  # noqa: E731
        served_at_kill = 0
        while len(kill_times) < kills:
            wait_healthy(url, proc, timeout=60)
            deadline = time.monotonic() + 60  # every engine serves a request before it dies, however slow the machine
            while served() <= served_at_kill:
                assert time.monotonic() < deadline, "no request completed on the new engine"
                time.sleep(0.01)
            deadline = time.monotonic() + 30
            while metric_sum(url, "conveyor:num_requests_running") < 1:  # kill under load
                assert time.monotonic() < deadline, "no request is running"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))  # a random point: prefill, decode, between steps
            victims = engine_pids(proc)
            assert len(victims) == 1, victims
            os.kill(victims[0], signal.SIGKILL)
            kill_times.append(time.monotonic())
            served_at_kill = served()
            if len(kill_times) == kills // 2:  # and the next engine at once, while it may still be loading
                deadline = time.monotonic() + 10
                while not (new := [p for p in engine_pids(proc) if p != victims[0]]):
                    assert time.monotonic() < deadline, "no new engine process"
                    time.sleep(0.002)
                os.kill(new[0], signal.SIGKILL)
                kill_times.append(time.monotonic())
            deadline = time.monotonic() + 30  # until the server has seen it (before that /health still says ok)
            while metric_sum(url, "conveyor:engine_restarts_total") < len(kill_times):
                assert time.monotonic() < deadline, "the server did not see the engine die"
                time.sleep(0.005)
        wait_healthy(url, proc, timeout=60)
        time.sleep(0.5)  # a little traffic on the last engine
        stop.set()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a client hung"

        bad = [o for o in outcomes if o.kind == "bad"]
        assert not bad, bad[:5]
        kinds = {k: sum(o.kind == k for o in outcomes) for k in ("ok", "restarted", "loading")}
        assert kinds["restarted"] >= 1 and kinds["ok"] >= kills, kinds
        # requests that were waiting when the engine died ran on the next one: sent before a kill, completed after
        spanned = [o for o in outcomes if o.kind == "ok" and any(o.sent < t < o.done for t in kill_times)]
        assert spanned, (kinds, kill_times)
        # /health said so, with the startup phase of the new engine
        restarting = [h for _, code, h in health if code == 503 and h.get("status") == "restarting"]
        assert restarting and all(h["phase"] and h["cause"] for h in restarting), health[-5:]
        restarts = samples(url, "conveyor:engine_restarts_total")
        assert sum(restarts.values()) == len(kill_times), restarts
        assert restarts.get((("cause", "SIGKILL"),), 0) >= len(kill_times) - 1, (
            restarts, [line for line in server_output(proc).splitlines() if "engine restart " in line])
        requests = samples(url, "conveyor:engine_restart_requests_total")
        assert requests[(("outcome", "requeued"),)] >= 1, requests
        assert samples(url, "conveyor:engine_alive")[()] == 1
        # no block, no request left behind; and the last engine answers exactly as the fresh one did
        deadline = time.monotonic() + 30
        while any(samples(url, f"conveyor:{m}").get((), 0) for m in ("num_requests_running", "num_requests_waiting",
                                                                    "kv_cache_blocks_used")):
            assert time.monotonic() < deadline, "the server is not idle after the load"
            time.sleep(0.05)
        assert {p: greedy(url, p) for p in PROMPTS} == fresh
        out = server_output(proc)
        assert out.count("engine restart ") == len(kill_times), out[-3000:]
        assert "(cause SIGKILL): the engine process was killed by SIGKILL" in out

        # one death more than --max-engine-restarts allows within the window: the server exits 1
        os.kill(engine_pids(proc)[0], signal.SIGKILL)
        rc = proc.wait(timeout=60)
        out = server_output(proc)
        assert rc == 1, out[-3000:]
        assert "--max-engine-restarts" in out and "exiting with code 1" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_step_that_raises_restarts_the_engine_in_a_new_thread(tiny_llama, tmp_path):
    """Thread mode: the engine's step raises; the old engine is dropped (its memory freed: nothing refers to
    it or its KV pool any more), a new one is built in a new thread with the server's runtime state (an
    adapter loaded through the API, the batching strategy switched live), the running stream gets an
    error event, the waiting requests complete, and every answer equals the first engine's."""
    from tests.lora.peft_adapters import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "rt", 4, ["q_proj", "v_proj"], seed=7)
    cfg = tiny_config(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, max_num_seqs=1)
    args = ServerArgs(allow_runtime_lora_updating=True, max_engine_restarts=2)
    with run_server(cfg, args) as srv:
        aengine = srv.app.state.engine
        r = httpx.post(srv.base_url + "/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/admin/scheduler", json={"scheduler": "priority", "priority_aging_steps": 7})
        assert r.status_code == 200, r.text
        before = {(m, p): greedy(srv.url, p, m) for m in (MODEL, "rt") for p in PROMPTS}
        assert before[(MODEL, PROMPTS[0])] != before[("rt", PROMPTS[0])]  # the adapter changes the answer

        old = aengine.client
        old_thread = old.thread
        engine_ref = weakref.ref(old.engine)
        kv_ref = weakref.ref(a_kv_tensor(old.engine))
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        results: dict[str, object] = {}

        def waiting(name: str) -> None:  # queued behind the stream (one sequence at a time)
            results[name] = client.completions.create(model=MODEL, prompt=name, max_tokens=12,
                                                      extra_body={"ignore_eos": True})

        def boom():
            raise RuntimeError("injected fault")

        with slowed_steps(srv):
            stream = client.completions.create(model=MODEL, prompt="doomed", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
            with pytest.raises(openai.APIError) as err:
                for i, _ in enumerate(stream):
                    if i == 2:
                        threads = [threading.Thread(target=waiting, args=(f"w{k}",)) for k in range(2)]
                        for t in threads:
                            t.start()
                        deadline = time.monotonic() + 10
                        while srv.scrape()["conveyor:num_requests_waiting"] < 2:
                            assert time.monotonic() < deadline
                            time.sleep(0.01)
                        old.engine.step = boom
        assert "engine_restarted" in str(err.value.body) and "injected fault" in str(err.value), err.value
        for t in threads:
            t.join(60)
        assert all(results[f"w{k}"].usage.completion_tokens == 12 for k in range(2)), results
        new = aengine.client
        assert new is not old and new.thread is not old_thread and new.thread.is_alive()
        assert new.built_on == new.stepped_on == new.thread.ident
        del old, boom
        gc.collect()
        assert engine_ref() is None and kv_ref() is None, gc.get_referrers(engine_ref())[:3] if engine_ref() else ""
        m = srv.scrape()
        assert m['conveyor:engine_restarts_total{cause=exception}'] == 1
        assert m['conveyor:engine_restart_requests_total{outcome=failed}'] == 1
        assert m['conveyor:engine_restart_requests_total{outcome=requeued}'] == 2
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert httpx.get(srv.url + "/admin/scheduler").json()["scheduler"] == "priority"
        assert new.engine.config.priority_aging_steps == 7
        assert {(m, p): greedy(srv.url, p, m) for m in (MODEL, "rt") for p in PROMPTS} == before
        srv.wait_idle()


def test_no_restarts_allowed_leaves_the_engine_dead(tiny_llama):
    """`--max-engine-restarts 0`: the first death is final (a server process would exit 1: above)."""
    with run_server(tiny_config(tiny_llama), ServerArgs(max_engine_restarts=0)) as srv:
        aengine = srv.app.state.engine
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=30)

        def boom():
            raise RuntimeError("injected fault")

        with slowed_steps(srv):
            stream = client.completions.create(model=MODEL, prompt="doomed", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
            with pytest.raises(openai.APIError, match="max-engine-restarts"):
                for i, _ in enumerate(stream):
                    if i == 2:
                        aengine.client.engine.step = boom
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(srv.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert srv.scrape()["conveyor:engine_alive"] == 0
