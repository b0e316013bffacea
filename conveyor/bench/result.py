"""A run's result as typed dataclasses: built from request records and engine numbers, printed,
and written to / read from JSON (`RunResult.to_json` / `from_json`).

Conventions (the same as vLLM's `benchmark_serving`): the run lasts from the start of sending to
the last response; TTFT is measured from the moment the client sent the request, so queueing in
the server counts; TPOT excludes the first token; ITL is every gap between streamed chunks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from conveyor.bench.loadgen import RequestRecord, RunTiming
from conveyor.bench.stats import FlopModel, meets_slo, request_work, summarize, tpot


@dataclass
class Summary:
    """Mean and percentiles of one latency, in seconds (None: no samples)."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values) -> Summary:
        return cls(**summarize(values))


@dataclass
class EngineRunStats:
    """What the engine did during a run: exact per-step numbers in-process, /metrics over HTTP."""

    source: str = ""
    num_steps: int | None = None
    busy_s: float | None = None
    step_phase_s: dict[str, float] | None = None  # seconds per part of the step, summed
    mean_batch_size: float | None = None
    mean_step_tokens: float | None = None
    mean_kv_usage: float | None = None
    peak_kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    num_preemptions: float | None = None
    processed_tokens: int | None = None
    prefill_tokens: int | None = None
    kv_waste_paged: float | None = None
    kv_waste_contiguous: float | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    health_latency_s: Summary | None = None  # GET /health while the run lasted (HTTP)


@dataclass
class Utilization:
    cpu: float | None = None
    gpu: float | None = None
    mfu: float | None = None
    model_flops: float | None = None
    achieved_flops_per_s: float | None = None
    peak_flops_per_s: float | None = None
    num_cpus: int | None = None
    engine_busy: float | None = None


@dataclass
class Goodput:
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    requests_per_s: float | None = None
    fraction: float | None = None


@dataclass
class RunResult:
    meta: dict  # free-form labels: strategy, request_rate, engine_config, label, ...
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_s: Summary
    tpot_s: Summary
    itl_s: Summary
    e2e_s: Summary
    goodput: Goodput
    engine: EngineRunStats
    utilization: Utilization
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] | None = None  # in-process runs kept for the occupancy plot
    tenants: dict[str, dict] | None = None  # per tenant (multi-tenant workloads): see `tenant_results`
    jain: float | None = None  # Jain's fairness index of the tenants' output tokens/s (1 = equal shares)

    def to_json(self) -> dict:
        d = asdict(self)
        if self.steps is None:
            d.pop("steps")
        return d

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        eng = dict(d.get("engine") or {})
        if eng.get("health_latency_s") is not None:
            eng["health_latency_s"] = Summary(**eng["health_latency_s"])
        known = {f.name for f in fields(EngineRunStats)}
        kw = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
        kw.update(ttft_s=Summary(**d["ttft_s"]), tpot_s=Summary(**d["tpot_s"]), itl_s=Summary(**d["itl_s"]),
                  e2e_s=Summary(**d["e2e_s"]), goodput=Goodput(**d.get("goodput") or {}),
                  engine=EngineRunStats(**{k: v for k, v in eng.items() if k in known}),
                  utilization=Utilization(**{k: v for k, v in (d.get("utilization") or {}).items()
                                             if k in {f.name for f in fields(Utilization)}}))
        return cls(**kw)


