"""Long prompts' prefill in-process: tokens per second per step budget, the share of the bf16 GEMM ceiling it
reaches, and where its time goes; then decode steps alone, with their own share of that ceiling.

    python benchmarks/prefill_profile.py --model /work/models/llama-3.2-1b [--budgets 512,2048,8192]

Prefills `--prompts` random prompts of `--prompt-len` tokens (one output token each, prefix caching off) in one
engine, the budgets (`max_num_batched_tokens`) taking turns for `--rounds` rounds so a noisy spell of a shared
VM hits each alike; prints the best round of each. The ceiling share counts what the issue on compute-bound
batches counts: every prompt token's linear layers and its causal attention (`FlopModel`), over the time, at
the best bf16 GEMM rate this CPU reaches on the model's own weight shapes at 256 rows (`vs_vllm.gemm_rates`).

Then the profile: the same prompts once more through the Python layer loop (the reference the one-call body
is tested against, the same kernels) with a timer round each part. The loop allocates each op's output, so its
parts include the page faults of fresh memory that the one-call body's single workspace takes once per step;
its total is printed beside the body's.

Last, decode steps (`--decode-batches`, e.g. 64x256: 64 requests of 256-token prompts, as the 64-client load;
16x2560: the long-prompt load's 16 users): each batch decodes `--decode-tokens` tokens, and only the steps that
carry the whole batch and no prompt token are counted (the engine's own step stats: duration, rows, context).
Their FLOPs are counted the same way (every row's linear layers, LM head and attention over its context), over
the same GEMM rate at 256 rows, and beside it the rate at 64 rows; the table says where a step's time goes
(the engine's step phases: forward, LM head, sampling, the rest). A decode step of few rows is bound by reading
the weights, not by arithmetic: its share of the compute ceiling is low by nature, and what it is bound by is
printed too (the weights' bytes a step over its time).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_vllm import gemm_rates  # noqa: E402  (a sibling study: the one GEMM-rate probe)

from conveyor.bench.stats import FlopModel, attention_ctx_sum  # noqa: E402
from conveyor.bench.study import Study  # noqa: E402


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 1) for _ in range(length)]} for _ in range(n)]


def timed_parts(model, times: collections.Counter) -> None:
    """Wrap each part of the Python layer loop in a timer (the CPU runs them one after the other)."""
    import conveyor.model.llama as llama

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            times[name] += time.perf_counter() - t0
            return out
        return run

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name, mod in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                          ("down_proj", mlp.down_proj), ("rms_norm", layer.input_layernorm),
                          ("rms_norm", layer.post_attention_layernorm)):
            mod.forward = timed(name, mod.forward)
        attn.forward = timed("attention block", attn.forward)
        mlp.forward = timed("mlp block", mlp.forward)
    llama.paged_attention = timed("attention", llama.paged_attention)
    model.forward = timed("model", model.forward)


def decode_steps(llm, fm: FlopModel, rates: dict[int, float], n: int, context: int, out_tokens: int,
                 rng: random.Random) -> dict:
    """Decode `out_tokens` tokens for `n` requests of `context`-token prompts; the whole-batch decode steps'
    time, FLOPs and phases (read from each step's `StepStats`, so prompts and the tail never count)."""
    from conveyor import SamplingParams

    engine = llm.engine
    cfg = engine.model_config
    recorded = []
    step = engine.step

    def recording():
        out = step()
        st = out.stats
        if st is not None and st.num_prefill_tokens == 0 and st.num_seqs == n:
            recorded.append(st)
        return out

    engine.step = recording  # (an instance attribute: `del` below puts the class's method back)
    try:
        params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts(rng, n, context, cfg.vocab_size), params, use_tqdm=False)
    finally:
        del engine.step
    seconds = sum(st.duration for st in recorded)
    flops = sum(fm.flops(st.num_tokens, st.num_tokens, st.logical_tokens) for st in recorded)
    phases: collections.Counter = collections.Counter()
    for st in recorded:
        phases.update(st.phases or {})
    weight_bytes = (fm.linear_params + fm.lm_head_params) * engine.info.torch_dtype.itemsize  # (unquantized)
    if not seconds:
        raise SystemExit(f"no decode step carried all {n} requests: raise --decode-tokens")
    return {"batch": n, "context": context, "steps": len(recorded), "ms_per_step": 1e3 * seconds / len(recorded),
            "tok_s": n * len(recorded) / seconds, "gflop_s": flops / seconds / 1e9,
            "ceiling_share": flops / seconds / rates[256], "rate64_share": flops / seconds / rates[64],
            "weights_gb_s": weight_bytes * len(recorded) / seconds / 1e9,
            "phases": {k: v / seconds for k, v in phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="512,2048,8192")
    ap.add_argument("--prompt-len", type=int, default=2560)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--decode-batches", default="64x256,16x2560",
                    help="REQUESTSxPROMPT_TOKENS,...: decode steps measured alone (empty: none)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from conveyor import LLM, SamplingParams

    study = Study()
    budgets = [int(b) for b in args.budgets.split(",")]
    llm = LLM(model=args.model, max_num_batched_tokens=max(budgets), enable_prefix_caching=False,
              use_tqdm_on_load=False, **({"quantization": args.quantization} if args.quantization else {}))
    engine, cfg = llm.engine, llm.engine.model_config
    rates = gemm_rates(cfg)
    fm = FlopModel.from_config(cfg)
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts(rng, 1, 300, cfg.vocab_size), one, use_tqdm=False)  # first-call costs out of the way
    n, length = args.prompts, args.prompt_len
    tokens = n * length
    flops = fm.flops(tokens, n, n * attention_ctx_sum(0, length))
    linear_share = 2.0 * fm.linear_params * tokens / flops
    print(f"{args.model}: {n} prompts of {length} tokens; bf16 GEMM rate {rates[256] / 1e9:.0f} GFLOP/s (256 rows); "
          f"attention is {1 - linear_share:.1%} of the prefill's FLOPs")
    best: dict[int, float] = {}
    for _ in range(args.rounds):
        for b in budgets:
            engine.config.max_num_batched_tokens = b  # the scheduler reads it each step
            batch = prompts(rng, n, length, cfg.vocab_size)
            t0 = time.perf_counter()
            llm.generate(batch, one, use_tqdm=False)
            best[b] = min(best.get(b, float("inf")), time.perf_counter() - t0)
    rows = {}
    print("\n| budget (tokens a step) | prefill tok/s | GFLOP/s | share of the bf16 GEMM ceiling |\n|---|---|---|---|")
    for b in budgets:
        rate = flops / best[b]
        rows[b] = {"seconds": best[b], "tok_s": tokens / best[b], "gflop_s": rate / 1e9,
                   "ceiling_share": rate / rates[256]}
        print(f"| {b} | {tokens / best[b]:.1f} | {rate / 1e9:.0f} | {rate / rates[256]:.0%} |")

    budget = 2048 if 2048 in budgets else budgets[0]
    engine.config.max_num_batched_tokens = budget
    model = engine.model
    times: collections.Counter = collections.Counter()
    fused = model.fused_body is not None
    model.fuse_body(False)
    timed_parts(model, times)
    t0 = time.perf_counter()
    llm.generate(prompts(rng, n, length, cfg.vocab_size), one, use_tqdm=False)
    total = time.perf_counter() - t0
    parts = {k: times[k] for k in ("gate_up_proj", "down_proj", "qkv_proj", "o_proj", "attention", "rms_norm")}
    parts["silu_and_mul"] = times["mlp block"] - times["gate_up_proj"] - times["down_proj"]
    parts["rope, kv write, views"] = times["attention block"] - times["qkv_proj"] - times["o_proj"] - times["attention"]
    parts["embedding, final norm"] = times["model"] - sum(parts.values())
    parts["outside the model (LM head, sampling, scheduling)"] = total - times["model"]
    print(f"\nWhere a {budget}-token-step prefill's time goes (the layer loop, {total:.2f} s; the one-call body "
          f"{'took' if fused else 'is off here:'} {best[budget]:.2f} s):\n\n| part | seconds | share | GFLOP/s |\n"
          "|---|---|---|---|")
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    part_flops = {"gate_up_proj": h * 2 * cfg.intermediate_size, "down_proj": cfg.intermediate_size * h,
                  "qkv_proj": h * (q + 2 * kv), "o_proj": q * h}
    for k, v in parts.items():
        rate = ""
        if k in part_flops:
            rate = f"{2.0 * part_flops[k] * cfg.num_layers * tokens / v / 1e9:.0f}"
        elif k == "attention":
            rate = f"{(flops - 2.0 * fm.linear_params * tokens - 2.0 * fm.lm_head_params * n) / v / 1e9:.0f}"
        print(f"| {k} | {v:.2f} | {v / total:.1%} | {rate} |")
    model.fuse_body(fused)
    decodes = []
    for spec in filter(None, args.decode_batches.split(",")):
        b, ctx = (int(x) for x in spec.lower().split("x"))
        decodes.append(decode_steps(llm, fm, rates, b, ctx, args.decode_tokens, rng))
    if decodes:
        print(f"\nDecode steps alone ({args.decode_tokens} tokens a request; the steps that carry the whole batch "
              f"and no prompt; GEMM rate {rates[256] / 1e9:.0f} GFLOP/s at 256 rows, {rates[64] / 1e9:.0f} at 64):\n\n"
              "| batch x context | steps | ms a step | tok/s | GFLOP/s | share of the ceiling (256 rows) | "
              "of the 64-row rate | weights read GB/s | forward / LM head / sampling / rest |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for d in decodes:
            ph = d["phases"]
            rest = 1.0 - ph.get("forward", 0) - ph.get("lm_head", 0) - ph.get("sample", 0)
            print(f"| {d['batch']} x {d['context']} | {d['steps']} | {d['ms_per_step']:.1f} | {d['tok_s']:.1f} | "
                  f"{d['gflop_s']:.0f} | {d['ceiling_share']:.0%} | {d['rate64_share']:.0%} | "
                  f"{d['weights_gb_s']:.1f} | "
                  f"{ph.get('forward', 0):.0%} / {ph.get('lm_head', 0):.0%} / {ph.get('sample', 0):.0%} / {rest:.0%} |")
    results = {"model": args.model, "prompt_len": length, "prompts": n, "gemm_rate_256": rates[256],
               "gemm_rate_64": rates[64], "attention_flop_share": 1 - linear_share, "budgets": rows,
               "profile": {"budget": budget, "loop_seconds": total, "parts": parts}, "decode_steps": decodes}
    if args.out:
        print(f"\nwrote {study.write(args.out, results)}")


if __name__ == "__main__":
    main()
