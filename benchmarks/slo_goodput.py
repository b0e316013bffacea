"""Goodput at 1.3x capacity: a deadline-aware strategy against the baseline, in one run, in-process.

    python benchmarks/slo_goodput.py                      # SmolLM2-135M, bf16; about 5 minutes on 2 cores
    python benchmarks/slo_goodput.py --model tiny         # a small random Llama: seconds, for development

One `LLMEngine` (one model load) is driven in-process, no HTTP, so that the client costs nothing:
1. *capacity*: the baseline strategy (`--strategies`' first) serves the mixed workload in a closed loop
   (the queue always holds `2 x max_num_seqs` requests, so the machine never idles) for
   `--capacity-seconds`; the tokens it processes per second after a warm-up, over the workload's mean
   tokens per request, are the machine's capacity for this workload in requests/s;
2. *the trace*: Poisson arrivals at `--overload` (1.3) x that capacity for `--trace-seconds`, the same
   requests at the same offsets for every strategy;
3. *the replay*: each strategy serves the trace on a fresh scheduler (`engine.reset`); a request's TTFT
   is counted from its arrival on the trace (a request arriving during a step waits for it, as in a
   server), its TPOT is (last token - first token) / (tokens - 1).

The workload is the lab's `mixed-slo`: interactive chat (short prompts and answers, tight TTFT and TPOT
targets) beside batch jobs (long prompts, a loose TTFT target, no TPOT target). Goodput is requests
meeting both their own targets per second of the run (arrival of the first to the end of the last), as
the lab counts it. Writes a JSON file (the command, CPU model, load average, capacity, per-strategy
goodput and per-class attainment, every request's TTFT/TPOT) and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from conveyor.bench.study import Study, cpu_name, pct  # noqa: E402
from conveyor.bench.workloads import CHAT, WorkloadSpec, arrival_offsets, generate  # noqa: E402
from conveyor.config import EngineConfig  # noqa: E402
from conveyor.engine.llm_engine import LLMEngine  # noqa: E402
from conveyor.request import make_request  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402


def submit(engine: LLMEngine, rid: str, req, arrival: float) -> None:
    params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(make_request(list(req.prompt_token_ids), params, defaults=engine.info.request_defaults,
                                    request_id=rid, arrival_time=arrival, tenant=req.tenant,
                                    slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms))


def capacity(engine: LLMEngine, spec: WorkloadSpec, vocab: int, seconds: float, warmup: float) -> dict:
    """Closed loop: keep 2 x max_num_seqs requests queued, so the machine never idles, and count the tokens it
    processes per second after `warmup`. Capacity in requests/s is that over the workload's mean tokens per
    request (prompt + output). Counting completions instead is biased in a short window: the short chat
    requests finish first, while the long batch jobs admitted with them are still running at its end."""
    pool = generate(dataclasses.replace(spec, num_prompts=4000, seed=spec.seed + 1), vocab, engine.max_model_len)
    per_request = sum(r.prompt_len + r.max_tokens for r in pool) / len(pool)
    depth = 2 * engine.config.max_num_seqs
    t0 = time.monotonic()
    sent = done = tokens = 0
    steps = []
    while time.monotonic() - t0 < warmup + seconds:
        while engine.num_running + engine.num_waiting < depth:
            submit(engine, f"cap-{sent}", pool[sent % len(pool)], time.monotonic())
            sent += 1
        out = engine.step()
        if time.monotonic() - t0 >= warmup:
            done += sum(d.finished for d in out.deltas)
            if out.stats is not None:
                tokens += out.stats.num_tokens
                steps.append((out.stats.num_tokens, out.stats.duration))
    engine.abort_all()
    return {"req_s": tokens / seconds / per_request, "tokens_s": tokens / seconds,
            "mean_tokens_per_request": per_request, "completed_in_window": done, "seconds": seconds,
            "mean_step_ms": 1000 * sum(s[1] for s in steps) / max(len(steps), 1),
            "mean_step_tokens": sum(s[0] for s in steps) / max(len(steps), 1)}


def replay(engine: LLMEngine, trace: list, offsets: list[float]) -> list[dict]:
    """Serve the trace in real time: requests join at their offsets, the engine steps while it has work."""
    recs = [{"class": r.tenant, "prompt": r.prompt_len, "output": r.max_tokens, "offset": off,
             "ttft_target_ms": r.slo_ttft_ms, "tpot_target_ms": r.slo_tpot_ms, "times": []}
            for r, off in zip(trace, offsets)]
    t0 = time.monotonic()
    i = 0
    while i < len(trace) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(trace) and offsets[i] <= now:
            submit(engine, str(i), trace[i], t0 + offsets[i])  # TTFT counts from the arrival on the trace
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[i] - (time.monotonic() - t0)))
            continue
        out = engine.step()
        stamp = time.monotonic() - t0
        for d in out.deltas:
            if d.new_token_ids:
                recs[int(d.group_id)]["times"].extend([stamp] * len(d.new_token_ids))
    for r in recs:
        t = r.pop("times")
        r["ttft_ms"] = 1000 * (t[0] - r["offset"])
        r["tpot_ms"] = 1000 * (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
        r["end"] = t[-1]
        r["good"] = (r["ttft_ms"] <= r["ttft_target_ms"] if r["ttft_target_ms"] is not None else True) and (
            r["tpot_target_ms"] is None or r["tpot_ms"] is None or r["tpot_ms"] <= r["tpot_target_ms"])
    return recs


def summarize(recs: list[dict]) -> dict:
    span = max(r["end"] for r in recs) - min(r["offset"] for r in recs)
    out = {"requests": len(recs), "good": sum(r["good"] for r in recs), "seconds": span,
           "goodput_req_s": sum(r["good"] for r in recs) / span, "throughput_req_s": len(recs) / span}
    for cls in sorted({r["class"] for r in recs}):
        mine = [r for r in recs if r["class"] == cls]
        tpots = [r["tpot_ms"] for r in mine if r["tpot_ms"] is not None]
        out[cls] = {"requests": len(mine), "good": sum(r["good"] for r in mine),
                    "ttft_ok": sum(r["ttft_ms"] <= r["ttft_target_ms"] for r in mine if r["ttft_target_ms"]),
                    "tpot_ok": sum(r["tpot_ms"] is None or r["tpot_target_ms"] is None
                                   or r["tpot_ms"] <= r["tpot_target_ms"] for r in mine),
                    "ttft_p50_ms": pct([r["ttft_ms"] for r in mine], 50),
                    "ttft_p99_ms": pct([r["ttft_ms"] for r in mine], 99),
                    "tpot_p50_ms": pct(tpots, 50), "tpot_p99_ms": pct(tpots, 99)}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conveyor.scheduler.policies import POLICIES

    names = list(result["strategies"])
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5 + 5 * len(names), 4.2))
    ax = axes[0]
    classes = sorted({r["class"] for n in names for r in result["strategies"][n]["requests"]})
    bottom = [0.0] * len(names)
    for k, cls in enumerate(classes):
        vals = [result["strategies"][n]["summary"][cls]["good"] / result["strategies"][n]["summary"]["seconds"]
                for n in names]
        ax.bar([POLICIES[n].shown for n in names], vals, bottom=bottom, label=f"{cls} meeting its targets",
               color=["tab:blue", "tab:gray"][k % 2], edgecolor=[POLICIES[n].color for n in names], linewidth=2)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, n in enumerate(names):
        ax.text(x, bottom[x], f"{result['strategies'][n]['summary']['goodput_req_s']:.2f}", ha="center", va="bottom")
    ax.set_ylabel("goodput (requests/s meeting both targets)")
    ax.set_title(f"offered {result['offered_req_s']:.2f} req/s = {result['settings']['overload']:g} x capacity"
                 f" ({result['capacity']['req_s']:.2f})", fontsize=9)
    ax.legend(fontsize=8)
    for ax, n in zip(axes[1:], names):
        recs = result["strategies"][n]["requests"]
        for cls, marker in zip(classes, "o^"):
            mine = [r for r in recs if r["class"] == cls]
            ok = [r for r in mine if r["good"]]
            bad = [r for r in mine if not r["good"]]
            ax.scatter([r["offset"] for r in ok], [r["ttft_ms"] / 1000 for r in ok], s=10, marker=marker,
                       color="tab:green", label=f"{cls}: met both targets")
            ax.scatter([r["offset"] for r in bad], [r["ttft_ms"] / 1000 for r in bad], s=10, marker=marker,
                       color="tab:red", label=f"{cls}: missed")
        for cls, style in zip(classes, ("--", ":")):
            target = next((r["ttft_target_ms"] for r in recs if r["class"] == cls), None)
            if target:
                ax.axhline(target / 1000, linestyle=style, color="k", linewidth=0.8, label=f"{cls} TTFT target")
        ax.set_yscale("log")
        ax.set_xlabel("arrival (s into the trace)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{POLICIES[n].shown}: goodput {result['strategies'][n]['summary']['goodput_req_s']:.2f} req/s",
                     fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['cpu']} ({result['cores']} cores), load avg "
                 f"{result['load_before'][0]:.1f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _range(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split("-"))
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model, or `tiny`: a small random Llama built here")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 for tiny)")
    ap.add_argument("--strategies", default="iteration,slo", help="baseline first (it measures the capacity)")
    ap.add_argument("--overload", type=float, default=1.3, help="offered load over the measured capacity")
    ap.add_argument("--capacity-seconds", type=float, default=25.0)
    ap.add_argument("--capacity-warmup", type=float, default=5.0)
    ap.add_argument("--trace-seconds", type=float, default=60.0, help="how long arrivals go on")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--long-fraction", type=float, default=0.25, help="share of batch jobs")
    ap.add_argument("--short-input", type=_range, default=(32, 96))
    ap.add_argument("--short-output", type=_range, default=(16, 48))
    ap.add_argument("--long-input", type=_range, default=(384, 768))
    ap.add_argument("--long-output", type=_range, default=(32, 96))
    ap.add_argument("--chat-ttft-ms", type=float, default=1500.0)
    ap.add_argument("--chat-tpot-ms", type=float, default=150.0)
    ap.add_argument("--batch-ttft-ms", type=float, default=20000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "docs/fairness/slo_goodput.json")
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    args = ap.parse_args()
    study = Study()
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    model = args.model
    dtype = args.dtype or ("float32" if model == "tiny" else "bfloat16")
    if model == "tiny":
        from tests.conftest import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="slo-goodput-")) / "tiny"))
    load_before = os.getloadavg()
    t_start = time.monotonic()
    config = EngineConfig(model=model, dtype=dtype, scheduler=names[0], max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(config)
    vocab = engine.info.vocab_size
    spec = WorkloadSpec(name="mixed-slo", long_fraction=args.long_fraction, short_input=args.short_input,
                        short_output=args.short_output, long_input=args.long_input, long_output=args.long_output,
                        chat_ttft_ms=args.chat_ttft_ms, chat_tpot_ms=args.chat_tpot_ms,
                        batch_ttft_ms=args.batch_ttft_ms, seed=args.seed)
    cap = capacity(engine, spec, vocab, args.capacity_seconds, args.capacity_warmup)
    print(f"capacity under {names[0]}: {cap['req_s']:.2f} req/s ({cap['tokens_s']:.0f} tokens/s over "
          f"{cap['mean_tokens_per_request']:.0f} per request; mean step {cap['mean_step_ms']:.1f} ms, "
          f"{cap['mean_step_tokens']:.0f} tokens)",
          flush=True)
    rate = args.overload * cap["req_s"]
    n = max(1, round(rate * args.trace_seconds))
    trace = generate(dataclasses.replace(spec, num_prompts=n), vocab, engine.max_model_len)
    offsets = arrival_offsets(n, rate, seed=args.seed)
    result: dict = {"command": " ".join(["python", "benchmarks/slo_goodput.py", *sys.argv[1:]]),
                    "model": args.model, "dtype": dtype, "cpu": cpu_name(), "cores": os.cpu_count(),
                    "load_before": load_before, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                             for k, v in vars(args).items()},
                    "capacity": cap, "offered_req_s": rate, "num_requests": n,
                    "chat_share": sum(r.tenant == CHAT for r in trace) / n, "strategies": {}}
    for name in names:
        engine.reset(dataclasses.replace(config, scheduler=name))
        recs = replay(engine, trace, offsets)
        s = summarize(recs)
        result["strategies"][name] = {"summary": s, "requests": recs}
        print(f"{name}: goodput {s['goodput_req_s']:.2f} req/s ({s['good']}/{s['requests']} good in "
              f"{s['seconds']:.1f}s); " + "; ".join(f"{c} {s[c]['good']}/{s[c]['requests']} good, TTFT p50/p99 "
                                                   f"{s[c]['ttft_p50_ms']:.0f}/{s[c]['ttft_p99_ms']:.0f} ms, TPOT p99 "
                                                   f"{s[c]['tpot_p99_ms'] or 0:.0f} ms"
                                                   for c in sorted(k for k in s if isinstance(s[k], dict))),
              flush=True)
    base, best = names[0], names[-1]
    g0 = result["strategies"][base]["summary"]["goodput_req_s"]
    result["ratio"] = result["strategies"][best]["summary"]["goodput_req_s"] / g0 if g0 else None
    result["load_after"] = os.getloadavg()
    result["wall_s"] = time.monotonic() - t_start
    study.write(args.out, result)
    png = args.plot or args.out.with_suffix(".png")
    plot(result, png)
    ratio = f"{result['ratio']:.2f}x" if result["ratio"] is not None else "n/a (baseline goodput 0)"
    print(f"goodput {best} / {base}: {ratio}; wrote {args.out} and {png} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