@dataclass
class CompareResults:
    """A whole `bench compare`: its plan, the machine and engine it ran on, and one result per run."""

    spec: dict  # the CompareSpec, as JSON (rates may be "inf")
    setup: dict  # model, dtype, CPU, KV pool, peak FLOP/s samples, ...
    runs: list[RunResult]
    command: str | None = None
    verdicts: list[dict] | None = None  # filled in by the report
    verdicts_other_loads: dict[str, list[dict]] | None = None

    def to_json(self) -> dict:
        d = {"spec": self.spec, "setup": self.setup, "runs": [r.to_json() for r in self.runs]}
        for k in ("command", "verdicts", "verdicts_other_loads"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_json(cls, d: dict) -> CompareResults:
        return cls(d["spec"], d["setup"], [RunResult.from_json(r) for r in d["runs"]], d.get("command"),
                   d.get("verdicts"), d.get("verdicts_other_loads"))


def build_result(records: list[RequestRecord], timing: RunTiming, engine: EngineRunStats, *,
                 flop_model: FlopModel | None, peak_flops: float | None, slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None, gpu_util: float | None = None,
                 meta: dict | None = None) -> RunResult:
    ok = [r for r in records if r.ok]
    dur = max(timing.duration, 1e-9)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (tpot(r.e2e, r.ttft, r.output_len) for r in ok if r.ttft is not None) if t is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(_good(r, slo_ttft_ms, slo_tpot_ms) for r in ok)

    util = Utilization(gpu=gpu_util, peak_flops_per_s=peak_flops, num_cpus=timing.num_cpus)
    if timing.cpu_seconds is not None:
        util.cpu = timing.cpu_seconds / dur / timing.num_cpus
    if flop_model is not None and ok:
        work = [request_work(r.prompt_len, r.output_len, r.cached_tokens) for r in ok]
        processed = engine.processed_tokens or sum(w[0] for w in work)
        flops = flop_model.flops(processed, out_tokens, sum(w[1] for w in work))
        util.model_flops = flops
        util.achieved_flops_per_s = flops / dur
        if peak_flops:
            util.mfu = flops / dur / peak_flops
    if engine.busy_s is not None:
        util.engine_busy = engine.busy_s / dur

    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    slo = (slo_ttft_ms is not None or slo_tpot_ms is not None
           or any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None for r in records))
    tenants = tenant_results(records, dur, slo_ttft_ms, slo_tpot_ms)
    return RunResult(
        tenants=tenants, jain=jain_index([t["output_tok_s"] for t in tenants.values()]) if tenants else None,
        meta=meta or {}, duration_s=dur, num_requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        errors=errors, input_tokens=in_tokens, output_tokens=out_tokens, request_throughput=len(ok) / dur,
        output_throughput=out_tokens / dur, total_token_throughput=(in_tokens + out_tokens) / dur,
        ttft_s=Summary.of(ttfts), tpot_s=Summary.of(tpots), itl_s=Summary.of(itls), e2e_s=Summary.of(e2es),
        goodput=Goodput(slo_ttft_ms, slo_tpot_ms, good / dur if slo else None, good / len(records) if slo else None),
        engine=engine, utilization=util,
        requests=[
            {"index": r.index, "prompt_len": r.prompt_len, "output_len": r.output_len, "max_tokens": r.max_tokens,
             "due_s": r.due, "sent_s": _rel(r.sent, timing.start), "ttft_s": r.ttft, "e2e_s": r.e2e,
             "cached_tokens": r.cached_tokens, "error": r.error, "tenant": r.tenant}
            for r in records
        ],
    )


