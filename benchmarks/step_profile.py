"""Time and profile the engine's steps on a steady decode batch: the hot path in isolation.

    python benchmarks/step_profile.py --running 64 --context 280 --steps 10 [--profile]

Fills the engine with `--running` requests whose prompts are `--context` tokens long, lets every
prompt prefill, then times `--steps` decode steps. With `--profile` it prints torch.profiler's top
operators for those steps. Prints the step's split into schedule / prepare / forward / sample /
update as the engine measures it.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto", help="auto | kernel | torch (the reference path)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from conveyor import SamplingParams
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.request import make_request

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(args.running, 1),
                                    kv_cache_memory=2.0, attention_backend=args.attention))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    for _ in range(args.running):
        engine.add_request(make_request([rng.randrange(100, vocab) for _ in range(args.context)], params))
    t0 = time.perf_counter()
    while (stats := engine.step().stats) is not None and stats.num_prefill_tokens:  # until the prompts are in
        pass
    prefill_s = time.perf_counter() - t0
    engine.step()  # warm-up decode
    before = dict(engine.phase_seconds)
    t0 = time.perf_counter()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
    else:
        for _ in range(args.steps):
            engine.step()
    dt = (time.perf_counter() - t0) / args.steps
    spent = {k: v - before[k] for k, v in engine.phase_seconds.items()}
    print(f"{engine.info.torch_dtype} threads={torch.get_num_threads()} running={engine.num_running} "
          f"context~{args.context}: prefill {prefill_s:.2f}s ({args.running * args.context / prefill_s:.0f} tok/s), "
          f"decode step {dt * 1e3:.1f} ms ({engine.num_running / dt:.0f} tok/s)")
    total = sum(spent.values())
    print("step split: " + ", ".join(f"{k} {1e3 * v / args.steps:.2f} ms ({100 * v / total:.1f}%)"
                                      for k, v in spent.items()))
    if args.profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
