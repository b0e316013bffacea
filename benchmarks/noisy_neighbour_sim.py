"""The noisy neighbour, simulated: the real scheduler on a scripted clock, no model, no server. Seconds, not minutes.

    python benchmarks/noisy_neighbour_sim.py [--strategy fair] [--rounds 4] [--seconds 30] [--lead 5] [--trace 0.3]

The same protocol as `noisy_neighbour.py` (tenant B: Poisson, `--quiet-rate` requests/s of a 32-token prompt
and 16 tokens; tenant A: 8x that rate of 32 + 128 tokens; alone and beside A taking turns in `--rounds` rounds,
B's arrival times the same in both phases of a round, A starting `--lead` seconds ahead and cut at the end),
driven through `Scheduler` with the model-free harness of the tests. A step takes `--step-a + --step-b x
tokens` seconds (the defaults: SmolLM2-135M in bf16 on a 2-core AMD EPYC Zen 3, a 4-row decode 37 ms, a
32-token prompt beside 3 decodes 105 ms); a request's first token comes at the end of the step that samples
it. Prints B's TTFT p50 / p99 alone and beside A and their ratio; with `--trace S`, every step around each of
B's requests slower than S seconds beside A: when it ran, its tokens, who was in it, the light set, the queue.

What it leaves out, so it does not replace the run over HTTP: the server's own time (HTTP, streaming,
tokenizing), a machine shared with the clients, and steps that do not follow the linear cost. It is the
quick way to see what a scheduling rule does to the tail: the light-set fixes of 2026-12-03 were found
with it (a 10-minute run over HTTP showed the symptom; this showed which requests, and why, in seconds).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench.study import pct  # noqa: E402
from tests.scheduler.harness import Harness  # noqa: E402


def simulate(args: argparse.Namespace) -> dict[str, list[float]]:
    h = Harness(scheduler=args.strategy, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
    rng = random.Random(args.seed)
    log: list[tuple] = []
    ttfts: dict[str, list[float]] = {"alone": [], "beside": []}
    for k in range(args.rounds):
        for phase in ("alone", "beside"):
            t0 = h.clock.now
            lead = args.lead if phase == "beside" else 0.0
            arrivals = []
            when = random.Random(f"{args.seed}-round-{k}")  # B's arrival times: the same in both phases
            t = t0 + lead
            while True:
                t += when.expovariate(args.quiet_rate)
                if t >= t0 + lead + args.seconds:
                    break
                arrivals.append((t, "quiet", 32, 16))
            if phase == "beside":
                t = t0
                while True:
                    t += rng.expovariate(args.ratio * args.quiet_rate)
                    if t >= t0 + lead + args.seconds:
                        break
                    arrivals.append((t, "noisy", 32, 128))
            arrivals.sort()
            end = t0 + lead + args.seconds
            quiet, noisy, i = [], [], 0
            while True:
                while i < len(arrivals) and arrivals[i][0] <= h.clock.now:
                    at, tenant, prompt, out = arrivals[i]
                    i += 1
                    r = h.add(prompt_len=prompt, max_tokens=out, tenant=tenant)
                    r.arrival_time = at
                    (quiet if tenant == "quiet" else noisy).append(r)
                if h.clock.now >= end:  # A is cut, as the clients' streams are
                    for r in noisy:
                        if not r.finished:
                            h.sched.finish(r, "abort")
                    if all(r.finished for r in quiet):
                        break
                if not h.sched.has_unfinished():
                    if i >= len(arrivals):
                        break
                    h.clock.now = arrivals[i][0]
                    continue
                start = h.clock.now
                step = h.sched.schedule()
                h.clock.now += args.step_a + args.step_b * step.num_tokens
                sampled = h.sched.update(step, [7] * sum(1 for it in step.items if it.samples))
                for req, _ in sampled:
                    if len(req.output_token_ids) >= req.max_tokens:
                        h.sched.finish(req, "length")
                light = sorted(getattr(h.sched.policy, "light", ()))
                log.append(
                    (
                        start,
                        step.num_tokens,
                        [(it.request.tenant_id, it.num_tokens) for it in step.items],
                        light,
                        len(h.sched.waiting),
                    )
                )
            ttfts[phase] += [r.first_token_time - r.arrival_time for r in quiet]
            if args.trace and phase == "beside":
                for r in quiet:
                    if r.first_token_time - r.arrival_time > args.trace:
                        print(
                            f"round {k}: B's request at {r.arrival_time - t0:.2f} s, TTFT "
                            f"{1000 * (r.first_token_time - r.arrival_time):.0f} ms"
                        )
                        for start, tokens, items, light, waiting in log:
                            if r.arrival_time - 0.3 <= start <= r.first_token_time:
                                print(
                                    f"    {start - t0:8.3f} s {tokens:4d} tokens {items} light {light} "
                                    f"waiting {waiting}"
                                )
            log.clear()
    return ttfts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="fair")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0, help="B's time per phase")
    ap.add_argument("--lead", type=float, default=5.0, help="seconds A runs before B beside it")
    ap.add_argument("--quiet-rate", type=float, default=1.0)
    ap.add_argument("--ratio", type=float, default=8.0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--step-a", type=float, default=0.028, help="a step's fixed cost, seconds")
    ap.add_argument("--step-b", type=float, default=0.0022, help="a step's cost per token, seconds")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--trace", type=float, default=0.0, help="trace B's requests beside A slower than this (s)")
    args = ap.parse_args()
    ttfts = simulate(args)
    a, b = ttfts["alone"], ttfts["beside"]
    print(
        f"{args.strategy}: B alone p50 {1000 * pct(a, 50):.0f} / p99 {1000 * pct(a, 99):.0f} ms "
        f"({len(a)} requests); beside A p50 {1000 * pct(b, 50):.0f} / p99 {1000 * pct(b, 99):.0f} ms "
        f"({len(b)}); p99 ratio {pct(b, 99) / pct(a, 99):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