def _good(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a finished request met its own targets, or else the run's."""
    ttft_ms = r.slo_ttft_ms if r.slo_ttft_ms is not None else slo_ttft_ms
    tpot_ms = r.slo_tpot_ms if r.slo_tpot_ms is not None else slo_tpot_ms
    return meets_slo(r.ttft, tpot(r.e2e, r.ttft, r.output_len) if r.ttft is not None else None,
                     ttft_ms / 1000 if ttft_ms is not None else None, tpot_ms / 1000 if tpot_ms is not None else None)


def jain_index(xs: list[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all shares are equal, 1/n when one takes all."""
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def tenant_results(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None,
                   slo_tpot_ms: float | None) -> dict[str, dict] | None:
    """Per tenant: requests, output tokens/s, TTFT p50/p99 (failed requests count as missing), goodput.
    None when every request belongs to the default tenant."""
    if all(r.tenant is None for r in records):
        return None
    out: dict[str, dict] = {}
    for name in sorted({r.tenant or "default" for r in records}):
        mine = [r for r in records if (r.tenant or "default") == name]
        ok = [r for r in mine if r.ok]
        ttfts = Summary.of([r.ttft for r in ok if r.ttft is not None])
        out[name] = {"requests": len(mine), "completed": len(ok),
                     "output_tok_s": sum(r.output_len for r in ok) / duration,
                     "ttft_p50_s": ttfts.p50, "ttft_p99_s": ttfts.p99,
                     "goodput_rps": sum(_good(r, slo_ttft_ms, slo_tpot_ms) for r in ok) / duration}
    return out


def _rel(t: float | None, t0: float) -> float | None:
    return t - t0 if t is not None else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_result(res: RunResult) -> str:
    """The human-readable table `conveyor bench run` prints."""
    eng, util, good = res.engine, res.utilization, res.goodput
    rows = [
        ("Successful requests", f"{res.completed} / {res.num_requests}"),
        ("Benchmark duration (s)", _num(res.duration_s)),
        ("Total input tokens", str(res.input_tokens)),
        ("Total generated tokens", str(res.output_tokens)),
        ("Request throughput (req/s)", _num(res.request_throughput, ".3f")),
        ("Output token throughput (tok/s)", _num(res.output_throughput)),
        ("Total token throughput (tok/s)", _num(res.total_token_throughput)),
    ]
    if good.requests_per_s is not None:
        rows.append((f"Goodput (req/s, TTFT<={good.slo_ttft_ms}ms TPOT<={good.slo_tpot_ms}ms)",
                     f"{good.requests_per_s:.3f} ({_pct(good.fraction)} of requests)"))
    for s, label in ((res.ttft_s, "TTFT"), (res.tpot_s, "TPOT"), (res.itl_s, "ITL"), (res.e2e_s, "E2E latency")):
        rows.append((f"{label} mean / p50 / p90 / p99 (ms)", " / ".join(_ms(x) for x in (s.mean, s.p50, s.p90, s.p99))))
    rows += [
        ("Mean batch size (seqs/step)", _num(eng.mean_batch_size)),
        ("Mean / peak KV cache usage", f"{_pct(eng.mean_kv_usage)} / {_pct(eng.peak_kv_usage)}"),
        ("Prefix cache hit rate", _pct(eng.prefix_hit_rate)),
    ]
    if eng.kv_waste_paged is not None:
        rows.append(("KV waste: paged / contiguous reservation",
                     f"{_pct(eng.kv_waste_paged)} / {_pct(eng.kv_waste_contiguous)}"))
    rows += [
        ("CPU utilization (server process)", _pct(util.cpu)),
        ("GPU utilization", _pct(util.gpu)),
        ("Model FLOP/s achieved / peak (GFLOP/s)",
         f"{_num(_g(util.achieved_flops_per_s))} / {_num(_g(util.peak_flops_per_s))}"),
        ("MFU", _pct(util.mfu)),
    ]
    health = eng.health_latency_s
    if health is not None and health.p50 is not None:
        rows.append(("GET /health under load p50 / p99 (ms)", f"{_ms(health.p50)} / {_ms(health.p99)}"))
    phases = eng.step_phase_s
    if phases and sum(phases.values()) > 0:
        total = sum(phases.values())
        split = " / ".join(f"{100 * v / total:.0f}%" for v in phases.values())
        rows.append(("Step time: " + " / ".join(phases), split))
    for tenant, t in (res.tenants or {}).items():
        rows.append((f"Tenant {tenant}: requests / output tok/s / TTFT p50 / p99 (ms)",
                     f"{t['completed']}/{t['requests']} / {_num(t['output_tok_s'], '.1f')} / "
                     f"{_ms(t['ttft_p50_s'])} / {_ms(t['ttft_p99_s'])}"))
    if res.jain is not None:
        rows.append(("Jain's index of tenants' output tok/s", _num(res.jain, ".3f")))
    if res.errors:
        rows.append(("Errors", ", ".join(f"{k}: {v}" for k, v in res.errors.items())))
    width = max(len(k) for k, _ in rows)
    title = f" {res.meta.get('label', 'Benchmark result')} "
    lines = [title.center(width + 24, "=")]
    lines += [f"{k:<{width}}  {v:>20}" for k, v in rows]
    lines.append("=" * (width + 24))
    return "\n".join(lines)


def _g(x: float | None) -> float | None:
    return x / 1e9 if x is not None else None
