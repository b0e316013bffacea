"""Turn a run's request records and engine numbers into one JSON-able result, and print it.

Conventions (the same as vLLM's `benchmark_serving`): the run lasts from the start of sending to
the last response; TTFT is measured from the moment the client sent the request, so queueing in
the server counts; TPOT excludes the first token; ITL is every gap between streamed chunks.
"""

from __future__ import annotations

from conveyor.bench.loadgen import RequestRecord, RunTiming
from conveyor.bench.stats import FlopModel, meets_slo, request_work, summarize, tpot


def build_result(records: list[RequestRecord], timing: RunTiming, engine: dict, *, flop_model: FlopModel | None,
                 peak_flops: float | None, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                 gpu_util: float | None = None, meta: dict | None = None) -> dict:
    ok = [r for r in records if r.ok]
    dur = max(timing.duration, 1e-9)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (tpot(r.e2e, r.ttft, r.output_len) for r in ok if r.ttft is not None) if t is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    slo_ttft_s = slo_ttft_ms / 1000 if slo_ttft_ms is not None else None
    slo_tpot_s = slo_tpot_ms / 1000 if slo_tpot_ms is not None else None
    good = sum(meets_slo(r.ttft, tpot(r.e2e, r.ttft, r.output_len) if r.ttft is not None else None,
                         slo_ttft_s, slo_tpot_s) for r in ok)

    util: dict = {"cpu": None, "gpu": gpu_util, "mfu": None, "model_flops": None, "achieved_flops_per_s": None,
                  "peak_flops_per_s": peak_flops, "num_cpus": timing.num_cpus}
    if timing.cpu_seconds is not None:
        util["cpu"] = timing.cpu_seconds / dur / timing.num_cpus
    if flop_model is not None and ok:
        work = [request_work(r.prompt_len, r.output_len, r.cached_tokens) for r in ok]
        processed = engine.get("processed_tokens") or sum(w[0] for w in work)
        flops = flop_model.flops(processed, out_tokens, sum(w[1] for w in work))
        util["model_flops"] = flops
        util["achieved_flops_per_s"] = flops / dur
        if peak_flops:
            util["mfu"] = flops / dur / peak_flops
    if engine.get("busy_s") is not None:
        util["engine_busy"] = engine["busy_s"] / dur

    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "meta": meta or {},
        "duration_s": dur,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_s": summarize(ttfts),
        "tpot_s": summarize(tpots),
        "itl_s": summarize(itls),
        "e2e_s": summarize(e2es),
        "goodput": {
            "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
            "requests_per_s": good / dur if (slo_ttft_s is not None or slo_tpot_s is not None) else None,
            "fraction": good / len(records) if (slo_ttft_s is not None or slo_tpot_s is not None) else None,
        },
        "engine": engine,
        "utilization": util,
        "requests": [
            {"index": r.index, "prompt_len": r.prompt_len, "output_len": r.output_len, "max_tokens": r.max_tokens,
             "due_s": r.due, "sent_s": _rel(r.sent, timing.start), "ttft_s": r.ttft, "e2e_s": r.e2e,
             "cached_tokens": r.cached_tokens, "error": r.error}
            for r in records
        ],
    }


def _rel(t: float | None, t0: float) -> float | None:
    return t - t0 if t is not None else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_result(res: dict) -> str:
    """The human-readable table `conveyor bench run` prints."""
    eng, util, good = res["engine"], res["utilization"], res["goodput"]
    rows = [
        ("Successful requests", f"{res['completed']} / {res['num_requests']}"),
        ("Benchmark duration (s)", _num(res["duration_s"])),
        ("Total input tokens", str(res["input_tokens"])),
        ("Total generated tokens", str(res["output_tokens"])),
        ("Request throughput (req/s)", _num(res["request_throughput"], ".3f")),
        ("Output token throughput (tok/s)", _num(res["output_throughput"])),
        ("Total token throughput (tok/s)", _num(res["total_token_throughput"])),
    ]
    if good["requests_per_s"] is not None:
        rows.append((f"Goodput (req/s, TTFT<={good['slo_ttft_ms']}ms TPOT<={good['slo_tpot_ms']}ms)",
                     f"{good['requests_per_s']:.3f} ({_pct(good['fraction'])} of requests)"))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency")):
        s = res[key]
        rows.append((f"{label} mean / p50 / p90 / p99 (ms)",
                     " / ".join(_ms(s[k]) for k in ("mean", "p50", "p90", "p99"))))
    rows += [
        ("Mean batch size (seqs/step)", _num(eng.get("mean_batch_size"))),
        ("Mean / peak KV cache usage", f"{_pct(eng.get('mean_kv_usage'))} / {_pct(eng.get('peak_kv_usage'))}"),
        ("Prefix cache hit rate", _pct(eng.get("prefix_hit_rate"))),
    ]
    if eng.get("kv_waste_paged") is not None:
        rows.append(("KV waste: paged / contiguous reservation",
                     f"{_pct(eng['kv_waste_paged'])} / {_pct(eng.get('kv_waste_contiguous'))}"))
    rows += [
        ("CPU utilization (server process)", _pct(util.get("cpu"))),
        ("GPU utilization", _pct(util.get("gpu"))),
        ("Model FLOP/s achieved / peak (GFLOP/s)",
         f"{_num(_g(util.get('achieved_flops_per_s')))} / {_num(_g(util.get('peak_flops_per_s')))}"),
        ("MFU", _pct(util.get("mfu"))),
    ]
    health = eng.get("health_latency_s")
    if health and health.get("p50") is not None:
        rows.append(("GET /health under load p50 / p99 (ms)", f"{_ms(health['p50'])} / {_ms(health['p99'])}"))
    phases = eng.get("step_phase_s")
    if phases and sum(phases.values()) > 0:
        total = sum(phases.values())
        split = " / ".join(f"{100 * v / total:.0f}%" for v in phases.values())
        rows.append(("Step time: " + " / ".join(phases), split))
    if res["errors"]:
        rows.append(("Errors", ", ".join(f"{k}: {v}" for k, v in res["errors"].items())))
    width = max(len(k) for k, _ in rows)
    title = f" {res['meta'].get('label', 'Benchmark result')} "
    lines = [title.center(width + 24, "=")]
    lines += [f"{k:<{width}}  {v:>20}" for k, v in rows]
    lines.append("=" * (width + 24))
    return "\n".join(lines)


def _g(x: float | None) -> float | None:
    return x / 1e9 if x is not None else None
