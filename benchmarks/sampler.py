"""How long `sample()` takes for one step's rows, compiled kernel vs the pure-torch reference.

    python benchmarks/sampler.py [--rows 64,1] [--vocab 49152] [--threads 2]

Random logits of SmolLM2's vocabulary (N(0, 3^2)), the sampling modes users send: greedy, the model's
defaults (temperature 0.2, top_p 0.9), vLLM's default (temperature 1), top-k 50, and all cut-offs at
once. Best of 20 calls each, the two implementations interleaved so that a noisy moment hits both.
"""

from __future__ import annotations

import argparse
import os

import torch

from conveyor.bench.study import best_ms, cpu_name
from conveyor.request import Request
from conveyor.runner.sampler import sample
from conveyor.sampling_params import SamplingParams

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.2, top_p 0.9": dict(temperature=0.2, top_p=0.9),
    "temperature 1": dict(temperature=1.0),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 40, top_p 0.8, min_p 0.05": dict(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,1")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_name()}, {args.threads} threads, vocabulary {args.vocab}\n")
    print("| rows | sampling | kernel ms | torch reference ms | reference / kernel |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab) * 3
        for mode, kw in MODES.items():
            reqs = [Request(f"r{i}", [1], SamplingParams(**kw)) for i in range(rows)]
            times = {}
            for impl in ("auto", "torch") * 2:  # interleaved, best of both rounds
                os.environ["CONVEYOR_SAMPLER"] = impl
                t = best_ms(lambda lg=logits, rq=reqs: sample(lg, rq), n=10)  # these params leave lg as it is
                times[impl] = min(times.get(impl, t), t)
            print(f"| {rows} | {mode} | {times['auto']:.2f} | {times['torch']:.2f} | "
                  f"{times['torch'] / times['auto']:.1f}x |", flush=True)
    os.environ.pop("CONVEYOR_SAMPLER", None)


if __name__ == "__main__":
    main()
