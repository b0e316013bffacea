"""One server vs Ray Serve replicas on this machine, on a multi-tenant shared-prefix load (docs/scale-out.md).

    python benchmarks/scale_out.py --out docs/scale-out/results.json [--model smollm2-135m] [--num-prompts 128]

For each setup it starts `conveyor serve` (or `--replicas N`), waits for /health, runs the project's
own HTTP benchmark client (`conveyor bench run --url`) with the same requests, reads the prefix-cache
counters and the router's decisions from /metrics, and stops the server. The workload has several
system prompts (tenants), each shared by many requests, which is what a prefix router has to sort.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.study import Server, Study, cpu_name, free_port, lab_run

SETUPS = {  # name: (what it is, flags)
    "single": ("1 server, 2 threads", []),
    "ray-1": ("1 replica on Ray, 2 CPUs", ["--replicas", "1", "--ray-address", "local", "--replica-cpus", "2"]),
    "ray-2-least-loaded": ("2 replicas, least-loaded, 1 CPU each",
                           ["--replicas", "2", "--router", "least-loaded", "--replica-cpus", "1"]),
    "ray-2-prefix-margin-8": ("2 replicas, prefix router with --router-imbalance 8, 1 CPU each",
                              ["--replicas", "2", "--router", "prefix", "--replica-cpus", "1",
                               "--router-imbalance", "8"]),
    "ray-2-prefix": ("2 replicas, prefix router (default margin: 32), 1 CPU each",
                     ["--replicas", "2", "--router", "prefix", "--replica-cpus", "1"]),
}


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            key = s.name + (f"{{reason={s.labels['reason']}}}" if "reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server process and everything under it, by role."""
    out = {"ingress/server": 0.0, "engine replicas": 0.0, "Ray's own processes": 0.0}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        role = ("ingress/server" if p.pid == pid else
                "engine replicas" if "ServeReplica" in cmd else "Ray's own processes")
        out[role] += t.user + t.system
    return out


def run_setup(name: str, args: argparse.Namespace) -> dict:
    what, extra = SETUPS[name]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # SIGTERM stops the server's own Ray instance; what is left of its session is killed after 90 s
    with Server([sys.executable, "-m", "conveyor", "serve", "--model", args.model, "--port", str(port),
                 "--disable-log-requests", "--uvicorn-log-level", "warning", "--kv-cache-memory", "1", *extra], port,
                ready_timeout=300, poll_s=0.5, stop_timeout=90) as server:
        startup = server.ready_s
        before, cpu_before = counters(url), cpu_seconds(server.pid)
        t_run = time.monotonic()
        res = lab_run(url, ["--model", args.model, "--no-progress", "--workload", "shared-prefix",
                            "--num-prefixes", str(args.num_prefixes), "--prefix-len", str(args.prefix_len),
                            "--input-len", "64", "--output-len", "64", "--num-prompts", str(args.num_prompts),
                            "--concurrency", str(args.concurrency), "--seed", "0"],
                      os.path.join(tempfile.mkdtemp(), "run.json"))
        wall = time.monotonic() - t_run
        after, cpu_after = counters(url), cpu_seconds(server.pid)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        q = delta.get("conveyor:prefix_cache_queries_total", 0.0)
        row = {
            "setup": name, "what": what, "flags": extra, "startup_s": round(startup, 1),
            "output_tok_s": res["output_throughput"], "ttft_p50_ms": 1000 * res["ttft_s"]["p50"],
            "ttft_p99_ms": 1000 * res["ttft_s"]["p99"], "tpot_p50_ms": 1000 * res["tpot_s"]["p50"],
            "prefix_hit_rate": delta.get("conveyor:prefix_cache_hits_total", 0.0) / q if q else None,
            "cpu_cores_used": {k: round((cpu_after[k] - cpu_before[k]) / wall, 2) for k in cpu_after},
            "routed": {k.split("reason=")[1].rstrip("}"): v for k, v in delta.items()
                       if k.startswith("conveyor:router_requests_total{")},
        }
        print(json.dumps(row), flush=True)
        return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="scale-out.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated names from SETUPS")
    args = p.parse_args()
    study = Study()
    rows = [run_setup(name, args) for name in args.setups.split(",")]
    study.write(args.out, {"cpu": f"{cpu_name()}, {os.cpu_count()} CPUs", "args": vars(args), "rows": rows})



if __name__ == "__main__":
    main()
