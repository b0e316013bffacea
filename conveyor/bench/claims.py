"""Test the seed's claims about batching against measured numbers, and say where they disagree.

The seed's table, turned into checkable statements:

| strategy   | throughput | latency            |
|------------|------------|--------------------|
| static     | medium     | high (waiting)     |
| dynamic    | good       | medium             |
| continuous | excellent  | low                |
| iteration  | best of both (throughput and latency) |

plus "batching gives 5-20x the throughput of no batching". "medium < good < excellent" becomes an
ordering of output throughput, "high > medium > low" an ordering of latency, checked on p99 TTFT
(the waiting a user sees) and on median end-to-end latency. Two numbers closer than the noise
floor count as a tie, reported as such rather than as support or contradiction: the floor is
`TOLERANCE`, or more when two strategies ran the identical schedule and still differ (identical
work in different time is the machine's noise). Nothing here is decided in advance: every sentence
is generated from the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from conveyor.scheduler.policies import POLICIES

if TYPE_CHECKING:
    from conveyor.bench.result import RunResult

BASELINE = "none"  # the no-batching baseline's name in results

TOLERANCE = 0.05
SPEEDUP_RANGE = (5.0, 20.0)
HOLDS, TIE, DISAGREES, UNTESTED = "holds", "tie", "disagrees", "untested"


@dataclass
class Verdict:
    claim: str
    status: str
    detail: str


def _throughput(res: dict) -> float:
    return res.output_throughput


def _ttft_p99(res: dict) -> float | None:
    return res.ttft_s.p99


def _e2e_p50(res: dict) -> float | None:
    return res.e2e_s.p50


def _fmt(value: float, unit: str) -> str:
    return f"{value:.1f} tok/s" if unit == "tok/s" else f"{value * 1000:.0f} ms"


def schedule_signature(res: dict) -> tuple | None:
    """What the engine did, step by step (who was in the batch, how many tokens), without timings."""
    steps = res.steps
    return tuple((tuple(st["ids"]), st["tok"]) for st in steps) if steps else None


def noise_floor(results: dict[str, RunResult]) -> tuple[float, list[tuple[str, str]]]:
    """The largest relative difference between strategies that executed the identical schedule.

    Identical work that took different times measures the machine's noise, not batching; any
    difference smaller than that is no evidence either way.
    """
    sigs = {k: schedule_signature(v) for k, v in results.items()}
    pairs = [(a, b) for a in results for b in results if a < b and sigs[a] is not None and sigs[a] == sigs[b]]
    noise = 0.0
    for a, b in pairs:
        for metric in (_throughput, _ttft_p99, _e2e_p50):
            x, y = metric(results[a]), metric(results[b])
            if x and y:
                noise = max(noise, abs(x - y) / max(x, y))
    return noise, pairs


class Judge:
    """Checks orderings between strategies, calling differences within `tolerance` ties."""

    def __init__(self, results: dict[str, RunResult], tolerance: float, same_schedule: list[tuple[str, str]]) -> None:
        self.results = results
        self.tolerance = tolerance
        self.same = {frozenset(p) for p in same_schedule}

    def _close(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.tolerance * max(abs(a), abs(b))

    def order(self, claim: str, lower: str, higher: str, metric: Callable[[dict], float | None], metric_name: str,
              unit: str) -> Verdict:
        """Claim: metric(lower) < metric(higher), beyond the tolerance."""
        if lower not in self.results or higher not in self.results:
            return Verdict(claim, UNTESTED, f"{lower} or {higher} was not run")
        a, b = metric(self.results[lower]), metric(self.results[higher])
        if a is None or b is None:
            return Verdict(claim, UNTESTED, f"no {metric_name} for {lower} or {higher}")
        measured = f"{metric_name}: {lower} {_fmt(a, unit)}, {higher} {_fmt(b, unit)}"
        if frozenset((lower, higher)) in self.same:
            return Verdict(claim, TIE, f"{measured}, but both ran the identical schedule: the gap is machine noise")
        if self._close(a, b):
            return Verdict(claim, TIE, f"{measured} (within {self.tolerance:.0%}: no measurable difference)")
        if a < b:
            return Verdict(claim, HOLDS, measured)
        return Verdict(claim, DISAGREES, f"{measured}: the opposite of the claim")

    def best(self, claim: str, who: str, metric: Callable[[dict], float | None], metric_name: str, unit: str,
             higher_is_better: bool) -> Verdict:
        """Claim: `who` is the best of all strategies on `metric` (ties within tolerance count as best)."""
        vals = {k: metric(v) for k, v in self.results.items()}
        vals = {k: v for k, v in vals.items() if v is not None}
        if who not in vals or len(vals) < 2:
            return Verdict(claim, UNTESTED, f"needs {who} and at least one other strategy")
        ranked = sorted(vals, key=vals.get, reverse=higher_is_better)
        best_name = ranked[0]
        listing = ", ".join(f"{k} {_fmt(v, unit)}" for k, v in vals.items())
        if best_name == who:
            rival = ranked[1]
            if frozenset((who, rival)) in self.same:
                return Verdict(claim, TIE, f"{metric_name}: {listing} ({who} leads, but {rival} ran the identical "
                                           f"schedule: the gap is machine noise)")
            if self._close(vals[who], vals[rival]):
                return Verdict(claim, TIE, f"{metric_name}: {listing} ({who} leads {rival} by less than "
                                           f"{self.tolerance:.0%}: no measurable difference)")
            return Verdict(claim, HOLDS, f"{metric_name}: {listing}")
        if frozenset((who, best_name)) in self.same:
            return Verdict(claim, TIE, f"{metric_name}: {listing} ({who} and {best_name} ran the identical "
                                       f"schedule: the gap is machine noise)")
        if self._close(vals[who], vals[best_name]):
            return Verdict(claim, TIE, f"{metric_name}: {listing} ({who} within {self.tolerance:.0%} of "
                                       f"{best_name})")
        side = "higher" if higher_is_better else "lower"
        return Verdict(claim, DISAGREES, f"{metric_name}: {listing}; {best_name} is {side} than {who}")


def evaluate(results: dict[str, RunResult], baseline: RunResult | None,
             tolerance: float | None = None) -> list[Verdict]:
    """Every testable claim, for the strategies in `results` (name -> result at one load).

    The tie tolerance is `TOLERANCE` or the measured noise floor (`noise_floor`), whichever is larger.
    """
    noise, pairs = noise_floor(results)
    judge = Judge(results, max(TOLERANCE, noise) if tolerance is None else tolerance, pairs)
    out: list[Verdict] = []
    lo, hi = SPEEDUP_RANGE
    for name, res in results.items():
        shown = POLICIES[name].shown if name in POLICIES else name
        claim = f"{shown} batching gives {lo:g}-{hi:g}x the throughput of no batching"
        if baseline is None or not _throughput(baseline):
            out.append(Verdict(claim, UNTESTED, "no baseline run"))
            continue
        x = _throughput(res) / _throughput(baseline)
        detail = (f"{_throughput(res):.1f} vs {_throughput(baseline):.1f} output tok/s without batching: "
                  f"{x:.1f}x")
        if lo <= x <= hi:
            out.append(Verdict(claim, HOLDS, detail))
        elif lo * (1 - judge.tolerance) <= x <= hi * (1 + judge.tolerance):
            out.append(Verdict(claim, TIE, f"{detail}: just outside the claimed range, but within the noise"))
        else:
            where = "below" if x < lo else "above"
            out.append(Verdict(claim, DISAGREES, f"{detail}, {where} the claimed range"))

    # each strategy's own claims, from its PolicySpec: throughput first, then latency on each metric
    metrics = {"throughput": [(_throughput, "output throughput", "tok/s")],
               "latency": [(_ttft_p99, "p99 TTFT", "s"), (_e2e_p50, "median E2E latency", "s")]}
    for kind, measures in metrics.items():
        for metric, metric_name, unit in measures:
            for name, spec in POLICIES.items():
                for c in spec.claims:
                    if c.metric != kind:
                        continue
                    text = c.text.format(metric=metric_name)
                    if c.below is not None:  # the claim: this strategy's metric < `below`'s
                        out.append(judge.order(text, name, c.below, metric, metric_name, unit))
                    else:
                        out.append(judge.best(text, name, metric, metric_name, unit,
                                              higher_is_better=(c.extreme == "highest")))
    return out


def noise_sentence(results: dict[str, RunResult]) -> str | None:
    noise, pairs = noise_floor(results)
    if not pairs:
        return None
    names = ", ".join(f"{a} and {b}" for a, b in pairs)
    return (f"Noise check: {names} executed the identical schedule at this load (the same requests in every "
            f"step), yet their throughput and latency differ by up to {noise:.0%}. That is this machine's "
            f"run-to-run noise, so differences below {max(TOLERANCE, noise):.0%} are counted as ties.")


def summary_sentence(verdicts: list[Verdict]) -> str:
    tested = [v for v in verdicts if v.status != UNTESTED]
    holds = sum(v.status == HOLDS for v in tested)
    ties = sum(v.status == TIE for v in tested)
    against = [v.claim for v in tested if v.status == DISAGREES]
    s = f"Of {len(tested)} tested claims, {holds} hold, {ties} are ties (no difference beyond noise)"
    s += f" and {len(against)} {'disagrees' if len(against) == 1 else 'disagree'} with the measurements."
    if against:
        s += " The measurements disagree with: " + "; ".join(f"*{c}*" for c in against) + "."
    return s


def headroom_sentence(results: dict[str, RunResult], baseline: RunResult | None) -> str | None:
    """Why the speedup is what it is: the same work in less time means proportionally more MFU, so
    no batcher can beat 1 / (the baseline's MFU) on this machine."""
    mfu = {k: r.utilization.mfu for k, r in results.items()}
    mfu = {k: v for k, v in mfu.items() if v}
    base = baseline.utilization.mfu if baseline is not None else None
    if not base or not mfu:
        return None
    best = max(mfu, key=mfu.get)
    flops = [r.utilization.model_flops or 0 for r in [*results.values(), baseline]]
    if min(flops) <= 0 or max(flops) / min(flops) > 1.02:
        return (f"The strategies computed different amounts of model FLOPs (recompute after preemption or prefix "
                f"hits: {min(flops) / 1e9:.0f}-{max(flops) / 1e9:.0f} GFLOP), so throughput and MFU ratios differ; "
                f"without batching the engine used {base:.1%} of the measured peak, the best strategy ({best}) "
                f"{mfu[best]:.1%}.")
    return (f"Every strategy computed the same model FLOPs for this workload (within 2%), so throughput relative "
            f"to no batching equals MFU relative to no batching. Without batching the engine already used "
            f"{base:.1%} of the measured peak, so a perfect batcher could gain at most about {1 / base:.0f}x "
            f"here; the best strategy ({best}) reached {mfu[best]:.1%} MFU, {mfu[best] / base:.1f}x the "
            f"baseline's.")


def per_load_leaders(sweep: dict[str, dict[float, RunResult]]) -> list[str]:
    """For every offered load: who had the most throughput and who the lowest p99 TTFT."""
    rates = sorted({r for by_rate in sweep.values() for r in by_rate})
    lines = []
    for rate in rates:
        at = {s: by_rate[rate] for s, by_rate in sweep.items() if rate in by_rate}
        if len(at) < 2:
            continue
        thr = max(at, key=lambda s: _throughput(at[s]))
        ttft = {s: _ttft_p99(r) for s, r in at.items() if _ttft_p99(r) is not None}
        fast = min(ttft, key=ttft.get) if ttft else None
        load = "all requests at once" if rate == float("inf") else f"{rate:g} req/s"
        line = f"at {load}: most throughput {thr} ({_throughput(at[thr]):.1f} tok/s)"
        if fast is not None:
            line += f", lowest p99 TTFT {fast} ({ttft[fast] * 1000:.0f} ms)"
        lines.append(line)
    return lines


def verdicts_json(verdicts: list[Verdict]) -> list[dict]:
    return [asdict(v) for v in verdicts]
