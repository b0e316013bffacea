"""What an embedding costs against the prefill it is: the same prompts embedded (last-token and mean
pooling) and run as 1-token generations, in one process on one model load.

An embedding request is a prefill-only request, so its cost should be its prefill: the ratio
embed / generate(max_tokens=1) is the overhead of pooling (and the saving of the LM head and the
sampler). Configurations are interleaved over `--rounds` so that drift hits them alike; the prefix
cache is off so that no run feeds on an earlier one. Reported: inputs/s and prompt tokens/s per
configuration (median over rounds) and each one's time as a ratio of the generate baseline.

    python benchmarks/embeddings.py --model smollm2-135m --inputs 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from conveyor import LLM, SamplingParams
from conveyor.bench.study import Study, cpu_name
from conveyor.pooling import PoolingParams

WORDS = ("the quick brown fox jumps over the lazy dog while batching requests together makes inference "
         "faster on every machine and paris is the capital of france").split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    study = Study()
    llm = LLM(a.model, enable_prefix_caching=False)
    texts = [" ".join(WORDS[i % 7:] * (1 + i % 4)) for i in range(a.inputs)]
    ids = [llm.tokenizer.encode(t) for t in texts]
    tokens = sum(len(x) for x in ids)
    runs = {
        "generate(max_tokens=1)": lambda: llm.generate([{"prompt_token_ids": x} for x in ids],
                                                       SamplingParams(max_tokens=1, temperature=0), use_tqdm=False),
        "embed last": lambda: llm.embed([{"prompt_token_ids": x} for x in ids], PoolingParams("last")),
        "embed mean": lambda: llm.embed([{"prompt_token_ids": x} for x in ids], PoolingParams("mean")),
    }
    runs["embed last"]()  # warm-up (kernels, allocator)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["generate(max_tokens=1)"])
    result = {"model": a.model, "cpu": cpu_name(), "inputs": a.inputs, "prompt_tokens": tokens, "configs": {}}
    print(f"{a.model} on {cpu_name()}: {a.inputs} inputs, {tokens} prompt tokens, median of {a.rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        result["configs"][name] = {"seconds": med, "inputs_per_s": a.inputs / med, "tokens_per_s": tokens / med,
                                   "vs_generate": med / base}
        print(f"  {name:24s} {med:6.2f} s  {a.inputs / med:7.1f} inputs/s  {tokens / med:8.0f} tok/s  "
              f"x{med / base:.2f} of generate")
    if a.out:
        study.write(a.out, result)


if __name__ == "__main__":
    main()
