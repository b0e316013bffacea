"""Where the engine loop runs: a thread of the server process or its own process, measured.

    python benchmarks/engine_loop.py --out docs/engine-loop.json

For each `--engine-loop` value, a fresh `conveyor serve` of SmolLM2-135M is driven by `conveyor bench
run` with 64 streaming clients over 256 random requests (prompts 128-384, outputs 64-192, greedy,
ignore_eos), then one client at a time (256-token prompt, 128 output tokens). The bench client
times `GET /health` every 0.2 s meanwhile (what a liveness probe sees under load). The modes run
one after the other, `--rounds` times in alternating order, and each number is the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from vs_vllm import REPO, cpu_flags_of_interest, drive, serve, stop, wait_ready

MODES = ("thread", "process")
LOADS = ("64 clients", "single stream")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs/engine-loop.json")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    work = args.out.parent / "engine-loop-runs"
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "servers.log", "a")
    from conveyor.kernels.variants import cpu_name

    runs: dict[str, dict[str, list[dict]]] = {m: {lab: [] for lab in LOADS} for m in MODES}
    for k in range(args.rounds):
        for mode in (MODES if k % 2 == 0 else MODES[::-1]):
            proc, url = serve("conveyor", argparse.Namespace(conveyor_args=f"--engine-loop {mode}"), log)
            try:
                wait_ready(url, proc, 600)
                for lab in LOADS:
                    runs[mode][lab].append(drive(url, lab, work / f"{mode}_{k}_{lab.replace(' ', '_')}.json", log))
            finally:
                stop(proc)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    table = {}
    for mode in MODES:
        for lab in LOADS:
            rs = runs[mode][lab]
            table[f"{mode} / {lab}"] = {
                "output_tok_s": med([r["output_throughput"] for r in rs]),
                "ttft_p50_ms": med([1000 * r["ttft_s"]["p50"] for r in rs]),
                "ttft_p99_ms": med([1000 * r["ttft_s"]["p99"] for r in rs]),
                "tpot_p50_ms": med([1000 * r["tpot_s"]["p50"] for r in rs]),
                "health_p50_ms": med([1000 * (r["engine"].get("health_latency_s") or {}).get("p50", 0) for r in rs]),
                "health_p99_ms": med([1000 * (r["engine"].get("health_latency_s") or {}).get("p99", 0) for r in rs]),
                "runs": len(rs),
            }
    print(f"\nCPU: {cpu_name()} ({os.cpu_count()} cores; {' '.join(cpu_flags_of_interest())})")
    print("| engine loop | load | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | /health p50 ms | "
          "/health p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for key, t in table.items():
        mode, lab = key.split(" / ")
        print(f"| {mode} | {lab} | {t['output_tok_s']:.1f} | {t['ttft_p50_ms']:.0f} | {t['ttft_p99_ms']:.0f} | "
              f"{t['tpot_p50_ms']:.1f} | {t['health_p50_ms']:.1f} | {t['health_p99_ms']:.1f} |")
    args.out.write_text(json.dumps({"cpu": cpu_name(), "cpu_flags": cpu_flags_of_interest(), "nproc": os.cpu_count(),
                                    "rounds": args.rounds, "table": table}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
