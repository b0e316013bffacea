"""`conveyor bench sweep`: one engine knob (or a small grid of them) over a range, the rest fixed.

    conveyor bench sweep --knob max_num_seqs=8,16,32,64 --concurrency 64 --num-prompts 128
    conveyor bench sweep --knob block_size=8,16,32 --knob max_num_batched_tokens=512,2048

The model is loaded once. Before each point the engine is reset to that point's configuration
(`LLMEngine.reset`): a fresh scheduler and, when the block size or the memory budget changes, a
fresh KV pool; so every point starts cold, with the same weights, the same requests (same seed)
and the same arrival times. Each point reports what `conveyor bench run` reports (throughput,
TTFT/TPOT/E2E percentiles, peak KV use, KV waste, preemptions, MFU, goodput under the SLO) plus
memory-bandwidth utilization (the bytes every step must read, all weights plus each sequence's
K and V, over the run's time and the machine's measured read bandwidth; CPU only), and
the KV pool it had and the process's RSS after it. Points that cannot run (a pool too small for one
max_model_len sequence, say) are reported with their error, not dropped.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from conveyor.bench.compare import set_peak, warm_up
from conveyor.bench.engine_backend import EngineBackend, run_on_this_thread
from conveyor.bench.loadgen import LoadPattern
from conveyor.bench.run import run_once
from conveyor.bench.stats import FlopModel, measure_peak_flops, measure_read_bandwidth
from conveyor.bench.workloads import WorkloadSpec, generate
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.kernels.variants import cpu_name

log = logging.getLogger("conveyor.bench")

SWEEPABLE: dict[str, type] = {"max_num_seqs": int, "max_num_batched_tokens": int, "block_size": int,
                              "gpu_memory_utilization": float, "kv_cache_memory": float, "num_kv_blocks": int,
                              "scheduler": str}


def parse_knob(text: str) -> tuple[str, list]:
    """`name=v1,v2,...` with `name` one of SWEEPABLE (dashes allowed), values of its type."""
    name, sep, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not sep or name not in SWEEPABLE:
        raise ValueError(f"--knob takes NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}; got {text!r}")
    try:
        vals = [SWEEPABLE[name](v.strip()) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--knob {name}: values must be {SWEEPABLE[name].__name__}s, got {values!r}") from None
    if not vals:
        raise ValueError(f"--knob {name}: give at least one value")
    return name, vals


@dataclass
class SweepSpec:
    knobs: dict[str, list]
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: int | None = None
    request_rate: float = float("inf")
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0

    def points(self) -> list[dict]:
        names = list(self.knobs)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.knobs[n] for n in names))]


@dataclass
class SweepPoint:
    knobs: dict
    result: dict | None  # a RunResult as JSON (without per-request records), None when the point failed
    num_kv_blocks: int | None = None
    block_size: int | None = None
    rss_gib: float | None = None
    mbu: float | None = None  # memory-bandwidth utilization: bytes the steps had to read / (time x bandwidth)
    error: str | None = None


def run_point(engine: LLMEngine, cfg: EngineConfig, requests, load: LoadPattern, flop_model: FlopModel,
              peak: float, spec: SweepSpec, label: str, progress: bool, bandwidth: float | None = None
              ) -> SweepPoint:
    """One configuration, cold: reset the engine to it, drive the load, summarise."""
    knobs = {k: getattr(cfg, k) for k in spec.knobs}
    try:
        engine.reset(cfg)
    except ValueError as e:
        log.warning("%s: cannot run: %s", label, e)
        return SweepPoint(knobs, None, error=str(e))
    proc = psutil.Process()
    backend = EngineBackend(engine)
    res = run_on_this_thread(backend, functools.partial(
        run_once, backend, requests, load, flop_model=flop_model, peak_flops=peak, slo_ttft_ms=spec.slo_ttft_ms,
        slo_tpot_ms=spec.slo_tpot_ms, progress=progress, meta={"label": label, "knobs": knobs}))
    set_peak(res, peak)
    out = asdict(res)
    out.pop("requests", None)
    out.pop("steps", None)
    rss = proc.memory_info().rss
    mbu = None
    if bandwidth and res.duration_s > 0:
        # every step reads all the weights once, and each running sequence's K and V of its context
        info = engine.info
        kv_per_token = info.bytes_per_block / info.block_size
        steps = [s for s in backend.steps if s.num_tokens]
        read = len(steps) * info.weight_bytes + kv_per_token * sum(s.logical_tokens for s in steps)
        mbu = read / (res.duration_s * bandwidth)
    log.info("%s: %.1f output tok/s, TTFT p99 %.2fs, TPOT p50 %.1f ms, %d/%d ok", label, res.output_throughput,
             res.ttft_s.p99 or float("nan"), 1e3 * (res.tpot_s.p50 or float("nan")), res.completed, res.num_requests)
    return SweepPoint(knobs, out, engine.info.num_kv_blocks, engine.info.block_size, rss_gib=rss / 2**30, mbu=mbu)


def run_sweep(engine: LLMEngine, base: EngineConfig, spec: SweepSpec, progress: bool = True) -> dict:
    """Every point of the grid, in order, each on a fresh engine state; the results as JSON."""
    flop_model = FlopModel.from_config(engine.model_config)
    requests = generate(spec.workload, engine.model_config.vocab_size, engine.max_model_len)
    warm_up(engine, base, engine.model_config.vocab_size)
    peak = measure_peak_flops(engine.info.torch_dtype, engine.info.torch_device)
    bandwidth = measure_read_bandwidth() if engine.info.torch_device.type == "cpu" else None
    load = LoadPattern(concurrency=spec.concurrency, request_rate=spec.request_rate, seed=spec.workload.seed,
                       timeout_s=spec.timeout_s)
    points = spec.points()
    t0 = time.monotonic()
    out = []
    for k, point in enumerate(points):
        label = f"[{k + 1}/{len(points)}] " + " ".join(f"{n}={v}" for n, v in point.items())
        out.append(asdict(run_point(engine, replace(base, **point), requests, load, flop_model, peak, spec, label,
                                    progress, bandwidth)))
    engine.reset(base)
    return {
        "spec": {**asdict(spec), "request_rate": "inf" if spec.request_rate == float("inf") else spec.request_rate},
        "setup": {"model": base.model, "dtype": engine.info.dtype,
                  "device": engine.info.device, "cpu": cpu_name(), "num_cpus": psutil.cpu_count(),
                  "base_config": {k: getattr(base, k) for k in SWEEPABLE}, "peak_flops_per_s": peak,
                  "read_bandwidth_bytes_per_s": bandwidth,
                  "total_wall_s": time.monotonic() - t0,
                  "workload_tokens": {"input": sum(r.prompt_len for r in requests),
                                      "output": sum(r.max_tokens for r in requests)}},
        "points": out,
    }


def row(point: dict) -> dict:
    """The numbers a table or a plot shows for one point (None where the point failed)."""
    r = point["result"]
    if r is None:
        return {"knobs": point["knobs"], "error": point["error"]}
    e, u = r["engine"], r["utilization"]
    ms = lambda s, q: None if s.get(q) is None else 1e3 * s[q]
    return {"knobs": point["knobs"], "output_tok_s": r["output_throughput"], "req_s": r["request_throughput"],
            "ttft_p50_ms": ms(r["ttft_s"], "p50"), "ttft_p99_ms": ms(r["ttft_s"], "p99"),
            "tpot_p50_ms": ms(r["tpot_s"], "p50"), "tpot_p99_ms": ms(r["tpot_s"], "p99"),
            "e2e_p99_s": (r.get("e2e_s") or {}).get("p99"), "goodput_req_s": r["goodput"]["requests_per_s"],
            "peak_kv": e["peak_kv_usage"], "kv_waste": e["kv_waste_paged"], "preemptions": e["num_preemptions"],
            "mean_batch": e["mean_batch_size"], "mfu": u["mfu"], "mbu": point.get("mbu"),
            "num_kv_blocks": point["num_kv_blocks"], "rss_gib": point.get("rss_gib"), "failed": r["failed"]}


def report(results: dict) -> str:
    """A Markdown table of every point."""
    cols = [("output tok/s", "output_tok_s", "{:.1f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
            ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
            ("TPOT p99 ms", "tpot_p99_ms", "{:.1f}"), ("peak KV", "peak_kv", "{:.0%}"),
            ("KV waste", "kv_waste", "{:.1%}"), ("preempt", "preemptions", "{:.0f}"),
            ("mean batch", "mean_batch", "{:.1f}"), ("MFU", "mfu", "{:.1%}"), ("MBU", "mbu", "{:.0%}"),
            ("KV blocks", "num_kv_blocks", "{}"), ("RSS GiB", "rss_gib", "{:.2f}")]
    names = list(results["spec"]["knobs"])
    lines = ["| " + " | ".join(names + [c[0] for c in cols]) + " |", "|" + "---|" * (len(names) + len(cols))]
    for p in results["points"]:
        r = row(p)
        knobs = [str(p["knobs"][n]) for n in names]
        if "error" in r:
            lines.append("| " + " | ".join(knobs + [f"cannot run: {r['error']}"] + [""] * (len(cols) - 1)) + " |")
            continue
        cells = ["-" if r[k] is None else fmt.format(r[k]) for _, k, fmt in cols]
        lines.append("| " + " | ".join(knobs + cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir: Path) -> list[Path]:
    """For a one-knob sweep: throughput and latency against the knob (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["spec"]["knobs"])
    if len(names) != 1:
        return []
    name = names[0]
    rows = [row(p) for p in results["points"] if p["result"] is not None]
    if not rows:
        return []
    xs = [r["knobs"][name] for r in rows]
    labels = [str(x) for x in xs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(labels, [r["output_tok_s"] for r in rows], "o-")
    a.set_xlabel(name)
    a.set_ylabel("output tok/s")
    a.set_title("throughput")
    for key, lab in (("ttft_p99_ms", "TTFT p99"), ("ttft_p50_ms", "TTFT p50"), ("tpot_p50_ms", "TPOT p50")):
        b.plot(labels, [r[key] for r in rows], "o-", label=lab)
    b.set_xlabel(name)
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.legend()
    b.set_title("latency")
    fig.suptitle(f"{results['setup']['model']} on {results['setup']['cpu']}", fontsize=9)
    fig.tight_layout()
    path = out_dir / f"sweep_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def write(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out_dir / "sweep.md").write_text(report(results))
    return [out_dir / "sweep.json", out_dir / "sweep.md", *plot(results, out_dir)]
