"""The batch tier against its bars: interactive latency beside a large batch, and the batch's throughput alone.

    python benchmarks/batch_tier.py --out docs/batch/batch_tier.json      # SmolLM2-135M, about 10 minutes

One `conveyor serve` (the defaults, `--max-num-seqs` as given) with a fresh `--batch-dir`:
1. latency: an interactive client streams `/v1/completions` at `--rate` requests/s (Poisson; ~32-token prompts,
   `--output-tokens` tokens, greedy) for the whole part, while the server alternates, `--rounds` times, between
   *idle* (no batch) and *batch* (a batch of `--batch-lines` long lines running in the batch tier; cancelled at
   the end of the phase), `--seconds` each. A request counts for the phase it was sent in (none in the moments a
   batch starts or is being cancelled). Bars: interactive TTFT p99 beside the batch <= 2x idle, TPOT p50 <= 1.3x.
   The interactive stream never stops, as on a server with steady traffic: the tier's step cut applies while
   interactive work was seen within `--batch-tier-quiet-s` (a request after a longer silence meets one step
   the batch had to itself, see docs/batch.md).
2. throughput: with no interactive traffic (after the quiet window), a batch of `--throughput-lines` lines runs
   alone (creation to completion, its validation included), then the server stops and `LLM.generate` runs the
   same prompts with the same sampling in a process of its own (the call alone, its load excluded), `--rounds`
   times in turn. Bar: the batch's output tokens/s >= 90% of LLM.generate's.
Speed is only compared within this run (ratios), as the machine may be shared: the load average and the CPU
are recorded in the JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from conveyor.bench.study import Server, Study, cpu_name, load_avg, pct

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench"
WORDS = ["river", "stone", "cloud", "lamp", "garden", "signal", "copper", "window", "harbor", "engine", "paper",
         "orbit"]


def prompt(rng: random.Random, words: int = 24) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def server(args, batch_dir: str, log) -> Server:
    """`conveyor serve` with a batch directory of its own, its lines appended to `log` (every server's)."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", args.model, "--served-model-name", MODEL,
           "--port", "0", "--max-num-seqs", str(args.max_num_seqs), "--batch-dir", batch_dir,
           "--disable-log-requests", "--max-queued-requests", "100000", *args.engine_args]
    return Server(cmd, 0, env={**os.environ, "PYTHONPATH": str(REPO)}, log=log, ready_timeout=900, poll_s=0.3)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^conveyor:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def batch_file(n: int, output_tokens: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": MODEL, "prompt": prompt(rng), "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True}})
        + "\n" for i in range(n)).encode()


# --- part 1: interactive latency beside a batch ------------------------------------------------------------
async def interactive_request(client: openai.AsyncOpenAI, rng: random.Random, phase: dict, args,
                              out: list[dict]) -> None:
    rec = {"phase": phase["name"], "sent": time.monotonic(), "first": None, "last": None, "tokens": 0, "chunks": 0}
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt(rng), max_tokens=args.output_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.monotonic()
                rec["first"] = rec["first"] or now
                rec["last"] = now
                rec["chunks"] += 1
            if chunk.usage is not None:
                # tokens, not chunks: a chunk may carry several tokens when the client reads slower than the
                # server writes (vLLM's client divides by the output tokens too)
                rec["tokens"] = chunk.usage.completion_tokens
        out.append(rec)
    except Exception as e:  # noqa: BLE001 - counted, not fatal
        rec["error"] = repr(e)
        out.append(rec)


async def latency_part(url: str, args) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sync = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(7)
    phase = {"name": "warmup"}
    records: list[dict] = []
    tasks: set[asyncio.Task] = set()
    stop = asyncio.Event()

    async def sender() -> None:
        while not stop.is_set():
            await asyncio.sleep(rng.expovariate(args.rate))
            t = asyncio.create_task(interactive_request(client, rng, phase, args, records))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    send = asyncio.create_task(sender())
    await asyncio.sleep(args.warmup)
    rounds = []
    content = batch_file(args.batch_lines, args.batch_output_tokens, seed=1)
    for r in range(args.rounds):
        phase["name"] = f"idle{r}"
        await asyncio.sleep(args.seconds)
        phase["name"] = "transition"
        f = await asyncio.to_thread(sync.files.create, file=("big.jsonl", content), purpose="batch")
        b = await asyncio.to_thread(sync.batches.create, input_file_id=f.id, endpoint="/v1/completions",
                                    completion_window="24h")
        t_batch = time.monotonic()
        while await asyncio.to_thread(metric, url, "batch_tier_seats") < 1:
            await asyncio.sleep(0.2)
        seats = []
        phase["name"] = f"batch{r}"
        t_end = time.monotonic() + args.seconds
        while time.monotonic() < t_end:
            seats.append(await asyncio.to_thread(metric, url, "batch_tier_seats"))
            await asyncio.sleep(1.0)
        phase["name"] = "transition"
        done = (await asyncio.to_thread(sync.batches.retrieve, b.id)).request_counts
        await asyncio.to_thread(sync.batches.cancel, b.id)
        while (await asyncio.to_thread(sync.batches.retrieve, b.id)).status != "cancelled":
            await asyncio.sleep(0.2)
        rounds.append({"batch_lines_answered_in_phase": done.completed, "batch_start_s": time.monotonic() - t_batch,
                       "batch_tier_seats_mean": sum(seats) / max(len(seats), 1)})
        print(f"round {r}: batch answered {done.completed} lines in its phase, tier seats ~{rounds[-1]}",
              file=sys.stderr)
    stop.set()
    await send
    if tasks:
        await asyncio.wait(tasks)
    await client.close()

    def summary(kind: str) -> dict:
        rs = [x for x in records if x["phase"].startswith(kind) and "error" not in x and x["first"]]
        ttft = [x["first"] - x["sent"] for x in rs]
        tpot = [(x["last"] - x["first"]) / (x["tokens"] - 1) for x in rs if x["tokens"] > 1]
        return {"requests": len(rs), "errors": sum(1 for x in records if x["phase"].startswith(kind) and "error" in x),
                "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
                "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
                "tokens_per_chunk": sum(x["tokens"] for x in rs) / max(sum(x["chunks"] for x in rs), 1)}

    idle, busy = summary("idle"), summary("batch")
    return {"idle": idle, "beside_batch": busy, "rounds": rounds,
            "ttft_p99_ratio": busy["ttft_p99_ms"] / idle["ttft_p99_ms"],
            "tpot_p50_ratio": busy["tpot_p50_ms"] / idle["tpot_p50_ms"]}


