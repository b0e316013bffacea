"""`conveyor tune`: find the knobs with the highest goodput that meet a latency target, on this machine.

    conveyor tune --slo-ttft-ms 2000 --slo-tpot-ms 100 --request-rate 4 --num-prompts 64 --time-budget 900

The search is successive halving over a coarse grid (the batching strategy x `max_num_seqs` x
`max_num_batched_tokens`), all on one model load with the same requests and arrival times:
1. every grid point runs a short version of the workload (a quarter of the prompts; in a closed loop
   at least 1.5x the concurrency, so that short runs queue as the full one does);
2. the best third (by goodput, then throughput) and the default configuration run the full workload,
   together with the neighbours of the best (half and double each knob) not yet measured.
A configuration *meets the SLO* when at least `--slo-attainment` (90%) of its requests had TTFT
and TPOT within the targets; goodput is the rate of such requests (DistServe's definition).
The answer is the full-workload configuration with the highest goodput among those that meet the
SLO (or, if none does, the one closest to it, said plainly), the Pareto front of throughput
against p99 TTFT, and the `conveyor serve` command line that uses it.

Every measured point is appended to a JSON-lines results file as soon as it is measured, keyed by
its configuration and stage; a rerun with the same file skips what it already has (resumable), and
`--time-budget` stops starting new points once spent.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from conveyor.bench.compare import set_peak, warm_up
from conveyor.bench.engine_backend import EngineBackend, run_on_this_thread
from conveyor.bench.loadgen import LoadPattern
from conveyor.bench.run import run_once
from conveyor.bench.stats import FlopModel, measure_peak_flops
from conveyor.bench.workloads import WorkloadSpec, generate
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.scheduler.policies import default_strategies

log = logging.getLogger("conveyor.tune")

STRATEGIES = tuple(default_strategies("tune"))  # the PolicySpecs marked tunable
SEQS = (16, 64, 256)
TOKENS = (512, 2048, 8192)


@dataclass
class TuneSpec:
    slo_ttft_ms: float
    slo_tpot_ms: float
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: int | None = None
    request_rate: float = float("inf")
    slo_attainment: float = 0.9
    strategies: tuple[str, ...] = STRATEGIES
    seqs: tuple[int, ...] = SEQS
    tokens: tuple[int, ...] = TOKENS
    short_fraction: float = 0.25
    keep_fraction: float = 1 / 3
    time_budget_s: float = 900.0
    timeout_s: float = 600.0


def knobs_of(cfg: EngineConfig) -> dict:
    return {"scheduler": cfg.scheduler, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens}


def key(knobs: dict, stage: str) -> str:
    return f"{stage}:{knobs['scheduler']}:{knobs['max_num_seqs']}:{knobs['max_num_batched_tokens']}"


@dataclass
class Point:
    knobs: dict
    stage: str  # "short" or "full"
    output_tok_s: float
    goodput_req_s: float
    attainment: float
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    completed: int
    num_requests: int

    @property
    def meets(self) -> bool:
        return self.attainment >= self.slo_attainment_required

    slo_attainment_required: float = 0.9

    def score(self) -> tuple:
        return (self.goodput_req_s, self.output_tok_s)


def short_count(n: int, fraction: float, concurrency: int | None) -> int:
    """How many of the workload's `n` requests a short run sends: `fraction` of them, but in a closed loop
    at least 1.5x the concurrency. Why: a short run of fewer requests than there are clients never
    queues, so a small `max_num_seqs` (which makes requests wait for a slot to keep TPOT low) looked
    free in the short runs and lost to noise (seen: SmolLM2, 24 clients, 16-request short runs, where
    max_num_seqs 16 was the only setting near the TPOT target in full runs)."""
    count = max(4, math.ceil(n * fraction))
    if concurrency:
        count = max(count, math.ceil(1.5 * concurrency))
    return min(n, count)


class Tuner:
    def __init__(self, engine: LLMEngine, base: EngineConfig, spec: TuneSpec, results_file: Path,
                 progress: bool = True) -> None:
        self.engine, self.base, self.spec, self.results_file = engine, base, spec, results_file
        self.progress = progress
        self.points: dict[str, Point] = {}
        self.fingerprint = fingerprint(base, spec)
        if results_file.exists() and results_file.stat().st_size:
            lines = [json.loads(line) for line in results_file.read_text().splitlines() if line.strip()]
            if not lines or lines[0].get("fingerprint") != self.fingerprint:
                raise ValueError(f"{results_file} holds points of another model, engine, workload, load or SLO; "
                                 "give a new --results file")
            for d in lines[1:]:
                d["slo_attainment_required"] = spec.slo_attainment
                p = Point(**d)
                self.points[key(p.knobs, p.stage)] = p
            log.info("resuming: %d points already measured in %s", len(self.points), results_file)
        else:
            results_file.write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n")
        self.flop_model = FlopModel.from_config(engine.model_config)
        vocab = engine.model_config.vocab_size
        self.full_requests = generate(spec.workload, vocab, engine.max_model_len)
        self.short_requests = self.full_requests[:short_count(len(self.full_requests), spec.short_fraction,
                                                              spec.concurrency)]
        self.peak: float | None = None
        self.t0 = time.monotonic()
        self.skipped_for_time = 0

    def config(self, knobs: dict) -> EngineConfig:
        return replace(self.base, **knobs)

    def over_budget(self) -> bool:
        return time.monotonic() - self.t0 > self.spec.time_budget_s

    def measure(self, knobs: dict, stage: str, bar: tqdm | None = None) -> Point | None:
        k = key(knobs, stage)
        if k in self.points:
            return self.points[k]
        if self.over_budget():
            self.skipped_for_time += 1
            return None
        if self.peak is None:
            warm_up(self.engine, self.base, self.engine.model_config.vocab_size)
            self.peak = measure_peak_flops(self.engine.info.torch_dtype, self.engine.info.torch_device)
        requests = self.short_requests if stage == "short" else self.full_requests
        s = self.spec
        load = LoadPattern(concurrency=s.concurrency, request_rate=s.request_rate, seed=s.workload.seed,
                           timeout_s=s.timeout_s)
        try:
            self.engine.reset(self.config(knobs))
        except ValueError as e:  # this configuration cannot run here: say so, go on with the others
            log.warning("%s cannot run: %s", knobs, e)
            return None
        backend = EngineBackend(self.engine)
        res = run_on_this_thread(backend, functools.partial(
            run_once, backend, requests, load, flop_model=self.flop_model, peak_flops=self.peak,
            slo_ttft_ms=s.slo_ttft_ms, slo_tpot_ms=s.slo_tpot_ms, progress=False, meta={"knobs": knobs}))
        set_peak(res, self.peak)
        ms = lambda v: None if v is None else 1e3 * v
        p = Point(knobs=knobs, stage=stage, output_tok_s=res.output_throughput,
                  goodput_req_s=res.goodput.requests_per_s or 0.0, attainment=res.goodput.fraction or 0.0,
                  ttft_p99_ms=ms(res.ttft_s.p99), tpot_p50_ms=ms(res.tpot_s.p50), tpot_p99_ms=ms(res.tpot_s.p99),
                  completed=res.completed, num_requests=res.num_requests,
                  slo_attainment_required=s.slo_attainment)
        self.points[k] = p
        with self.results_file.open("a") as f:
            d = {name: getattr(p, name) for name in Point.__dataclass_fields__ if name != "slo_attainment_required"}
            f.write(json.dumps(d) + "\n")
        if bar is not None:
            bar.set_postfix_str(f"{knobs['scheduler']} seqs={knobs['max_num_seqs']} "
                                f"tokens={knobs['max_num_batched_tokens']}: {p.goodput_req_s:.2f} good req/s")
        return p

    def grid(self) -> list[dict]:
        s = self.spec
        return [{"scheduler": st, "max_num_seqs": n, "max_num_batched_tokens": t}
                for st in s.strategies for n in s.seqs for t in s.tokens]

    @staticmethod
    def neighbours(knobs: dict) -> list[dict]:
        out = []
        for name, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 64)):
            for f in (0.5, 2.0):
                v = max(lo, int(knobs[name] * f))
                if v != knobs[name]:
                    out.append({**knobs, name: v})
        return out

    def measure_all(self, configs: list[dict], stage: str, bar: tqdm) -> list[Point]:
        """Measure each configuration (cached ones come from the results file); skipped ones are left out."""
        out = []
        for knobs in configs:
            p = self.measure(knobs, stage, bar)
            bar.update(1)
            if p is not None:
                out.append(p)
        return out

    def run(self) -> dict:
        grid = self.grid()
        default = knobs_of(self.base)
        with tqdm(total=len(grid), desc="short runs", unit="cfg", disable=not self.progress) as bar:
            short = self.measure_all(grid, "short", bar)
        short.sort(key=Point.score, reverse=True)
        keep = short[:max(1, math.ceil(len(short) * self.spec.keep_fraction))]
        finalists = [p.knobs for p in keep]
        if default not in finalists:
            finalists.append(default)
        with tqdm(total=len(finalists), desc="full runs", unit="cfg", disable=not self.progress) as bar:
            full = self.measure_all(finalists, "full", bar)
            best = self.best(full)
            if best is not None:  # refine around the best: half and double each knob
                done = [p.knobs for p in full]
                extra = [k for k in self.neighbours(best.knobs) if k not in done]
                bar.total += len(extra)
                full += self.measure_all(extra, "full", bar)
        return self.answer(full)

    def best(self, full: list[Point]) -> Point | None:
        meeting = [p for p in full if p.meets]
        if meeting:
            return max(meeting, key=Point.score)
        return max(full, key=lambda p: (p.attainment, p.goodput_req_s), default=None)

    def answer(self, full: list[Point]) -> dict:
        best = self.best(full)
        default = self.points.get(key(knobs_of(self.base), "full"))
        front = pareto(full)
        return {"best": best, "meets_slo": bool(best and best.meets), "default": default, "pareto": front,
                "full": sorted(full, key=Point.score, reverse=True), "measured": len(self.points),
                "skipped_for_time": self.skipped_for_time, "elapsed_s": time.monotonic() - self.t0}


def fingerprint(base: EngineConfig, spec: TuneSpec) -> str:
    """What a results file's points depend on besides the searched knobs: resuming is only right
    when all of it is the same."""
    import hashlib
    from dataclasses import asdict

    engine = {k: v for k, v in asdict(base).items() if k not in ("scheduler", "max_num_seqs", "max_num_batched_tokens")}
    what = json.dumps([engine, asdict(spec.workload), spec.concurrency, str(spec.request_rate), spec.slo_ttft_ms,
                       spec.slo_tpot_ms, spec.slo_attainment, spec.short_fraction], sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def pareto(points: list[Point]) -> list[Point]:
    """Points no other point beats on both throughput (higher) and p99 TTFT (lower)."""
    pts = [p for p in points if p.ttft_p99_ms is not None]
    front = [p for p in pts if not any(q.output_tok_s >= p.output_tok_s and q.ttft_p99_ms <= p.ttft_p99_ms
                                       and (q.output_tok_s > p.output_tok_s or q.ttft_p99_ms < p.ttft_p99_ms)
                                       for q in pts)]
    return sorted(front, key=lambda p: p.ttft_p99_ms)


def serve_command(base_argv: list[str], knobs: dict) -> str:
    """The `conveyor serve` line: the engine flags the user gave, with the tuned knobs set."""
    argv = list(base_argv)
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            i = argv.index(flag)
            argv[i + 1] = str(value)
        else:
            argv += [flag, str(value)]
    return "conveyor serve " + shlex.join(argv)


def format_answer(ans: dict, spec: TuneSpec, base_argv: list[str]) -> str:
    def line(p: Point) -> str:
        k = p.knobs
        return (f"  {k['scheduler']:<10} max_num_seqs={k['max_num_seqs']:<4} max_num_batched_tokens="
                f"{k['max_num_batched_tokens']:<6} goodput {p.goodput_req_s:6.2f} req/s ({p.attainment:4.0%} in SLO)"
                f"  {p.output_tok_s:7.1f} tok/s  TTFT p99 {p.ttft_p99_ms or float('nan'):7.0f} ms"
                f"  TPOT p50 {p.tpot_p50_ms or float('nan'):6.1f} ms")

    out = [f"SLO: TTFT <= {spec.slo_ttft_ms:g} ms and TPOT <= {spec.slo_tpot_ms:g} ms for "
           f">= {spec.slo_attainment:.0%} of requests; {ans['measured']} configurations measured in "
           f"{ans['elapsed_s']:.0f} s" + (f" ({ans['skipped_for_time']} skipped: time budget)"
                                          if ans["skipped_for_time"] else "")]
    best = ans["best"]
    if best is None:
        return "\n".join(out + ["nothing was measured (time budget too small?)"])
    out.append("best configuration" + ("" if ans["meets_slo"] else " (NONE meets the SLO; this one comes closest)")
               + ":")
    out.append(line(best))
    if ans["default"] is not None:
        out.append("the defaults:")
        out.append(line(ans["default"]))
        if ans["default"] is best or ans["default"].knobs == best.knobs:
            out.append("the defaults are already the best configuration found")
    out.append("Pareto front (throughput vs p99 TTFT):")
    out += [line(p) for p in ans["pareto"]]
    out.append("serve with:")
    out.append("  " + serve_command(base_argv, best.knobs))
    return "\n".join(out)
