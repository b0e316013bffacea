"""The lab's analysis: a comparison's runs organised by strategy and load, and the seed's claims
judged against them. No plotting and no prose here (`plots.py`, `report.py`), and no torch."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.bench.claims import BASELINE, TOLERANCE, Verdict, evaluate, noise_floor
from conveyor.bench.result import CompareResults, RunResult


def _rate(x) -> float:
    return float(x)


def _rate_label(r: float) -> str:
    return "all at once" if r == float("inf") else f"{r:g}"


def organize(runs: list[RunResult], table_rate: float
             ) -> tuple[dict[str, RunResult], dict[str, dict[float, RunResult]]]:
    """(strategy -> result at the table's load, strategy -> {rate -> result}) without the baseline in the sweep."""
    table, sweep = {}, {}
    for res in runs:
        s, r = res.meta["strategy"], _rate(res.meta["request_rate"])
        if r == table_rate:
            table[s] = res
        if s != BASELINE:
            sweep.setdefault(s, {})[r] = res
    return table, sweep


# --- formatting ---------------------------------------------------------------------------------------
def _by_rate(sweep: dict[str, dict[float, dict]]) -> dict[float, dict[str, dict]]:
    out: dict[float, dict[str, dict]] = {}
    for s, by_rate in sweep.items():
        for r, res in by_rate.items():
            out.setdefault(r, {})[s] = res
    return dict(sorted(out.items()))


# --- plots --------------------------------------------------------------------------------------------

@dataclass
class Analysis:
    """What the report shows, computed once from `results.json`'s data."""

    table_rate: float
    rates: list[float]
    order: list[str]  # the baseline first, then the strategies
    table: dict[str, RunResult]  # strategy -> its result at the table's load
    sweep: dict[str, dict[float, RunResult]]  # strategy -> {rate -> result} (no baseline)
    baseline: RunResult | None
    tolerance: float  # two numbers within this fraction count as a tie
    verdicts: list[Verdict]  # the seed's claims at the table's load
    other_loads: dict[float, list[Verdict]]  # the same claims at the other loads

    @property
    def strategies_at_table(self) -> dict[str, dict]:
        return {s: r for s, r in self.table.items() if s != BASELINE}


def analyze(data: CompareResults) -> Analysis:
    spec, runs = data.spec, data.runs
    table_rate = _rate(spec["table_rate"])
    rates = sorted(_rate(r) for r in spec["request_rates"])
    order = [BASELINE] + list(spec["strategies"])
    table, sweep = organize(runs, table_rate)
    baseline = table.get(BASELINE)
    at_table = {s: r for s, r in table.items() if s != BASELINE}
    # one noise floor for the whole session: the largest gap seen between identical schedules at any load
    tolerance = max([TOLERANCE] + [noise_floor(at)[0] for at in [at_table, *_by_rate(sweep).values()]])
    verdicts = evaluate(at_table, baseline, tolerance)
    other_loads = {r: evaluate(at, None, tolerance) for r, at in _by_rate(sweep).items() if r != table_rate}
    return Analysis(table_rate, rates, order, table, sweep, baseline, tolerance, verdicts, other_loads)
