"""oneDNN against our AVX-512 BF16 linear kernel, inside the engine: decode steps of SmolLM2 in bf16. And
(`--w8a8`) the W8A8 int8 GEMM against the bf16 linear the engine runs, layer by layer.

    python benchmarks/linear_kernels.py [--running 1,64] [--context 280] [--rounds 6]
    python benchmarks/linear_kernels.py --w8a8 [--rows 64,2048,4096] [--models smollm2,llama-1b] [--rounds 7]

`--w8a8`: each linear of a decoder layer (q/k/v, o, gate/up, down) and the LM head, in SmolLM2-135M's and
Llama-3.2-1B's shapes, as the engine builds them: `PackedLinear` (the bf16 kernel `linear_kernel()` picks on
this machine) against `W8A8Linear` (down_proj with its Hadamard block), random weights, bf16 activations, at
each row count (the head at decode row counts only: prefill computes logits for one row per prompt). A and
B alternate in `--rounds` rounds (a few ms of calls each); the median time of each gives GFLOP/s (2 M N K per
call, the int8 multiply-adds counted like the bf16 ones) and the ratio; "layer" sums the four linears' medians.

`--matrices`: the GGUF block-weight kernels (linear_gguf.cpp) against the bf16 path, on the matrices of one layer
of Llama-3.2-1B and Llama-3.1-8B (q/k/v and gate/up fused as the engine runs them, o, down) and on their LM head
(vocabulary 128,256), random weights: the time of one layer's matrices in model order and of the head, at each
row count, and the GB of weights read per second at one row (a decode step streams every weight once). Every
format's matrices are timed call by call in the same rounds, interleaved, so a noisy moment hits them alike; the
median round, and the "best": each matrix's fastest call summed (on a busy machine, the least disturbed).

    python benchmarks/linear_kernels.py --matrices [--shapes 1b,8b] [--formats bf16,Q8_0,Q4_0,Q4_K,Q5_K,Q6_K]
        [--rows 1,16] [--rounds 7] [--out docs/quantization/gguf_kernels.json]

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


# (hidden, intermediate, heads x head_dim, kv heads x head_dim, vocabulary): Llama-3.2-1B and Llama-3.1-8B
SHAPES = {"1b": (2048, 8192, 32 * 64, 8 * 64, 128256), "8b": (4096, 14336, 32 * 128, 8 * 128, 128256)}


def layer_matrices(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one decoder layer's linears as the engine fuses them, and of the LM head."""
    hidden, inter, q, kv, vocab = SHAPES[shape]
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (vocab, hidden)}


def random_gguf_linear(qtype: str, n: int, k: int, seed: int):
    """A GGUFLinear of random blocks (every byte random but the fp16 scales: valid, model-like magnitudes)."""
    import numpy as np

    from conveyor.model.gguf_weights import BLOCKS, GGUFLinear, GGUFWeight

    rng = np.random.default_rng(seed)
    qk, bb = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n * (k // qk), bb), dtype=np.uint8)
    scale = rng.uniform(1e-4, 1e-3, n * (k // qk)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2] = scale
        if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            raw[:, 2:4] = scale
    return GGUFLinear([GGUFWeight.from_raw(qtype, raw.reshape(n, -1), (n, k))], torch.bfloat16)


def bf16_linear(n: int, k: int):
    from conveyor.model.packed_linear import PackedLinear

    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    return PackedLinear(lin)


def matrices(args) -> None:
    """--matrices: see the module docstring."""
    import platform

    from conveyor import kernels
    from conveyor.bench.study import Study, cpu_name

    if not getattr(kernels.load(), "gguf_available", lambda: False)():
        raise SystemExit("no GGUF kernels in this build or on this CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    study = Study()
    formats = args.formats.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "machine": platform.machine(),
                     "variant": kernels.variant(), "shapes": {}}
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, kernels: {kernels.variant()}", flush=True)
    for shape in args.shapes.split(","):
        mats = layer_matrices(shape)
        mods: dict[str, dict[str, torch.nn.Module]] = {}
        for f in formats:
            mods[f] = {name: (bf16_linear(n, k) if f == "bf16" else random_gguf_linear(f, n, k, i))
                       for i, (name, (n, k)) in enumerate(mats.items())}
        nbytes = {f: {name: (n * k * 2 if f == "bf16" else m.packed.numel()) for name, (n, k) in mats.items()
                      for m in [ms[name]]} for f, ms in mods.items()}
        res = results["shapes"][shape] = {"matrices": {k: list(v) for k, v in mats.items()}, "formats": {}}
        for m in rows:
            xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in mats.values()}}
            # per round, format and matrix: one call's time (each matrix cold: a round reads far more than the caches)
            times = {f: {name: [] for name in mats} for f in formats}
            with torch.inference_mode():
                for f in formats:  # warm: first calls, the bf16 kernel's choice
                    for name, (_, k) in mats.items():
                        mods[f][name](xs[k])
                for _ in range(args.rounds):
                    for f in formats:
                        for name, (_, k) in mats.items():
                            t0 = time.perf_counter()
                            mods[f][name](xs[k])
                            times[f][name].append(time.perf_counter() - t0)
            layer = ("qkv", "o", "gate_up", "down")
            for f in formats:
                layer_bytes = sum(nbytes[f][name] for name in layer)
                lt = statistics.median([sum(ts) for ts in zip(*(times[f][name] for name in layer))])
                lbest = sum(min(times[f][name]) for name in layer)  # each matrix's least disturbed call
                ht, hbest = statistics.median(times[f]["lm_head"]), min(times[f]["lm_head"])
                row = {"layer_ms": round(lt * 1e3, 3), "lm_head_ms": round(ht * 1e3, 3),
                       "layer_ms_best": round(lbest * 1e3, 3), "lm_head_ms_best": round(hbest * 1e3, 3),
                       "layer_mb": round(layer_bytes / 1e6, 1), "lm_head_mb": round(nbytes[f]["lm_head"] / 1e6, 1),
                       "layer_gb_s": round(layer_bytes / lt / 1e9, 1),
                       "layer_gb_s_best": round(layer_bytes / lbest / 1e9, 1),
                       "lm_head_gb_s": round(nbytes[f]["lm_head"] / ht / 1e9, 1),
                       "lm_head_gb_s_best": round(nbytes[f]["lm_head"] / hbest / 1e9, 1)}
                if "bf16" in times:
                    bf = statistics.median([sum(ts) for ts in zip(*(times["bf16"][name] for name in layer))])
                    row["layer_vs_bf16"] = round(bf / lt, 2)
                    row["layer_vs_bf16_best"] = round(sum(min(times["bf16"][name]) for name in layer) / lbest, 2)
                res["formats"].setdefault(f, {})[str(m)] = row
                print(f"{shape} rows={m} {f:5s}: layer {row['layer_ms']:8.2f} ms (best {row['layer_ms_best']:.2f}; "
                      f"{row['layer_mb']:6.1f} MB, {row['layer_gb_s']:5.1f} GB/s, best {row['layer_gb_s_best']:5.1f}), "
                      f"head {row['lm_head_ms']:8.2f} ms (best {row['lm_head_ms_best']:.2f}, "
                      f"{row['lm_head_gb_s_best']:5.1f} GB/s)"
                      + (f", {row['layer_vs_bf16']:.2f}x bf16's layer (best {row['layer_vs_bf16_best']:.2f}x)"
                         if "layer_vs_bf16" in row else ""), flush=True)
        del mods
    if args.out:
        study.write(args.out, results)


# (in, out) of a decoder layer's linears and the LM head: SmolLM2-135M (hidden 576, 9 heads / 3 KV heads x 64,
# intermediate 1536, vocab 49152) and Llama-3.2-1B (hidden 2048, 32 / 8 x 64, intermediate 8192, vocab 128256)
W8A8_SHAPES = {
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)},
    "llama-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
                 "head": (2048, 128256)},
}
HEAD_MAX_ROWS = 256


