"""Served speed of quantized weights and of the int8 KV cache, every configuration in one run.

    python benchmarks/quantization_speed.py --out docs/quantization/speed.json

Each configuration is a fresh `conveyor serve` of SmolLM2-135M driven by `conveyor bench run` (token-id
prompts, streaming, greedy, ignore_eos), one server after the other on the same machine:
- weights bf16 / int8 / int4 / w8a8 (`--weights` picks some): a single stream (256-token prompt, 128
  output tokens, 6 requests) and 64 concurrent clients (256 requests, prompts 128-384, outputs 64-192);
- the same weights, single stream only, `--single-rounds` rounds in rotating order (each
  server warmed by one unmeasured single-stream pass first): the medians are the single-stream table;
- KV bf16 / int8 under a small pool (`--kv-cache-memory`, default 0.15 GiB: about 7k bf16 tokens
  for 64 clients that would hold ~29k), the same 64-client load: the KV-bound case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vs_vllm import REPO, cpu_flags_of_interest, drive, serve, stop, wait_ready

WEIGHTS = {"bf16": "", "int8": "--quantization int8", "int4": "--quantization int4",
           "w8a8": "--quantization int8_per_channel"}


def run_server(flags: str, loads: list[str], work: Path, tag: str, log) -> dict:
    args = argparse.Namespace(conveyor_args=flags)
    proc, url = serve("conveyor", args, log)
    try:
        wait_ready(url, proc, 600)
        return {lab: drive(url, lab, work / f"{tag}_{lab.replace(' ', '_')}.json", log) for lab in loads}
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs/quantization/speed.json")
    ap.add_argument("--kv-memory", type=float, default=0.15, help="GiB for the KV-bound runs")
    ap.add_argument("--parts", default="weights,kv,single")
    ap.add_argument("--single-rounds", type=int, default=3)
    ap.add_argument("--weights", default=",".join(WEIGHTS), help="which weight configurations (bf16 first)")
    args = ap.parse_args()
    for name in [w for w in WEIGHTS if w not in args.weights.split(",")]:
        del WEIGHTS[name]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / "runs"
    work.mkdir(exist_ok=True)
    log = open(work / "servers.log", "a")
    from conveyor.kernels.variants import cpu_name
    res: dict = {"cpu": cpu_name(), "cpu_flags": cpu_flags_of_interest(), "nproc": os.cpu_count(),
                 "weights": {}, "kv": {}, "kv_cache_memory_gib": args.kv_memory}
    parts = args.parts.split(",")
    if "weights" in parts:
        for name, flags in WEIGHTS.items():
            res["weights"][name] = run_server(flags, ["64 clients", "single stream"], work, f"w_{name}", log)
    if "kv" in parts:
        for name, flags in {"bf16": "", "int8": "--kv-cache-dtype int8"}.items():
            f = f"--kv-cache-memory {args.kv_memory} {flags}"
            res["kv"][name] = run_server(f, ["64 clients"], work, f"kv_{name}", log)
            blocks = None
            for line in (work / "servers.log").read_text().splitlines()[::-1]:
                if "KV cache:" in line and " blocks of " in line:
                    blocks = int(line.split(" blocks of ")[0].rsplit(" ", 1)[1])
                    break
            res["kv"][name]["kv_blocks"] = blocks
    if "single" in parts:
        names = list(WEIGHTS)
        res["single_rounds"] = {n: [] for n in names}
        for k in range(args.single_rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                r = run_server(WEIGHTS[name], ["single stream", "single stream"], work, f"s{k}_{name}", log)
                res["single_rounds"][name].append(r["single stream"])  # the second pass (same file name)
    print(f"\nCPU: {res['cpu']} ({os.cpu_count()} cores; {' '.join(res['cpu_flags'])})")
    if res["weights"]:
        print("\n| weights | load | output tok/s | TTFT p50 ms | TPOT p50 ms | vs bf16 |")
        print("|---|---|---|---|---|---|")
        for lab in ("single stream", "64 clients"):
            base = res["weights"]["bf16"][lab]["output_throughput"]
            for name, per in res["weights"].items():
                r = per[lab]
                print(f"| {name} | {lab} | {r['output_throughput']:.1f} | {1000 * r['ttft_s']['p50']:.0f} | "
                      f"{1000 * r['tpot_s']['p50']:.1f} | {r['output_throughput'] / base:.2f}x |")
    if res.get("single_rounds"):
        import statistics

        print(f"\nSingle stream, median of {args.single_rounds} rounds (each server warmed by one pass)")
        print("| weights | output tok/s | TPOT p50 ms | vs bf16 |")
        print("|---|---|---|---|")
        med = {n: statistics.median(r["output_throughput"] for r in rs) for n, rs in res["single_rounds"].items()}
        for n, rs in res["single_rounds"].items():
            tpot = statistics.median(1000 * r["tpot_s"]["p50"] for r in rs)
            print(f"| {n} | {med[n]:.1f} | {tpot:.1f} | {med[n] / med['bf16']:.2f}x |")
    if res["kv"]:
        print(f"\nKV-bound, --kv-cache-memory {args.kv_memory} GiB, 64 clients")
        print("| KV dtype | blocks | output tok/s | TTFT p50 ms | TPOT p50 ms | vs bf16 |")
        print("|---|---|---|---|---|---|")
        base = res["kv"]["bf16"]["64 clients"]["output_throughput"]
        for name, per in res["kv"].items():
            r = per["64 clients"]
            print(f"| {name} | {per['kv_blocks']} | {r['output_throughput']:.1f} | {1000 * r['ttft_s']['p50']:.0f} | "
                  f"{1000 * r['tpot_s']['p50']:.1f} | {r['output_throughput'] / base:.2f}x |")
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
