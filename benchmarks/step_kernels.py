"""Time the compiled attention and RMSNorm kernels alone, on the step shapes of the 64-client load.

    python benchmarks/step_kernels.py [--rounds 15]

SmolLM2's attention shape (9 query / 3 KV heads, head dim 64, 16-token blocks scattered through the pool, bf16):
64 decodes of 350 keys; 64 decodes of 130-570 keys; 60 of those beside a 256-token prompt (a mixed step); the
prompt alone. Then prefill attention at the Llama-3.2-1B shape (32 query / 8 KV heads, head dim 64): a 2,048-token
chunk after 0 and after 512 cached tokens, with its rate (the causal FLOPs: 4 x head dim a query head and key seen).
Then RMSNorm with the residual add over 64 and 1,024 rows of 576. Each number is the best of
`--rounds` rounds of 5 calls, per layer. Why alone: the whole load's throughput moves 10-30% with this VM's
drift, while one kernel's best-of-N shows a change of a few percent. For a before/after, run it on both
builds in alternation.
"""

from __future__ import annotations

import argparse
import random

import torch

from conveyor.bench.study import best_ms


def attention_step(reqs: list[tuple[int, int]], rounds: int, h: int = 9, hkv: int = 3, d: int = 64,
                   block_size: int = 16) -> float:
    """reqs: (tokens already cached, new tokens) per sequence. Blocks are drawn at random from the pool."""
    from conveyor.model.attention import build_metadata, cache_shapes, paged_attention

    g = torch.Generator().manual_seed(0)
    need = [-(-(c + n) // block_size) for c, n in reqs]
    order = list(range(sum(need) + 2))
    random.Random(0).shuffle(order)
    blocks = iter(order)
    tables = [[next(blocks) for _ in range(nb)] for nb in need]
    k_shape, v_shape = cache_shapes(len(order), block_size, hkv, d)
    kc, vc = (torch.randn(s, generator=g).bfloat16() for s in (k_shape, v_shape))
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, heads, d, generator=g).bfloat16() for heads in (h, hkv, hkv))
    meta = build_metadata([n for _, n in reqs], [c + n for c, n in reqs], tables, block_size,
                          torch.device("cpu"), "kernel")
    return best_ms(lambda: paged_attention(q, k, v, kc, vc, meta, d ** -0.5), rounds, calls=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    from conveyor import kernels
    from conveyor.kernels.variants import cpu_name

    ops = kernels.load()
    if ops is None:
        raise SystemExit("the compiled kernels could not be loaded here")
    print(f"CPU: {cpu_name()}, kernels: {kernels.variant()}, threads: {torch.get_num_threads()}")
    rng = random.Random(1)
    varied = [(rng.randint(130, 570), 1) for _ in range(64)]
    steps = {"64 decodes x 350 keys": [(349, 1)] * 64, "64 decodes x 130-570 keys": varied,
             "60 decodes + a 256-token prompt": varied[:60] + [(0, 256)], "a 256-token prompt": [(0, 256)]}
    print("\n| paged attention, SmolLM2's shape | ms per layer |\n|---|---|")
    for name, reqs in steps.items():
        print(f"| {name} | {attention_step(reqs, args.rounds):.3f} |", flush=True)
    print("\n| paged attention, the 1B shape (32 / 8 heads, D 64), prefill | ms per layer | GFLOP/s |\n|---|---|---|")
    for cached in (0, 512):
        ms = attention_step([(cached, 2048)], args.rounds, h=32, hkv=8)
        flops = 32 * 4 * 64 * sum(cached + i + 1 for i in range(2048))
        print(f"| 2,048 tokens after {cached} cached | {ms:.2f} | {flops / ms / 1e6:.0f} |", flush=True)
    g = torch.Generator().manual_seed(2)
    x, res = (torch.randn(1024, 576, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(576, generator=g).bfloat16()
    print("\n| RMSNorm + residual, 576 wide | us |\n|---|---|")
    for rows in (64, 1024):
        xr, rr = x[:rows], res[:rows]
        ms = best_ms(lambda: ops.rms_norm(xr, rr, w, 1e-5), args.rounds, calls=20)  # noqa: B023 - called here
        print(f"| {rows} rows | {ms * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
