"""The prefix cache's disk tier (--kv-disk-dir), measured: what it costs, what it saves, across a restart.

    python benchmarks/kv_disk.py all [--quick] [--out docs/memory]     # everything below, in order
    python benchmarks/kv_disk.py costs        # reading a block vs recomputing it, by prefix length
    python benchmarks/kv_disk.py cycle        # distinct prefixes 4x the pool, cycling: with and without the tier
    python benchmarks/kv_disk.py restart      # a 3,000-token prefix before and after a server restart (HTTP)
    python benchmarks/kv_disk.py writecost    # throughput with the tier writing and never hit, vs no tier
    python benchmarks/kv_disk.py writecost_ab # the same, in one engine: the tier's writes on and off by turns

SmolLM2-135M (the default model), default dtype, CPU. Every configuration runs in a fresh process (a
fresh pool, as a new server has), the tier in a temporary directory on the disk under --tier-root.
`--quick` scales the workloads down (24 prefixes of 1,000 tokens instead of 64 of 2,000; fewer rounds)
for a shared machine; the numbers in docs/memory.md say which they are. Results: one JSON per part in
--out, and a summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conveyor.bench.study import Server, Study, pct

MODEL = "smollm2-135m"
BS = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


# --- in-process parts (each run in its own process: `python kv_disk.py one <json>`) ----------------------
def drive(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """Closed loop: `concurrency` requests in flight, each sent when one finishes. Per request its TTFT
    (sent to first token) and cached tokens; the window's throughput."""
    from conveyor.request import make_request
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    todo = list(enumerate(prompts))
    inflight: dict[str, float] = {}
    reqs = {}
    ttft: dict[str, float] = {}
    s0 = engine.snapshot()
    q0, h0 = s0.prefix_queries, s0.prefix_hits
    t0 = time.monotonic()
    out_tokens = 0
    while todo or inflight:
        while todo and len(inflight) < concurrency:
            i, p = todo.pop(0)
            (r,) = engine.add_request(make_request(p, params, request_id=f"q{i}-{time.monotonic_ns()}"))
            inflight[r.request_id] = time.monotonic()
            reqs[r.request_id] = r
        for d in engine.step().deltas:
            now = time.monotonic()
            if d.new_token_ids and d.request_id not in ttft:
                ttft[d.request_id] = now - inflight[d.request_id]
            out_tokens += len(d.new_token_ids)
            if d.finished:
                inflight.pop(d.request_id, None)
    dur = time.monotonic() - t0
    s1 = engine.snapshot()
    q, h = s1.prefix_queries - q0, s1.prefix_hits - h0
    t = list(ttft.values())
    return {"requests": len(prompts), "seconds": dur, "output_tok_s": out_tokens / dur,
            "total_tok_s": (sum(len(p) for p in prompts) + out_tokens) / dur, "req_s": len(prompts) / dur,
            "ttft_p50_s": pct(t, 50), "ttft_p99_s": pct(t, 99), "ttft_mean_s": statistics.mean(t),
            "hit_rate": h / q if q else 0.0,
            "cached_tokens": sum(r.num_cached_tokens for r in reqs.values())}


def tier_stats(engine) -> dict | None:
    s = engine.snapshot().kv_disk
    if s is None:
        return None
    from dataclasses import asdict

    return asdict(s)


