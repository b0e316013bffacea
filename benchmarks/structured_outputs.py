"""What a grammar costs per step: the same batch of chat requests with 0, half or all of them
constrained to a JSON schema, in one process on one model load.

Each configuration runs `--rounds` times, interleaved (0, half, all, 0, half, all, ...) so that the
machine's drift hits them alike; every run is `--batch` requests of at most `--max-tokens` greedy
tokens. Reported per configuration: output tok/s (median over rounds), and the engine's own step
phases per step: "grammar" (llguidance filling each constrained row's token bitmask, plus advancing
the matchers) and "sample" (which now includes applying the masks), against the whole step.

    python benchmarks/structured_outputs.py --out docs/structured-outputs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.bench.study import Study, cpu_name

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "hobbies", "employed"], "additionalProperties": False}


def run(llm: LLM, batch: int, structured: int, max_tokens: int) -> dict:
    eng = llm.engine
    eng.phase_seconds = dict.fromkeys(eng.phase_seconds, 0.0)
    steps0 = eng.snapshot().steps
    so = StructuredOutputsParams(json=SCHEMA)
    convs = [[{"role": "user", "content": f"Describe person number {i} (name, age, city, hobbies, employed) "
                                          f"as JSON."}] for i in range(batch)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so if i < structured else None)
              for i in range(batch)]
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = eng.snapshot().steps - steps0
    ph = eng.phase_seconds
    valid = 0
    for o in outs[:structured]:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    return {"tok_s": tokens / elapsed, "tokens": tokens, "steps": steps, "valid_json": valid,
            "grammar_ms_per_step": 1e3 * ph["grammar"] / steps, "sample_ms_per_step": 1e3 * ph["sample"] / steps,
            "step_ms": 1e3 * sum(ph.values()) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    study = Study()
    llm = LLM(args.model)
    configs = {"none": 0, "half": args.batch // 2, "all": args.batch}
    run(llm, args.batch, args.batch, 16)  # warm-up: kernels, the llguidance tokenizer, the schema's compilation
    results: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, n in configs.items():
            results[name].append(run(llm, args.batch, n, args.max_tokens))
    summary = {}
    for name, rs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        s = summary[name]
        print(f"{name:>5} structured of {args.batch}: {s['tok_s']:7.1f} tok/s, step {s['step_ms']:6.1f} ms "
              f"(grammar {s['grammar_ms_per_step']:.2f} ms, sample {s['sample_ms_per_step']:.2f} ms), "
              f"{s['valid_json']:.0f} valid JSON")
    base = summary["none"]["tok_s"]
    for name in ("half", "all"):
        print(f"{name}: {summary[name]['tok_s'] / base:.3f}x the throughput of none")
    if args.out:
        study.write(args.out, {"cpu": cpu_name(), "args": vars(args), "engine": {
            "dtype": llm.engine.info.dtype, "weights": llm.engine.info.weight_dtype},
            "summary": summary, "runs": results})


if __name__ == "__main__":
    main()
