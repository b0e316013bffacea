"""Speculative decoding, measured on served SmolLM2: off, ngram and the int4 self-draft, one server
after the other on the same machine.

1. One client at a time, the committed repeat workload (`benchmarks/workloads/repeat_edit.json`:
   8 passages, each to be repeated with a light edit; chat, greedy, up to 256 tokens, streamed).
   Output tok/s = all output tokens / wall time of the 8 requests; acceptance from /metrics.
2. 64 concurrent clients on the random workload of `benchmarks/vs_vllm.py` (`conveyor bench run`:
   prompts 128-384, outputs 64-192, ignore_eos), to check that speculation costs nothing under load.

    python benchmarks/speculative.py --out docs/speculative/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import LOADS  # noqa: E402

from conveyor.bench.study import Server, Study, cpu_name, lab_run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "self-draft int4": {"method": "draft", "model": "self", "quantization": "int4", "num_speculative_tokens": 3},
    "layer-skip 24 of 30 int8": {"method": "draft", "model": "self", "quantization": "int8", "num_layers": 24,
                                  "num_speculative_tokens": 3},
}


def server(spec: dict | None, port: int, log) -> Server:
    """`conveyor serve` of SmolLM2 with `spec` as its --speculative-config, not started."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", "smollm2-135m", "--port", str(port),
           "--host", "127.0.0.1", "--log-interval", "1000"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return Server(cmd, port, log=log, ready_timeout=600, poll_s=1.0, stop_timeout=30, term_group=True)


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name.startswith("conveyor:spec_decode") and "position" not in s.labels:
                out[s.name.removeprefix("conveyor:")] = s.value
    return out


def repeat_workload(url: str, max_tokens: int) -> dict:
    items = json.loads((REPO / "benchmarks/workloads/repeat_edit.json").read_text())["items"]
    tokens, t0 = 0, time.perf_counter()
    tpots = []
    with httpx.Client(timeout=600) as c:
        for it in items:
            body = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": it["passage"] + "\n\n" + it["instruction"]}]}
            first, n = None, 0
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter()
            end = time.perf_counter()
            tokens += n
            if first is not None and n > 1:
                tpots.append((end - first) / (n - 1))
    wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "tpot_ms_mean": 1000 * sum(tpots) / len(tpots)}


def load64(url: str, out: Path, log) -> dict:
    import subprocess

    r = lab_run(url, ["--served-model", "smollm2-135m", "--model", "smollm2-135m", "--dtype", "bfloat16",
                      "--no-progress", *LOADS["64 clients"]], out, stdout=log, stderr=subprocess.STDOUT)
    return {"output_tok_s": r["output_throughput"], "ttft_p50_ms": 1000 * r["ttft_s"]["p50"],
            "tpot_p50_ms": 1000 * r["tpot_s"]["p50"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs/speculative/results.json")
    ap.add_argument("--configs", default="off,ngram,self-draft int4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-load", action="store_true", help="only the single-client repeat workload")
    args = ap.parse_args()
    study = Study()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out.parent / "servers.log", "a")  # noqa: SIM115 - every server's, to the end
    results: dict = {"cpu": cpu_name(), "nproc": os.cpu_count(), "configs": {}}
    for name in args.configs.split(","):
        spec = CONFIGS[name]
        with server(spec, 8020, log) as srv:
            url = srv.url
            res: dict = {"speculative_config": spec}
            repeat_workload(url, 16)  # warm-up
            before = metrics(url)
            res["repeat, 1 client"] = repeat_workload(url, args.max_tokens)
            after = metrics(url)
            d = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
            drafts, guessed = d.get("spec_decode_num_drafts_total", 0), d.get("spec_decode_num_draft_tokens_total", 0)
            kept = d.get("spec_decode_num_accepted_tokens_total", 0)
            res["repeat, 1 client"].update(acceptance_rate=kept / guessed if guessed else None,
                                          mean_accepted_length=1 + kept / drafts if drafts else None)
            print(name, "repeat:", res["repeat, 1 client"], flush=True)
            if not args.skip_load:
                res["random, 64 clients"] = load64(url, args.out.parent / f"load64_{name.replace(' ', '_')}.json", log)
                print(name, "64 clients:", res["random, 64 clients"], flush=True)
            results["configs"][name] = res
    off = results["configs"].get("off")
    print("\n| config | repeat, 1 client: tok/s | vs off | acceptance | mean accepted length | 64 clients: tok/s "
          "| vs off |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results["configs"].items():
        rep, l64 = r["repeat, 1 client"], r.get("random, 64 clients")
        ratio = rep["output_tok_s"] / off["repeat, 1 client"]["output_tok_s"] if off else float("nan")
        acc = f"{rep['acceptance_rate']:.0%}" if rep["acceptance_rate"] is not None else "-"
        mal = f"{rep['mean_accepted_length']:.2f}" if rep["mean_accepted_length"] is not None else "-"
        lt = f"{l64['output_tok_s']:.1f}" if l64 else "-"
        lr = f"{l64['output_tok_s'] / off['random, 64 clients']['output_tok_s']:.2f}x" if l64 and off and \
            off.get("random, 64 clients") else "-"
        print(f"| {name} | {rep['output_tok_s']:.1f} | {ratio:.2f}x | {acc} | {mal} | {lt} | {lr} |")
    study.write(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