# --- part 2: the batch alone against LLM.generate ------------------------------------------------------------
def server_throughput(url: str, content: bytes) -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    f = c.files.create(file=("alone.jsonl", content), purpose="batch")
    t0 = time.monotonic()
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    assert b.status == "completed" and b.request_counts.failed == 0, b
    return {"seconds": seconds, "output_tokens": b.usage.output_tokens, "tok_s": b.usage.output_tokens / seconds}


GENERATE = """
import json, sys, time
from conveyor import LLM, SamplingParams
args = json.loads(sys.argv[1])
lines = [json.loads(x)["body"] for x in open(args["file"])]
llm = LLM(model=args["model"], max_num_seqs=args["max_num_seqs"], kv_cache_populate=True, use_tqdm_on_load=False,
          **args["engine"])
params = SamplingParams(max_tokens=lines[0]["max_tokens"], temperature=0, ignore_eos=True)
t0 = time.monotonic()
outs = llm.generate([x["prompt"] for x in lines], params, use_tqdm=False)
seconds = time.monotonic() - t0
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}))
"""


def generate_throughput(args, path: Path) -> dict:
    engine = {}  # the engine flags the server was given, as LLM keywords
    it = iter(args.engine_args)
    for flag in it:
        value = next(it)
        engine[flag.lstrip("-").replace("-", "_")] = float(value) if re.fullmatch(r"[\d.]+", value) else value
    out = subprocess.run([sys.executable, "-c", GENERATE, json.dumps({
        "file": str(path), "model": args.model, "max_num_seqs": args.max_num_seqs, "engine": engine})],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    p.add_argument("--output-tokens", type=int, default=32, help="interactive requests' output tokens")
    p.add_argument("--seconds", type=float, default=40.0, help="each phase of the latency part")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-lines", type=int, default=4000, help="lines of the batch beside interactive traffic")
    p.add_argument("--batch-output-tokens", type=int, default=128)
    p.add_argument("--throughput-lines", type=int, default=512)
    p.add_argument("--throughput-output-tokens", type=int, default=64)
    p.add_argument("--batch-tier-quiet-s", type=float, default=10.0, help="the server's (its default: 10)")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("engine_args", nargs="*", help="more engine flags for both the server and LLM (after --), e.g. "
                   "-- --dtype float32")
    args = p.parse_args()
    study = Study()
    args.engine_args = [*args.engine_args, "--batch-tier-quiet-s", str(args.batch_tier_quiet_s)]
    result: dict = {"model": args.model, "max_num_seqs": args.max_num_seqs, "args": {k: v for k, v in vars(args).items()
                                                                                       if k != "out"},
                    "cpu": cpu_name(), "load_before": load_avg()}
    work = Path(tempfile.mkdtemp(prefix="batch-tier-"))
    log = open(work / "server.log", "w+")  # noqa: SIM115 - the servers write here until the end
    if not args.skip_latency:
        with server(args, str(work / "latency"), log) as srv:
            result["latency"] = asyncio.run(latency_part(srv.url, args))
        lat = result["latency"]
        print(f"TTFT p99 idle {lat['idle']['ttft_p99_ms']:.0f} ms, beside the batch "
              f"{lat['beside_batch']['ttft_p99_ms']:.0f} ms: {lat['ttft_p99_ratio']:.2f}x (bar 2x); TPOT p50 "
              f"{lat['idle']['tpot_p50_ms']:.1f} / {lat['beside_batch']['tpot_p50_ms']:.1f} ms: "
              f"{lat['tpot_p50_ratio']:.2f}x (bar 1.3x)", file=sys.stderr)
    if not args.skip_throughput:
        path = work / "alone.jsonl"
        content = batch_file(args.throughput_lines, args.throughput_output_tokens, seed=2)
        path.write_bytes(content)
        rounds = []
        for r in range(args.rounds):
            with server(args, str(work / f"alone{r}"), log) as srv:
                served = server_throughput(srv.url, content)
            generated = generate_throughput(args, path)
            rounds.append({"batch": served, "llm_generate": generated, "ratio": served["tok_s"] / generated["tok_s"]})
            print(f"round {r}: batch {served['tok_s']:.1f} tok/s, LLM.generate {generated['tok_s']:.1f} tok/s: "
                  f"{rounds[-1]['ratio']:.2f}x (bar 0.9x)", file=sys.stderr)
        def rate(kind: str) -> float:
            return sum(x[kind]["output_tokens"] for x in rounds) / sum(x[kind]["seconds"] for x in rounds)

        result["throughput"] = {"rounds": rounds, "batch_tok_s": rate("batch"), "llm_generate_tok_s":
                                rate("llm_generate"), "ratio": rate("batch") / rate("llm_generate")}
    result["load_after"] = load_avg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        study.write(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
