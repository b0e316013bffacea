"""The one-call decoder body (`decoder_layers`) against the Python loop over the same kernels, in one engine.

    python benchmarks/fused_body_ab.py --model /tmp/peers/qwen-shape-hf [--running 64] [--rounds 6]

Fills the engine with `--running` decoding requests, then alternates the body on and off every round (the order
flipped each round, so a noisy spell of a shared VM hits both alike) and times the forward phase of decode-only
steps and of steps with a 256-token prompt beside the decodes. Prints the median of each. Both paths give the
same bits (tests/model/test_fused_body.py); this says what the fused one saves.
"""

from __future__ import annotations

import argparse
import random
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from conveyor import SamplingParams
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.request import make_request

    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16"))
    model = engine.model
    fused = model.fused_body
    if fused is None:
        raise SystemExit("the one-call body does not run for this model or build: nothing to compare")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def add(prompt_len: int, max_tokens: int) -> None:
        engine.add_request(make_request([rng.randrange(100, vocab) for _ in range(prompt_len)],
                                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))

    for _ in range(args.running):
        add(rng.randint(128, 384), 100_000)
    while (stats := engine.step().stats) is None or stats.num_prefill_tokens:  # until every prompt is in
        pass
    times = {name: {"decode": [], "with a prompt": []} for name in ("fused", "loop")}
    for rnd in range(args.rounds):
        for name in ("fused", "loop") if rnd % 2 == 0 else ("loop", "fused"):
            model.fused_body = fused if name == "fused" else None
            for i in range(4):
                mixed = i % 2 == 1
                if mixed:
                    add(256, 1)  # prefilled beside the decodes, then done
                stats = engine.step().stats
                times[name]["with a prompt" if mixed else "decode"].append(stats.phases["forward"])
    model.fused_body = fused
    for name, kinds in times.items():
        print(f"{name}: " + ", ".join(f"{kind} {statistics.median(v) * 1e3:.1f} ms" for kind, v in kinds.items()))


if __name__ == "__main__":
    main()