def w8a8_gemms(models: list[str], rows: list[int], rounds: int) -> None:
    from torch import nn

    from conveyor.kernels.variants import cpu_name
    from conveyor.model import packed_linear, w8a8

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; bf16 linears: {packed_linear.linear_kernel()}, "
          f"W8A8 on {w8a8.kernel_isa()}. Timed on whatever else runs on this machine: read the ratios.")
    g = torch.Generator().manual_seed(0)
    for model in models:
        layer = {"bf16": {}, "w8a8": {}}
        for m in rows:
            for name, (k, n) in W8A8_SHAPES[model].items():
                if name == "head" and m > HEAD_MAX_ROWS:
                    continue
                lin = nn.Linear(k, n, bias=False)
                with torch.no_grad():
                    lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
                lin = lin.to(torch.bfloat16)
                runs = {"bf16": packed_linear.PackedLinear(lin),
                        "w8a8": w8a8.W8A8Linear(lin.weight, None, torch.bfloat16,
                                                w8a8.hadamard_block(k))}
                del lin
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                flop = 2 * m * k * n
                calls = max(1, int(3e9 / flop))  # ~ a few ms of work per sample
                times: dict[str, list[float]] = {a: [] for a in runs}
                with torch.inference_mode():
                    for f in runs.values():
                        f(x)
                    for _ in range(rounds):
                        for a, f in runs.items():
                            t0 = time.perf_counter()
                            for _ in range(calls):
                                f(x)
                            times[a].append((time.perf_counter() - t0) / calls)
                med = {a: statistics.median(ts) for a, ts in times.items()}
                per_round = sorted(b / a for a, b in zip(times["w8a8"], times["bf16"]))
                if name != "head":
                    for a in med:
                        layer[a][m] = layer[a].get(m, 0.0) + med[a]
                print(f"{model:9s} {name:8s} M={m:<5d} K={k:<5d} N={n:<6d} bf16 {flop / med['bf16'] / 1e9:7.1f} "
                      f"GFLOP/s  w8a8 {flop / med['w8a8'] / 1e9:7.1f} GOP/s  ratio {med['bf16'] / med['w8a8']:.2f}x "
                      f"(rounds {per_round[0]:.2f}-{per_round[-1]:.2f})", flush=True)
                del runs
        for m in rows:
            print(f"{model:9s} layer    M={m:<5d} four linears: bf16 {layer['bf16'][m] * 1e3:.2f} ms, "
                  f"w8a8 {layer['w8a8'][m] * 1e3:.2f} ms: {layer['bf16'][m] / layer['w8a8'][m]:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrices", action="store_true", help="GGUF block-weight kernels against bf16, per matrix")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--formats", default="bf16,Q8_0,Q4_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default=None, help="rows per call (default: 1,16 with --matrices; 64,2048,4096 with "
                    "--w8a8)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--w8a8", action="store_true", help="the W8A8 GEMM against the bf16 linear, layer by layer")
    ap.add_argument("--models", default="smollm2,llama-1b", help="--w8a8: " + ", ".join(W8A8_SHAPES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's); on a busy "
                    "machine one thread keeps a late second thread from stalling every call")
    ap.add_argument("--running", default="1,64")
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    args = ap.parse_args()
    if args.matrices:
        args.rows = args.rows or "1,16"
        matrices(args)
        return
    if args.w8a8:
        if args.threads:
            torch.set_num_threads(args.threads)
        return w8a8_gemms(args.models.split(","), [int(r) for r in (args.rows or "64,2048,4096").split(",")],
                          args.rounds)
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
