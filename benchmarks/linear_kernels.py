"""oneDNN against our AVX-512 BF16 linear kernel, inside the engine: decode steps of SmolLM2 in bf16.

    python benchmarks/linear_kernels.py [--running 1,64] [--context 280] [--rounds 6]

Two engines in one process, identical but for the kernel behind their bf16 linears; their decode steps
are timed in alternating rounds, so a noisy moment of this shared machine hits both alike. Prints the
median step time of each and the ratio, and checks that both kernels produced the same greedy tokens
at one running request (they need not: both round differently from each other; it is reported).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def build(kernel: str, running: int, context: int, steps: int):
    from conveyor import SamplingParams
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.model import packed_linear
    from conveyor.request import make_request

    packed_linear._LINEAR_KERNEL = kernel  # what linear_kernel() would have measured, forced for this engine
    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", max_num_seqs=max(running, 1),
                                    kv_cache_memory=1.0))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for _ in range(running):
        engine.add_request(make_request([rng.randrange(100, vocab) for _ in range(context)], params))
    while (stats := engine.step().stats) is not None and stats.num_prefill_tokens:  # until the prompts are in
        pass
    engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", default="1,64")
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    args = ap.parse_args()
    from conveyor import kernels
    k = kernels.load()
    if k is None or not k.linear_bf16_available():
        raise SystemExit("this CPU or build has no AVX-512 BF16 kernel: nothing to compare")
    from conveyor.kernels import cpu_flags
    print("CPU flags:", " ".join(f for f in cpu_flags().split() if f.startswith(("avx512_bf16", "amx"))) or "-",
          f"threads={torch.get_num_threads()}")
    for running in [int(x) for x in args.running.split(",")]:
        steps = args.rounds * args.steps_per_round
        engines = {name: build(name, running, args.context, steps) for name in ("onednn", "dpbf16")}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, e in engines.items():
                for _ in range(args.steps_per_round):
                    t0 = time.perf_counter()
                    e.step()
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        same = ""
        if running == 1:
            toks = {name: next(iter(e.scheduler.requests.values())).output_token_ids for name, e in engines.items()}
            same = f", same greedy tokens: {toks['onednn'] == toks['dpbf16']}"
        print(f"running={running} context~{args.context}: decode step oneDNN {med['onednn'] * 1e3:.1f} ms, "
              f"ours {med['dpbf16'] * 1e3:.1f} ms: {med['onednn'] / med['dpbf16']:.2f}x{same}", flush=True)
        del engines


if __name__ == "__main__":
    main()
