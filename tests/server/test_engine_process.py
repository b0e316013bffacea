"""The server with its engine loop in its own process (`--engine-loop process`): streaming, abort on
disconnect freeing blocks, a stream error and a new engine process once the engine process is killed
(many kills under load: test_engine_restart.py), and a clean exit on SIGTERM that leaves no engine
process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from .conftest import MODEL, bound_url, popen_server, server_output

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process tests assume Linux")


def start(tiny_llama, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama), "--port", "0",
           "--kv-cache-memory", "0.01", "--max-model-len", "512", "--served-model-name", MODEL, "--dtype", "float32",
           "--engine-loop", "process", "--shutdown-timeout", "0.5", "--log-interval", "1", *extra]
    proc = popen_server(cmd)
    url = bound_url(proc)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, server_output(proc)
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


def engine_children(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the server started for its engine: the forkserver (`engine/clients.process_context`) and
    the engine process forked from it (not multiprocessing's resource tracker)."""
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [k for k in kids if "resource_tracker" not in " ".join(k.cmdline())]


def engine_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The engine process(es) themselves: forked by the forkserver, so the server's grandchildren."""
    return [k for k in engine_children(proc) if k.ppid() != proc.pid and k.status() != psutil.STATUS_ZOMBIE]


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                total, found = total + smp.value, True
    if not found:
        raise KeyError(name)
    return total


def dump_stacks(proc: subprocess.Popen, engines: list[psutil.Process]) -> None:
    """SIGUSR1 to the server, then to each engine process, each once the previous dump is in the log:
    every thread's stack, in every process, one dump after the other."""
    for p in [proc, *engines]:
        done = server_output(proc).count("Current thread") + 1
        os.kill(p.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while server_output(proc).count("Current thread") < done and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)  # the dump's last lines, after the "Current thread" header


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_stream_abort_and_engine_death(tiny_llama):
    proc, url = start(tiny_llama)
    try:
        engines = engine_processes(proc)
        assert len(engines) == 1 and engines[0].pid != proc.pid, "the engine runs in a process of its own"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        # streaming works across the process boundary, and matches the non-streaming answer
        chunks = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        whole = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert "".join(chunks) == whole.choices[0].text and whole.usage.completion_tokens == 12
        # a grammar crosses the process boundary (the engine process compiles its own matcher)
        # (a longer timeout: the first grammar builds llguidance's view of the tokenizer in the child)
        try:
            r = client.with_options(timeout=120).completions.create(
                model=MODEL, prompt="n:", max_tokens=20, temperature=1.0, seed=4,
                extra_body={"guided_regex": "[0-9]{4}"})
        except openai.APITimeoutError:  # seen twice in ~30 suite runs on a loaded machine: keep the evidence
            dump_stacks(proc, engine_processes(proc))
            pytest.fail("the grammar request timed out; server output with the stacks:\n"
                        + server_output(proc)[-12000:])
        assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()
        # a client that disconnects mid-stream: its sequence is aborted and its blocks are freed
        before = metric(url, "conveyor:request_success_total", finished_reason="abort")
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "leave early", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
        deadline = time.monotonic() + 10
        while not (metric(url, "conveyor:kv_cache_blocks_used") == 0
                   and metric(url, "conveyor:num_requests_running") == 0):
            assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
            time.sleep(0.05)
        after = metric(url, "conveyor:request_success_total", finished_reason="abort")
        assert after == before + 1
        # kill the engine process under an open stream: the stream gets an error naming the cause, and a new
        # engine process serves
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={"prompt": "doomed", "max_tokens": 480, "ignore_eos": True,
                                    "stream": True}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 10
        while metric(url, "conveyor:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(engines[0].pid, signal.SIGKILL)
        t.join(15)
        assert not t.is_alive(), "the open stream hung after the engine died"
        errors = [json.loads(line[6:])["error"] for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["code"] == "engine_restarted" and "SIGKILL" in errors[0]["message"], lines[-3:]
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, server_output(proc)[-3000:]
            time.sleep(0.05)
        again = engine_processes(proc)
        assert len(again) == 1 and again[0].pid != engines[0].pid
        assert client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text == whole.choices[0].text
        assert metric(url, "conveyor:engine_alive") == 1
        assert metric(url, "conveyor:engine_restarts_total", cause="SIGKILL") == 1
    finally:
        stop(proc)


def test_sigterm_stops_both_processes(tiny_llama):
    proc, url = start(tiny_llama)
    try:
        engines = engine_children(proc)
        assert engines
        # SIGUSR1 writes every thread's stack to the log, in the server and in the engine process, and
        # both keep running (what a stuck server is asked for before it is killed). One at a time: both
        # write to the same log, and two dumps at once interleave. (Not the forkserver: it has no handler.)
        dump_stacks(proc, engine_processes(proc))
        out = server_output(proc)
        assert "in run_server" in out and "in _process_main" in out, out[-3000:]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        out = server_output(proc)
        assert rc == 0, out
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, f"engine process left behind: {alive}"
    finally:
        stop(proc)
