"""Latency tiers with request priorities: interactive requests ahead of a batch backlog.

    python benchmarks/latency_tiers.py --model smollm2-135m

A backlog of batch-tier requests (priority 10) fills the engine; interactive requests (priority 0)
arrive one every few steps. With the iteration scheduler they jump the queue (and aging keeps the
backlog moving). The same run with every priority equal is the baseline. TTFT is counted in engine
steps (exact, machine-independent) and in seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conveyor import LLM, SamplingParams
from conveyor.request import make_request


def run(llm: LLM, tiers: bool, args) -> dict[str, list[tuple[int, float]]]:
    eng = llm.engine
    eng.reset_prefix_cache()
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompt = lambda n: [rng.randrange(100, vocab) for _ in range(n)]
    batch = SamplingParams(max_tokens=args.batch_output, temperature=0, ignore_eos=True)
    inter = SamplingParams(max_tokens=args.interactive_output, temperature=0, ignore_eos=True)
    reqs: dict[str, list] = {"batch": [], "interactive": []}
    for _ in range(args.backlog):
        reqs["batch"] += eng.add_request(make_request(prompt(args.batch_input), batch, priority=10 if tiers else 0))
    added_at: dict[str, tuple[int, float]] = {}
    step = 0
    while eng.has_unfinished_requests() or len(reqs["interactive"]) < args.interactive:
        if step % args.every == 0 and len(reqs["interactive"]) < args.interactive:
            (r,) = eng.add_request(make_request(prompt(args.interactive_input), inter, priority=0))
            reqs["interactive"].append(r)
            added_at[r.request_id] = (step, time.monotonic())
        eng.step()
        step += 1
        for r in reqs["interactive"]:
            if r.first_token_time is not None and r.request_id in added_at and len(added_at[r.request_id]) == 2:
                s0, t0 = added_at[r.request_id]
                added_at[r.request_id] = (s0, t0, step - s0, r.first_token_time - t0)
    out = {"interactive": [(v[2], v[3]) for v in added_at.values()]}
    out["batch"] = [(0, r.first_token_time - r.arrival_time) for r in reqs["batch"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--backlog", type=int, default=24)
    ap.add_argument("--batch-input", type=int, default=64)
    ap.add_argument("--batch-output", type=int, default=32)
    ap.add_argument("--interactive", type=int, default=8)
    ap.add_argument("--interactive-input", type=int, default=16)
    ap.add_argument("--interactive-output", type=int, default=8)
    ap.add_argument("--every", type=int, default=6, help="steps between interactive arrivals")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, scheduler="iteration")
    print("| priorities | interactive TTFT p50 (steps) | max (steps) | p50 (s) | batch-tier TTFT p50 (s) |")
    print("|---|---|---|---|---|")
    for tiers in (False, True):
        res = run(llm, tiers, args)
        steps = [s for s, _ in res["interactive"]]
        secs = [t for _, t in res["interactive"]]
        print(f"| {'on (0 vs 10)' if tiers else 'off (all 0)'} | {statistics.median(steps):.0f} | {max(steps)} | "
              f"{statistics.median(secs):.2f} | {statistics.median(t for _, t in res['batch']):.2f} |")


if __name__ == "__main__":
    main()
