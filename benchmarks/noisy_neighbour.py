"""Noisy neighbour over HTTP: a quiet tenant beside one sending 8x its rate, under each strategy.

    python benchmarks/noisy_neighbour.py --out docs/fairness/noisy_neighbour.json   # about 10 minutes, SmolLM2

One `conveyor serve` of SmolLM2-135M (`--max-num-seqs 4`, so a few streams fill it) is driven with the
`openai` client, streaming. Each strategy is switched in live (`POST /admin/scheduler`), and the server
is idle between phases. For each strategy in `--strategies`:
- *alone*: tenant B (`user="quiet"`) sends `--quiet-rate` requests/s (Poisson) for `--seconds`;
- *beside A*: the same B stream plus tenant A (`user="noisy"`, another client process) at 8x that
  rate, far past what the server can serve, so A's queue grows the whole time (its streams are cut
  at the end of the phase);
the two take turns in `--rounds` rounds (alone, beside, alone, beside, ...), each `--seconds / --rounds`
long, so that a slow spell of the shared machine does not fall on one side only; in a round B sends at the
same moments alone and beside A, and A starts `--lead` seconds ahead of B (B meets A saturating). B's TTFT p50/p99 over
all rounds are reported for both, and their ratio (the issue's bar for fair: p99 <= 1.5x alone), with
each round's p99s.
Then, under the strategy named by `--fair`, both tenants backlogged (closed loop, 16 requests in flight each,
not streamed, so neither ever runs dry; tokens counted by the server's per-tenant metrics): Jain's
index of per-tenant output tokens/s with equal weights, and the service ratio with weights 2:1.
Every request: a ~32-token prompt, greedy, ignore_eos; B's are short (`--quiet-output-tokens`, interactive),
A's longer (`--output-tokens`), so that B alone is served with room to spare and A at 8x its rate is
several times what fits.
Speed is only compared within this run (ratios), as the machine is shared: the load average and the CPU
model are recorded. Writes the JSON file and, beside it, a plot (`.png`): B's TTFT, every request, alone and
beside A under each strategy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import openai

from conveyor.bench.study import Server, Study, pct

REPO = Path(__file__).resolve().parent.parent
KEY = "bench-key"
MODEL = "bench"  # the served model name
# ~32 prompt tokens with SmolLM2's tokenizer; set by the flags
SIZES = {"prompt_words": 24, "output_tokens": 128, "quiet_output_tokens": 16, "share_output_tokens": 32}


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def server(model: str, max_num_seqs: int) -> Server:
    """The server under test (`conveyor serve` on a port of its choosing), not started."""
    if model == "tiny":  # a small random Llama (the tests' builder): milliseconds per step even on a busy machine
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="noisy-neighbour-")) / "tiny"))
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", model, "--served-model-name", MODEL,
           "--port", "0", "--api-key", KEY,
           "--max-num-seqs", str(max_num_seqs), "--disable-log-requests", "--max-queued-requests", "100000"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return Server(cmd, 0, env=env, ready_timeout=900, poll_s=0.5)


def switch(url: str, name: str, **options) -> None:
    r = httpx.post(url + "/admin/scheduler", json={"scheduler": name, **options},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()


def wait_idle(url: str) -> None:
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = sum(float(v) for v in re.findall(
            r"^conveyor:(?:num_requests_running|num_requests_waiting|kv_cache_blocks_used)\{[^}]*\} (\S+)$",
            text, re.M))
        if busy == 0:
            return
        time.sleep(0.2)


def prompt(rng: random.Random) -> str:
    words = ["river", "stone", "cloud", "lamp", "garden", "signal", "copper", "window", "harbor", "engine"]
    return " ".join(rng.choice(words) for _ in range(SIZES["prompt_words"]))


async def one(client: openai.AsyncOpenAI, tenant: str, rng: random.Random, out: list[dict]) -> None:
    rec = {"tenant": tenant, "sent": time.monotonic(), "first": None, "tokens": 0, "end": None}
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt(rng),
                                                 max_tokens=SIZES["quiet_output_tokens" if tenant == "quiet" else
                                                                  "output_tokens"],
                                                 temperature=0, stream=True, user=tenant,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.monotonic()
                rec["first"] = rec["first"] or now
                rec["tokens"] += 1  # one chunk per token (no stop strings): output tokens
        rec["end"] = time.monotonic()
    finally:
        out.append(rec)


async def open_loop(url: str, rates: dict[str, float], seconds: float, seed: str,
                    arrivals: str | None = None) -> list[dict]:
    """Each tenant sends Poisson arrivals at its rate for `seconds`; streams still open then are cut. The
    arrival times come from `arrivals` (default: `seed`), the prompts from `seed`: two phases with the same
    `arrivals` send at the same moments, with prompts of their own (no prefix-cache hits across phases)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    out: list[dict] = []
    tasks: dict[str, list[asyncio.Task]] = {t: [] for t in rates}

    async def tenant_loop(tenant: str, rate: float) -> None:
        rng = random.Random(f"{seed}-{tenant}")
        when = random.Random(f"{arrivals or seed}-{tenant}-arrivals")
        t0 = time.monotonic()
        t = when.expovariate(rate)
        while t < seconds:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            tasks[tenant].append(asyncio.create_task(one(client, tenant, rng, out)))
            t += when.expovariate(rate)

    await asyncio.gather(*(tenant_loop(t, r) for t, r in rates.items()))
    # the quiet tenant's last requests get up to 60 s to finish; then everything still open is cut (the
    # noisy backlog; a quiet request cut before its first token counts with its wait so far, a lower bound)
    if tasks.get("quiet"):
        await asyncio.wait(tasks["quiet"], timeout=60)
    cut = time.monotonic()
    every = [t for ts in tasks.values() for t in ts]
    for task in every:
        task.cancel()
    await asyncio.gather(*every, return_exceptions=True)
    for r in out:
        r["cut"] = r["end"] is None
        if r["first"] is None:
            r["waited"] = cut - r["sent"]
    await client.close()
    return out


