"""`conveyor bench compare`: every batching strategy, plus no batching, on one workload.

The model is loaded once; before each run the engine gets a fresh scheduler, policy and empty KV
manager for the strategy (`LLMEngine.reset`), so every run starts cold with the same weights, the
same requests (same seed) and the same arrival times. Each strategy runs at every offered load;
the no-batching baseline (continuous with max_num_seqs=1, one request at a time) runs at the
table's load, which is all the "relative to no batching" column needs.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch

from conveyor.bench.claims import BASELINE
from conveyor.bench.engine_backend import EngineBackend, run_on_this_thread, strategy_config
from conveyor.bench.loadgen import LoadPattern
from conveyor.bench.result import CompareResults, RunResult
from conveyor.bench.run import run_once
from conveyor.bench.stats import FlopModel, measure_peak_flops
from conveyor.bench.workloads import WorkloadSpec, generate
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.kernels.variants import cpu_name
from conveyor.request import make_request
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.policies import POLICIES, default_strategies, no_batching_base, policy_options

log = logging.getLogger("conveyor.bench")


@dataclass
class CompareSpec:
    strategies: list[str] = field(default_factory=lambda: default_strategies("compare"))
    baseline: bool = True
    request_rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0])
    table_rate: float | None = None  # the load the comparison table is taken at (default: the highest)
    burstiness: float = 1.0
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0  # per run
    peak_matmul_size: int = 2048  # n of the n x n x n GEMM that measures the machine's peak

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in POLICIES]
        if bad or not self.strategies:
            raise ValueError(f"strategies must be a non-empty subset of {tuple(POLICIES)}, got {self.strategies}")
        if not self.request_rates or any(r <= 0 for r in self.request_rates):
            raise ValueError(f"request_rates must be positive numbers (or inf), got {self.request_rates}")
        if self.table_rate is None:
            self.table_rate = max(self.request_rates)
        elif self.table_rate not in self.request_rates:
            raise ValueError(f"table_rate {self.table_rate} must be one of the request rates {self.request_rates}")

    def plan(self) -> list[tuple[str, float]]:
        """(strategy, rate) in run order; the baseline first, so a hung baseline shows early."""
        runs = [(BASELINE, self.table_rate)] if self.baseline else []
        return runs + [(s, r) for s in self.strategies for r in self.request_rates]


def baseline_config(base: EngineConfig) -> EngineConfig:
    """No batching: continuous scheduling with one sequence at a time."""
    return strategy_config(base, no_batching_base(), max_num_seqs=1)


def config_for(base: EngineConfig, strategy: str) -> EngineConfig:
    return baseline_config(base) if strategy == BASELINE else strategy_config(base, strategy)


def warm_up(engine: LLMEngine, base: EngineConfig, vocab_size: int) -> None:
    """One short batch through the model, so the first measured run does not pay one-time costs
    (thread pool start, allocator growth, lazy kernel selection)."""
    engine.reset(strategy_config(base, no_batching_base()))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(make_request([100 + (7 * i + j) % max(vocab_size - 100, 1) for j in range(32)], params,
                                        defaults=engine.info.request_defaults))
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    engine.abort_all()


def run_compare(engine: LLMEngine, base: EngineConfig, spec: CompareSpec, progress: bool = True) -> CompareResults:
    """Run the whole plan: one result per (strategy, rate)."""
    flop_model = FlopModel.from_config(engine.model_config)
    measure = lambda: measure_peak_flops(engine.info.torch_dtype, engine.info.torch_device,
                                         n=spec.peak_matmul_size)
    peaks = [measure()]
    vocab = engine.model_config.vocab_size
    requests = generate(spec.workload, vocab, engine.max_model_len)
    warm_up(engine, base, vocab)
    runs = []
    plan = spec.plan()
    t_start = time.monotonic()
    for k, (strategy, rate) in enumerate(plan):
        cfg = config_for(base, strategy)
        engine.reset(cfg)
        peaks.append(measure())  # a shared machine's peak varies: keep sampling it, use the best
        load = LoadPattern(request_rate=rate, burstiness=spec.burstiness, seed=spec.workload.seed,
                           timeout_s=spec.timeout_s)
        label = f"[{k + 1}/{len(plan)}] {strategy} @ {load.label}"
        meta = {"label": label, "strategy": strategy, "request_rate": _rate_json(rate), "load": load.label,
                "engine_config": _config_dict(cfg)}
        backend = EngineBackend(engine)
        res = run_on_this_thread(backend, functools.partial(
            run_once, backend, requests, load, flop_model=flop_model, peak_flops=peaks[-1],
            slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms, progress=progress,
            keep_steps=rate == spec.table_rate, meta=meta))
        log.info("%s: %.1f output tok/s, TTFT p99 %.2fs, %d/%d ok", label, res.output_throughput,
                 res.ttft_s.p99 or float("nan"), res.completed, res.num_requests)
        runs.append(res)
    engine.reset(base)
    peak = max(peaks)
    for res in runs:
        set_peak(res, peak)
    return CompareResults(
        spec=_spec_dict(spec),
        setup={
            "model": base.model, "dtype": engine.info.dtype,
            "device": engine.info.device, "torch_threads": torch.get_num_threads(),
            "cpu": cpu_name(), "num_cpus": psutil.cpu_count(), "num_kv_blocks": engine.info.num_kv_blocks,
            "block_size": base.block_size, "max_model_len": engine.max_model_len,
            "peak_flops_per_s": peak, "peak_flops_samples": peaks,
            "model_flops_per_token": 2 * flop_model.linear_params,
            "total_wall_s": time.monotonic() - t_start,
            "workload_tokens": {"input": sum(r.prompt_len for r in requests),
                                "output": sum(r.max_tokens for r in requests)},
        },
        runs=runs,
    )


def set_peak(res: RunResult, peak: float) -> None:
    """Restate a result's MFU against `peak` (the best matmul rate seen over the whole session)."""
    util = res.utilization
    util.peak_flops_per_s = peak
    if util.achieved_flops_per_s is not None:
        util.mfu = util.achieved_flops_per_s / peak


def _config_dict(cfg: EngineConfig) -> dict:
    keep = ("scheduler", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size")
    out = {k: getattr(cfg, k) for k in keep}
    out["policy_options"] = policy_options(cfg)  # each policy's own knobs (scheduler/policies.py)
    for opt in ("batch_size", "batch_timeout_ms", "max_num_partial_prefills", "static_flush_ms"):
        out[opt] = getattr(cfg, opt)  # flat too: reports written before the registry read these
    return out


def _spec_dict(spec: CompareSpec) -> dict:
    d = asdict(spec)
    d["request_rates"] = [_rate_json(r) for r in spec.request_rates]
    d["table_rate"] = _rate_json(spec.table_rate)
    return d


def _rate_json(r: float) -> float | str:
    return "inf" if r == float("inf") else r
