"""How long the server takes to serve again after its engine died, against how long it takes to start.

    python benchmarks/engine_restart.py --model smollm2-135m --kills 5 --out docs/engine-restart.json
    python benchmarks/engine_restart.py --model tiny --kills 5      # the tests' tiny random Llama

For each loop mode:
- `process`: a `conveyor serve --engine-loop process` subprocess; its start is timed from the Popen to
  the first `/health` 200; then its engine process is SIGKILLed `--kills` times, each once the server is
  idle and healthy, and each restart is timed from the kill to the next `/health` 200 (polled every 5 ms);
- `thread`: a `conveyor serve` subprocess (the default thread loop) for the start; the restart, which in
  this mode follows a step that raises (a kill would take the whole server), is timed on a server run in
  this process (as the tests run theirs), from the request whose step raises to `/health` 200.
After each restart one greedy request checks the new engine answers as the first one did. Extra server
flags go after `--`. Prints one JSON object (and writes it to `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from conveyor.bench.study import Server, Study, wait_health  # noqa: E402

POLL_S = 0.005  # /health's polling: restarts are timed to a few ms


def greedy(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"model": model, "prompt": "The capital of France is",
                                                               "max_tokens": 16, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def serve(model: str, name: str, mode: str, extra: list[str], log) -> tuple[Server, str, float]:
    """A `conveyor serve` subprocess on a free port: (server, url, seconds from its start to /health 200)."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", model, "--served-model-name", name, "--port", "0",
           "--engine-loop", mode, "--disable-log-requests", *extra]
    server = Server(cmd, 0, cwd=REPO, poll_s=POLL_S).up()
    log.write(f"{mode}: {server.log_path}\n")
    return server, server.url, server.ready_s


def restarts_seen(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("conveyor:engine_restarts_total{"))


def engine_pid(server: Server) -> int:
    kids = [p for p in psutil.Process(server.pid).children(recursive=True)
            if p.ppid() != server.pid and p.status() != psutil.STATUS_ZOMBIE]
    assert len(kids) == 1, kids
    return kids[0].pid


def process_mode(model: str, name: str, kills: int, extra: list[str], log) -> dict:
    server, url, start_s = serve(model, name, "process", extra, log)
    try:
        first = greedy(url, name)
        restarts = []
        for k in range(kills):
            os.kill(engine_pid(server), signal.SIGKILL)
            t0 = time.monotonic()
            while restarts_seen(url) <= k:  # until the server has seen it (/health says ok until then)
                time.sleep(0.001)
            restarts.append(wait_health(url, server.proc, poll_s=POLL_S) - t0)
            assert greedy(url, name) == first, "the new engine answered differently"
        return {"start_s": round(start_s, 2), "restart_s": [round(x, 2) for x in restarts],
                "restart_median_s": round(statistics.median(restarts), 2)}
    finally:
        server.stop()


def thread_mode(model: str, name: str, kills: int, extra: list[str], log) -> dict:
    server, url, start_s = serve(model, name, "thread", extra, log)
    server.stop()
    from conveyor.cli import build_parser
    from conveyor.engine.args import engine_config_from_args
    from conveyor.server.api_server import ServerArgs, build_app
    from conveyor.server.launch import GracefulServer, bind_listen_socket

    ns = build_parser().parse_args(["serve", "--model", model, "--served-model-name", name, *extra])
    cfg = engine_config_from_args(ns, {"kv_cache_populate": True}, served_model_name=name)
    sock = bind_listen_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = build_app(cfg, ServerArgs(max_engine_restarts=kills + 1))
    uv = GracefulServer(app, grace_s=1.0, log_level="warning")
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    wait_health(url, poll_s=POLL_S)
    aengine = app.state.engine
    try:
        first = greedy(url, name)
        restarts = []
        for k in range(kills):
            def boom():
                raise RuntimeError("injected fault")

            aengine.client.engine.step = boom
            t0 = time.monotonic()
            threading.Thread(target=httpx.post, args=(url + "/v1/completions",), daemon=True,
                             kwargs={"timeout": 60, "json": {"model": name, "prompt": "x", "max_tokens": 2}}).start()
            while aengine.restarts <= k:  # until the server has seen it
                time.sleep(0.001)
            restarts.append(wait_health(url, poll_s=POLL_S) - t0)
            assert greedy(url, name) == first, "the new engine answered differently"
        return {"start_s": round(start_s, 2), "restart_s": [round(x, 2) for x in restarts],
                "restart_median_s": round(statistics.median(restarts), 2)}
    finally:
        uv.should_exit = True
        th.join(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model name or path; 'tiny': the tests' random Llama")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--modes", default="process,thread")
    ap.add_argument("--out", type=Path)
    ap.add_argument("extra", nargs="*", help="more `conveyor serve` flags (after --)")
    args = ap.parse_args()
    study = Study()
    model, name, extra = args.model, args.model, list(args.extra)
    if model == "tiny":
        from tests.conftest import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
        extra = ["--dtype", "float32", "--kv-cache-memory", "0.01", "--max-model-len", "512", *extra]
    log = sys.stderr
    result = {"model": name, "extra": extra, "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg()}
    for mode in args.modes.split(","):
        result[mode] = (process_mode if mode == "process" else thread_mode)(model, name, args.kills, extra, log)
        print(mode, json.dumps(result[mode]), file=sys.stderr, flush=True)
    result["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.out:
        study.write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