def run_open_loop(url: str, rates: dict[str, float], seconds: float, seed: str, sizes: dict) -> list[dict]:
    SIZES.update(sizes)
    return asyncio.run(open_loop(url, rates, seconds, seed))


def tenant_tokens(url: str) -> dict[str, float]:
    """Tokens generated per tenant so far, from the server's own per-tenant counter in /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^conveyor:tenant_generation_tokens_total\{[^}]*tenant="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


async def closed_loop(url: str, streams: dict[str, int], seconds: float, warmup: float, seed: str
                      ) -> dict[str, float]:
    """Each tenant keeps `streams[tenant]` requests in flight; output tokens/s per tenant after `warmup`,
    counted by the server (`conveyor:tenant_generation_tokens_total`) over the window. A `seed` of its own
    per phase: prompts repeated from an earlier phase would be prefix-cache hits, which cost (and are
    charged) less, and the service ratio in output tokens would no longer be the ratio of service."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    stop = False

    async def worker(tenant: str, k: int) -> None:
        rng = random.Random(f"{seed}-{tenant}-{k}")
        while not stop:
            # not streamed: a client parsing every token of 2 x 16 streams lags on a busy machine, and a tenant
            # whose next requests are late to arrive is not backlogged any more, which is not what is measured
            await client.completions.create(model=MODEL, prompt=prompt(rng), max_tokens=SIZES["share_output_tokens"],
                                            temperature=0, user=tenant, extra_body={"ignore_eos": True})

    tasks = [asyncio.create_task(worker(t, k)) for t, n in streams.items() for k in range(n)]
    await asyncio.sleep(warmup)
    before = await asyncio.to_thread(tenant_tokens, url)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after = await asyncio.to_thread(tenant_tokens, url)
    elapsed = time.monotonic() - t0
    stop = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return {t: (after.get(t, 0.0) - before.get(t, 0.0)) / elapsed for t in streams}