def one(spec: dict) -> dict:
    """One configuration in this (fresh) process; `spec["part"]` says which."""
    import logging

    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("conveyor.kv_cache").setLevel(logging.INFO)
    cfg = EngineConfig(model=MODEL, num_kv_blocks=spec["pool_blocks"], max_model_len=spec.get("max_model_len"),
                       kv_cache_populate=True, kv_disk_dir=spec.get("tier"), max_num_seqs=64,
                       threads=spec.get("threads"))
    engine = LLMEngine(cfg)
    part = spec["part"]
    try:
        if part == "cycle":
            return cycle_run(engine, spec)
        if part == "writecost":
            rng = random.Random(spec["seed"])
            prompts = [tokens(rng, spec["input_len"]) for _ in range(spec["num_prompts"])]
            cpu0 = time.process_time()
            res = drive(engine, prompts, spec["concurrency"], spec["output_len"])
            if engine.kv_disk is not None:
                engine.kv_disk.flush()
            return {**res, "process_cpu_s": time.process_time() - cpu0, "tier": tier_stats(engine)}
        if part == "costs":
            return costs_run(engine, spec)
        if part == "writecost_ab":
            return writecost_ab_run(engine, spec)
        raise ValueError(part)
    finally:
        engine.close()


def cycle_run(engine, spec: dict) -> dict:
    prng = random.Random(0)  # the same system prompts in every run
    prefixes = [tokens(prng, spec["prefix_len"]) for _ in range(spec["num_prefixes"])]
    rng = random.Random(spec["seed"])  # every run's questions are its own: only the system prompts repeat
    cycles = []
    for c in range(spec["cycles"]):
        prompts = [p + tokens(rng, spec["suffix_len"]) for p in prefixes]
        res = drive(engine, prompts, spec["concurrency"], spec["output_len"])
        res["tier"] = tier_stats(engine)
        cycles.append(res)
        print(f"  cycle {c + 1}: hit rate {100 * res['hit_rate']:.0f}%, TTFT p50 {res['ttft_p50_s']:.2f} s, "
              f"p99 {res['ttft_p99_s']:.2f} s, {res['total_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    return {"cycles": cycles}


def writecost_ab_run(engine, spec: dict) -> dict:
    """One engine with a tier, batches of distinct prompts (no hits ever), the tier's writes switched on
    and off between batches: on/off, off/on, ... (the closest A/B a busy machine allows: same process, same
    pool, seconds apart). Off, the engine still offers every block and looks every prompt up; only the
    writes (the writer thread's work) stop."""
    rng = random.Random(spec["seed"])
    tier = engine.kv_disk
    out: dict[str, list] = {"on": [], "off": []}
    drive(engine, [tokens(rng, spec["input_len"]) for _ in range(4)], spec["concurrency"], spec["output_len"])
    for i in range(spec["pairs"]):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            tier.writing = on
            cpu0, w0 = time.process_time(), tier.write_cpu_s
            prompts = [tokens(rng, spec["input_len"]) for _ in range(spec["num_prompts"])]
            res = drive(engine, prompts, spec["concurrency"], spec["output_len"])
            tier.flush()
            res["writer_cpu_share"] = (tier.write_cpu_s - w0) / (time.process_time() - cpu0)
            out["on" if on else "off"].append(res)
            print(f"  pair {i + 1} writes {'on' if on else 'off'}: {res['total_tok_s']:.0f} tok/s", file=sys.stderr,
                  flush=True)
    tier.writing = True
    return {**out, "tier": tier_stats(engine)}


def costs_run(engine, spec: dict) -> dict:
    """TTFT of one request whose first k blocks are on disk (the pool forgot them) against the same
    request computed cold, for k from 1 block up; and one block's read from the page cache and from the
    disk (its pages dropped with posix_fadvise) against its recompute."""
    from conveyor.request import make_request
    from conveyor.sampling_params import SamplingParams

    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tier = engine.kv_disk

    def ttft(p: list[int]) -> tuple[float, int]:
        (r,) = engine.add_request(make_request(p, params))
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            engine.step()
        return r.first_token_time - t0 if r.first_token_time else time.monotonic() - t0, r.num_cached_tokens

    ttft(tokens(rng, 64))  # warm the kernels
    rows = []
    for k in spec["blocks"]:
        cold, disk = [], []
        for _ in range(spec["reps"]):
            p = tokens(rng, k * BS + 1)
            engine.reset_prefix_cache()
            cold.append(ttft(p)[0])
            tier.flush()
            engine.reset_prefix_cache()  # the pool forgets: the prefix comes from disk
            t, cached = ttft(p)
            assert cached == k * BS, (k, cached)
            disk.append(t)
        rows.append({"blocks": k, "tokens": k * BS, "cold_ttft_ms": 1e3 * statistics.median(cold),
                     "disk_ttft_ms": 1e3 * statistics.median(disk)})
        print(f"  {k:4d} blocks: cold {rows[-1]['cold_ttft_ms']:8.1f} ms, from disk {rows[-1]['disk_ttft_ms']:7.1f} ms",
              file=sys.stderr, flush=True)
    # one block's file, read from the page cache and from the disk
    files = sorted(tier.dir.rglob("*.kvb"))[:64]
    import numpy as np

    buf = np.empty(tier.io.block_bytes + 4096, dtype=np.uint8)

    def read_all(drop: bool) -> float:
        t = 0.0
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                if drop:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                n = os.readv(fd, [buf])
                import zlib

                zlib.crc32(memoryview(buf)[:n])
                t += time.perf_counter() - t0
            finally:
                os.close(fd)
        return t / len(files)

    read_all(False)
    warm = read_all(False)
    cold_read = read_all(True)
    s = tier.stats()
    return {"rows": rows, "block_bytes": tier.io.block_bytes, "read_page_cache_ms": 1e3 * warm,
            "read_disk_ms": 1e3 * cold_read, "policy_read_ms": s.read_ms, "policy_recompute_ms": s.recompute_ms}


def run_one(spec: dict) -> dict:
    """`one(spec)` in a fresh process (a new server's state: empty pool, the tier as the disk has it)."""
    out = subprocess.run([sys.executable, __file__, "one", json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise RuntimeError(f"{spec['part']} run failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the parts -------------------------------------------------------------------------------------------
def part_costs(args) -> dict:
    tier = Path(tempfile.mkdtemp(dir=args.tier_root, prefix="kvdisk-costs-"))
    try:
        spec = {"part": "costs", "pool_blocks": 4096, "tier": str(tier), "reps": 2 if args.quick else 3,
                "threads": args.threads,
                "blocks": [1, 2, 4, 8, 32, 125] if args.quick else [1, 2, 4, 8, 32, 125, 187]}
        res = run_one(spec)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    print(f"costs: a {res['block_bytes'] // 1024} KiB block reads in {res['read_page_cache_ms']:.3f} ms (page cache), "
          f"{res['read_disk_ms']:.3f} ms (disk); the policy's estimate of a block's recompute: "
          f"{res['policy_recompute_ms']} ms")
    return res


def part_cycle(args) -> dict:
    """Distinct prefixes 4x the pool, cycling. A first process runs one cycle with the tier (it writes the
    tier: the cycle is cold either way); then, alternating in fresh processes, one cycle with that tier
    (every prefix comes from disk: the pool holds a quarter of them, so this is the steady state) and one
    without (every prefix computed), several rounds (a busy machine drifts: compare within a round)."""
    n, length = (24, 1000) if args.quick else (64, 2000)
    pool = n * length // BS // 4  # the distinct prefixes are 4x the pool (which holds `concurrency` prompts or more)
    base = {"part": "cycle", "pool_blocks": pool, "num_prefixes": n, "prefix_len": length, "suffix_len": 32,
            "output_len": 32, "concurrency": args.concurrency, "cycles": 1, "threads": args.threads}
    rounds = 2 if args.quick else 3
    tier = Path(tempfile.mkdtemp(dir=args.tier_root, prefix="kvdisk-cycle-"))
    out: dict = {"spec": base, "rounds": []}
    print(f"cycle: {n} prefixes of {length} tokens through a pool of {pool} blocks ({pool * BS} tokens)",
          file=sys.stderr, flush=True)
    try:
        out["first_cycle_writing"] = run_one({**base, "tier": str(tier), "seed": 1})["cycles"][0]
        for i in range(rounds):
            row = {}
            for name in (("tier", "no-tier") if i % 2 == 0 else ("no-tier", "tier")):
                row[name] = run_one({**base, "tier": str(tier) if name == "tier" else None,
                                     "seed": 2 + i})["cycles"][0]
            out["rounds"].append(row)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    first = out["first_cycle_writing"]
    print(f"cycle, the first (cold, writing the tier): TTFT p50 {first['ttft_p50_s']:.2f} s, "
          f"{first['total_tok_s']:.0f} tok/s")
    for name in ("tier", "no-tier"):
        rs = [r[name] for r in out["rounds"]]
        print(f"cycle {name}: hit rate {100 * statistics.mean(c['hit_rate'] for c in rs):.0f}%, TTFT p50 "
              f"{statistics.median(c['ttft_p50_s'] for c in rs):.2f} s, "
              f"p99 {statistics.median(c['ttft_p99_s'] for c in rs):.2f} s, "
              f"{statistics.median(c['total_tok_s'] for c in rs):.0f} total tok/s, "
              f"{statistics.median(c['output_tok_s'] for c in rs):.1f} output tok/s")
    ratios = [r["tier"]["total_tok_s"] / r["no-tier"]["total_tok_s"] for r in out["rounds"]]
    ttft = [r["no-tier"]["ttft_p50_s"] / r["tier"]["ttft_p50_s"] for r in out["rounds"]]
    print(f"cycle: per round, throughput tier/no-tier {[round(x, 2) for x in ratios]}, "
          f"TTFT p50 no-tier/tier {[round(x, 1) for x in ttft]}")
    out["throughput_ratios"], out["ttft_p50_ratios"] = ratios, ttft
    return out


def part_writecost(args) -> dict:
    """The tier writes every block of distinct prompts and is never hit: its whole cost, against no tier,
    A and B alternated in fresh processes, several rounds (a busy machine drifts)."""
    rounds = 3 if args.quick else 5
    spec = {"part": "writecost", "pool_blocks": 4096, "num_prompts": 24 if args.quick else 64, "input_len": 1000,
            "output_len": 32, "concurrency": 4, "threads": args.threads}
    res: dict[str, list] = {"tier": [], "no-tier": []}
    for i in range(rounds):
        for name in (("tier", "no-tier") if i % 2 == 0 else ("no-tier", "tier")):
            tier = Path(tempfile.mkdtemp(dir=args.tier_root, prefix="kvdisk-write-")) if name == "tier" else None
            try:
                r = run_one({**spec, "seed": 100 + i, "tier": str(tier) if tier else None})
            finally:
                if tier:
                    shutil.rmtree(tier, ignore_errors=True)
            res[name].append(r)
            print(f"  round {i + 1} {name}: {r['total_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    ratios = [a["total_tok_s"] / b["total_tok_s"] for a, b in zip(res["tier"], res["no-tier"])]
    # the tier's own CPU (its writer thread), a share of the whole process's: what it takes from the engine
    # on a machine with no core to spare, whatever else runs on the machine
    cpu_share = [r["tier"]["write_cpu_s"] / r["process_cpu_s"] for r in res["tier"]]
    print(f"writecost: throughput with the tier on and no hits / off: per round {[round(x, 3) for x in ratios]}, "
          f"median {statistics.median(ratios):.3f}; tier wrote {res['tier'][-1]['tier']['writes']} blocks a round, "
          f"dropped {res['tier'][-1]['tier']['write_drops']}; the writer thread's CPU: "
          f"{[f'{100 * x:.2f}%' for x in cpu_share]} of the process's")
    return {"spec": spec, "ratios": ratios, "writer_cpu_share": cpu_share, **res}


def part_restart(args) -> dict:
    """A real server (`conveyor serve`, thread engine loop): TTFT of a 3,000-token prompt cold, then after a
    restart (SIGTERM, start again on the same --kv-disk-dir), and a never-seen prompt after the restart."""
    import httpx

    rng = random.Random(7)
    n = 3000
    seen = [tokens(rng, n) for _ in range(2)]
    fresh = [tokens(rng, n) for _ in range(2)]
    tier = Path(tempfile.mkdtemp(dir=args.tier_root, prefix="kvdisk-restart-"))

    def server() -> Server:
        extra = ["--threads", str(args.threads)] if args.threads else []
        return Server([sys.executable, "-m", "conveyor", "serve", "--port", "0", "--kv-cache-memory", "1",
                       "--kv-disk-dir", str(tier), *extra], 0, ready_timeout=600, poll_s=0.2, stop_timeout=120)

    def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first, cached = None, 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if first is None and ev.get("choices") and ev["choices"][0].get("text") is not None:
                    first = time.monotonic() - t0
                if ev.get("usage"):
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return first, cached

    out: dict = {"prompt_tokens": n}
    try:
        with server() as first:
            ttft(first.url, tokens(rng, 64))  # warm the kernels
            out["cold"] = [ttft(first.url, p) for p in seen]
        with server() as again:  # the restart: a new server on the same --kv-disk-dir
            ttft(again.url, tokens(rng, 64))
            out["after_restart"] = [ttft(again.url, p) for p in seen]
            out["after_restart_unseen"] = [ttft(again.url, p) for p in fresh]
            metrics = httpx.get(again.url + "/metrics").text
            out["metrics"] = [line for line in metrics.splitlines() if line.startswith("conveyor:kv_disk")]
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    cold = statistics.mean(t for t, _ in out["cold"])
    warm = statistics.mean(t for t, _ in out["after_restart"])
    unseen = statistics.mean(t for t, _ in out["after_restart_unseen"])
    out["ratio"] = warm / cold
    print(f"restart: {n}-token prompt TTFT cold {cold:.2f} s, after a restart {warm:.3f} s (cached tokens "
          f"{[c for _, c in out['after_restart']]}), ratio {warm / cold:.3f}; an unseen prompt after the restart "
          f"{unseen:.2f} s")
    return out


def part_writecost_ab(args) -> dict:
    tier = Path(tempfile.mkdtemp(dir=args.tier_root, prefix="kvdisk-writeab-"))
    spec = {"part": "writecost_ab", "pool_blocks": 4096, "num_prompts": 8 if args.quick else 16, "input_len": 1000,
            "output_len": 32, "concurrency": 4, "pairs": 4 if args.quick else 6, "seed": 5, "tier": str(tier),
            "threads": args.threads}
    try:
        res = run_one(spec)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    ratios = [a["total_tok_s"] / b["total_tok_s"] for a, b in zip(res["on"], res["off"])]
    share = [r["writer_cpu_share"] for r in res["on"]]
    print(f"writecost (one engine, writes on/off by turns): throughput on/off per pair "
          f"{[round(x, 3) for x in ratios]}, "
          f"median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}; the writer's CPU "
          f"{[f'{100 * x:.1f}%' for x in share]} of the process's while on")
    return {"spec": spec, "ratios": ratios, **res}


PARTS = {"costs": part_costs, "cycle": part_cycle, "restart": part_restart, "writecost": part_writecost,
         "writecost_ab": part_writecost_ab}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "one":
        print(json.dumps(one(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=[*PARTS, "all"])
    p.add_argument("--quick", action="store_true", help="smaller workloads (a shared machine)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="the engine's compute threads (default: its own)")
    p.add_argument("--tier-root", default=tempfile.gettempdir(), help="where the tiers' directories go (a local disk)")
    p.add_argument("--out", type=Path, default=None, help="write kv_disk_<part>.json files here")
    args = p.parse_args()
    study = Study()
    for name in (PARTS if args.part == "all" else [args.part]):
        res = PARTS[name](args)
        if args.out:
            study.write(args.out / f"kv_disk_{name}{'_quick' if args.quick else ''}.json", res)


if __name__ == "__main__":
    main()