def ttft_summary(recs: list[dict], tenant: str) -> dict:
    mine = [r for r in recs if r["tenant"] == tenant]
    # a request cut before its first token counts with how long it had waited (a lower bound on its TTFT)
    ttfts = [r["first"] - r["sent"] if r["first"] is not None else r["waited"] for r in mine]
    done = [r for r in mine if r["end"] is not None]
    return {"requests": len(mine), "finished": len(done), "no_first_token": sum(r["first"] is None for r in mine),
            "ttft_p50_ms": 1000 * pct(ttfts, 50) if ttfts else None,
            "ttft_p99_ms": 1000 * pct(ttfts, 99) if ttfts else None,
            "ttft_ms_sorted": [round(1000 * t, 1) for t in sorted(ttfts)] if tenant == "quiet" else None}


def plot(result: dict, path: Path) -> None:
    """B's TTFT, every request sorted (so the right end is the p99), alone and beside A, for each strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(REPO))
    from conveyor.scheduler.policies import POLICIES

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, entry in result["strategies"].items():
        spec = POLICIES.get(name)
        color, shown = (spec.color, spec.shown) if spec else ("tab:gray", name)
        for phase, style, label in (("quiet_alone", ":", "B alone"), ("quiet_beside_noisy", "-", "B beside A (8x)")):
            ys = entry[phase]["ttft_ms_sorted"] or []
            if ys:
                xs = [100 * (i + 1) / len(ys) for i in range(len(ys))]
                ax.step(xs, ys, where="post", linestyle=style, color=color, label=f"{shown}: {label}")
        ratio = entry.get("p99_ratio")
        if ratio is not None:
            ax.annotate(f"{shown}: p99 {ratio:.1f}x alone", xy=(100, entry["quiet_beside_noisy"]["ttft_p99_ms"]),
                        xytext=(-5, 4), textcoords="offset points", ha="right", fontsize=8, color=color)
    ax.set_yscale("log")
    ax.set_xlabel("percentile of B's requests")
    ax.set_ylabel("B's time to first token (ms)")
    ax.set_title(f"noisy neighbour over HTTP: {result['settings']['model']} on {result['cpu']} ({result['cores']} "
                 f"cores, load avg {result['load_before'][0]:.1f})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="a model for `conveyor serve`, or `tiny`: a small random Llama built on the spot (the "
                         "scheduling is the same; its steps take milliseconds, for a machine too busy for a real one)")
    ap.add_argument("--strategies", default="iteration,fair")
    ap.add_argument("--fair", default="fair", help="the strategy whose tenant shares are measured")
    ap.add_argument("--quiet-rate", type=float, default=1.0, help="tenant B's requests per second")
    ap.add_argument("--ratio", type=float, default=8.0, help="tenant A's rate over B's")
    # 120 s: ~120 of B's requests at 1/s, so that the p99 is not simply the slowest request
    ap.add_argument("--seconds", type=float, default=120.0, help="length of each open-loop phase (alone, "
                    "beside A), in all its rounds")
    ap.add_argument("--rounds", type=int, default=4, help="alone and beside A take turns this many times, each "
                    "for --seconds / --rounds")
    ap.add_argument("--lead", type=float, default=5.0, help="seconds A runs before B starts in each round beside "
                    "it (A's first second is a newcomer's, not a saturating neighbour's)")
    ap.add_argument("--prompt-words", type=int, default=SIZES["prompt_words"])
    ap.add_argument("--output-tokens", type=int, default=SIZES["output_tokens"], help="the noisy tenant's output "
                    "tokens per request")
    ap.add_argument("--share-output-tokens", type=int, default=SIZES["share_output_tokens"],
                    help="output tokens per request in the share phases: short, so that seats change hands often "
                    "within the window (with 128 and SmolLM2, ~15 requests finished in 25 s and the 2:1 ratio read "
                    "2.39: seats held 3:1 for long stretches)")
    ap.add_argument("--quiet-output-tokens", type=int, default=SIZES["quiet_output_tokens"],
                    help="the quiet tenant's: short interactive requests")
    ap.add_argument("--share-seconds", type=float, default=25.0, help="length of each closed-loop share phase")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--skip-noisy", action="store_true", help="only the share phases")
    ap.add_argument("--out", type=Path, default=REPO / "docs/fairness/noisy_neighbour.json")
    args = ap.parse_args()
    study = Study()
    SIZES.update(prompt_words=args.prompt_words, output_tokens=args.output_tokens,
                 share_output_tokens=args.share_output_tokens,
                 quiet_output_tokens=args.quiet_output_tokens)
    from conveyor.kernels.variants import cpu_name

    t_start = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "cpu": cpu_name(),
                    "cores": os.cpu_count(), "load_before": os.getloadavg(),
                    "settings": vars(args) | {"out": str(args.out)},
                    "strategies": {}}
    with server(args.model, args.max_num_seqs) as srv:
        url = srv.url
        switch(url, "iteration")  # warm up (first-use costs) before anything is measured
        asyncio.run(open_loop(url, {"quiet": 1.0}, 5.0, seed="warm-up"))
        wait_idle(url)
        for name in [] if args.skip_noisy else [s.strip() for s in args.strategies.split(",") if s.strip()]:
            switch(url, name)
            alone: list[dict] = []
            both: list[dict] = []
            rounds = []
            seconds = args.seconds / args.rounds
            # alone and beside A take turns, `--rounds` times, so that the machine's drift over the minutes of
            # a run lands on both sides of the ratio (one long phase each read 127 to 271 ms for B's p99 alone
            # in three runs on the same machine, while beside A it held at 214 to 258)
            for k in range(args.rounds):
                # prompts of their own in every phase (one seen in an earlier phase would be a prefix-cache
                # hit), but B's arrival times are the same alone and beside A in a round: what differs is A
                # alone, not the luck of the draw (one burst of five more on one side moved the p99 by itself)
                a_k = asyncio.run(open_loop(url, {"quiet": args.quiet_rate}, seconds, seed=f"{name}-alone-{k}",
                                            arrivals=f"round-{k}"))
                wait_idle(url)
                # the noisy tenant is another client, in its own process: its hundreds of streams must not slow
                # the event loop that times the quiet tenant's first tokens. It starts `--lead` seconds before
                # B, so that B meets it saturating, as the bar says, not arriving
                with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
                    noisy = pool.submit(run_open_loop, url, {"noisy": args.ratio * args.quiet_rate},
                                        seconds + args.lead, f"{name}-both-{k}", dict(SIZES))
                    time.sleep(args.lead)
                    b_k = asyncio.run(open_loop(url, {"quiet": args.quiet_rate}, seconds, seed=f"{name}-both-{k}",
                                                arrivals=f"round-{k}"))
                    b_k += noisy.result()
                wait_idle(url)
                rounds.append({"alone_p99_ms": ttft_summary(a_k, "quiet")["ttft_p99_ms"],
                               "beside_p99_ms": ttft_summary(b_k, "quiet")["ttft_p99_ms"]})
                alone += a_k
                both += b_k
            a, b = ttft_summary(alone, "quiet"), ttft_summary(both, "quiet")
            entry = {"quiet_alone": a, "quiet_beside_noisy": b, "noisy": ttft_summary(both, "noisy"),
                     "p99_ratio": (b["ttft_p99_ms"] / a["ttft_p99_ms"]) if a["ttft_p99_ms"] and b["ttft_p99_ms"]
                     else None, "rounds": rounds}
            result["strategies"][name] = entry
            print(name, json.dumps(entry), flush=True)
        switch(url, args.fair)
        equal = asyncio.run(closed_loop(url, {"a": 16, "b": 16}, args.share_seconds, warmup=5.0, seed="equal"))
        wait_idle(url)
        switch(url, args.fair, tenant_weights="a=2,b=1")
        weighted = asyncio.run(closed_loop(url, {"a": 16, "b": 16}, args.share_seconds, warmup=5.0,
                                           seed="weighted"))
        wait_idle(url)
        result["shares"] = {"strategy": args.fair,
                            "equal": {"tok_s": equal, "jain": jain(list(equal.values()))},
                            "weights_2_1": {"tok_s": weighted, "ratio": weighted["a"] / max(weighted["b"], 1e-9)}}
        print("shares", json.dumps(result["shares"]), flush=True)
    result["load_after"] = os.getloadavg()
    result["wall_s"] = time.monotonic() - t_start
    study.write(args.out, result)
    if result["strategies"]:  # --skip-noisy: no TTFTs to plot
        plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
