"""Claim verdicts follow the numbers, whichever way they point."""

from __future__ import annotations

import dataclasses

from conveyor.bench.claims import DISAGREES, HOLDS, TIE, evaluate, per_load_leaders, summary_sentence
from conveyor.bench.result import EngineRunStats, Goodput, RunResult, Summary, Utilization


def fake(thr: float, ttft_p99: float, e2e_p50: float, utilization: Utilization | None = None) -> RunResult:
    return RunResult(meta={}, duration_s=1.0, num_requests=1, completed=1, failed=0, errors={}, input_tokens=1,
                     output_tokens=1, request_throughput=1.0, output_throughput=thr, total_token_throughput=thr,
                     ttft_s=Summary(p99=ttft_p99), tpot_s=Summary(), itl_s=Summary(), e2e_s=Summary(p50=e2e_p50),
                     goodput=Goodput(), engine=EngineRunStats(), utilization=utilization or Utilization())


def by_claim(verdicts) -> dict[str, str]:
    return {v.claim: v.status for v in verdicts}


def test_numbers_that_match_the_seed_hold() -> None:
    results = {"static": fake(100, 9.0, 9.0), "dynamic": fake(150, 5.0, 6.0), "continuous": fake(300, 1.0, 3.0),
               "iteration": fake(320, 0.5, 2.0)}
    v = evaluate(results, baseline=fake(30, 20.0, 20.0))
    statuses = by_claim(v)
    assert statuses["static batching gives 5-20x the throughput of no batching"] == DISAGREES  # 3.3x
    assert statuses["continuous batching gives 5-20x the throughput of no batching"] == HOLDS  # 10x
    assert all(s == HOLDS for c, s in statuses.items() if "no batching" not in c)
    assert "disagree" in summary_sentence(v)


def test_contradictions_and_ties_are_reported() -> None:
    results = {"static": fake(200, 1.0, 1.0), "dynamic": fake(100, 2.0, 2.0), "continuous": fake(102, 1.5, 1.5),
               "iteration": fake(150, 3.0, 3.0)}
    statuses = by_claim(evaluate(results, baseline=None))
    assert statuses["static has medium throughput, dynamic good (static < dynamic)"] == DISAGREES
    assert statuses["continuous has excellent throughput (dynamic < continuous)"] == TIE
    assert statuses["iteration-level has the best throughput"] == DISAGREES
    assert statuses["iteration-level has the lowest latency (p99 TTFT)"] == DISAGREES
    assert statuses["static has the highest waiting latency (p99 TTFT)"] == DISAGREES
    assert statuses["static batching gives 5-20x the throughput of no batching"] == "untested"


def test_missing_strategies_are_untested_not_failed() -> None:
    statuses = by_claim(evaluate({"iteration": fake(10, 1, 1)}, baseline=fake(1, 1, 1)))
    assert statuses["continuous has excellent throughput (dynamic < continuous)"] == "untested"
    assert statuses["iteration-level batching gives 5-20x the throughput of no batching"] == HOLDS


def test_per_load_leaders() -> None:
    sweep = {"static": {1.0: fake(10, 2.0, 1), float("inf"): fake(50, 9.0, 1)},
             "iteration": {1.0: fake(11, 0.1, 1), float("inf"): fake(40, 1.0, 1)}}
    lines = per_load_leaders(sweep)
    assert lines[0].startswith("at 1 req/s: most throughput iteration")
    assert "all requests at once: most throughput static" in lines[1] and "lowest p99 TTFT iteration" in lines[1]


def test_headroom_sentence_bounds_the_speedup_by_the_baselines_mfu() -> None:
    from conveyor.bench.claims import headroom_sentence

    def util(mfu: float, flops: float = 1e12) -> RunResult:
        return fake(1, 1, 1, Utilization(mfu=mfu, model_flops=flops))

    text = headroom_sentence({"iteration": util(0.30), "static": util(0.12)}, util(0.05))
    assert "at most about 20x" in text and "iteration" in text and "6.0x" in text
    differing = headroom_sentence({"iteration": util(0.30, 2e12)}, util(0.05))
    assert "different amounts of model FLOPs" in differing
    assert headroom_sentence({"iteration": util(0.3)}, None) is None


def test_identical_schedules_set_the_noise_floor() -> None:
    from conveyor.bench.claims import noise_floor, noise_sentence

    steps = [{"ids": [0, 1], "tok": 2}, {"ids": [1], "tok": 1}]
    static = dataclasses.replace(fake(100, 9.0, 9.0), steps=steps)
    dynamic = dataclasses.replace(fake(112, 8.5, 9.0), steps=list(steps))  # same schedule, 11% apart: noise
    results = {"static": static, "dynamic": dynamic, "continuous": fake(300, 1.0, 3.0),
               "iteration": fake(320, 0.95, 2.0)}
    noise, pairs = noise_floor(results)
    assert pairs == [("dynamic", "static")] and 0.10 < noise < 0.11
    statuses = by_claim(evaluate(results, baseline=None))
    assert statuses["static has medium throughput, dynamic good (static < dynamic)"] == TIE
    assert statuses["iteration-level has the best throughput"] == TIE  # 6.7% ahead, but below the 10.7% floor
    assert statuses["continuous has excellent throughput (dynamic < continuous)"] == HOLDS
    assert "identical schedule" in noise_sentence(results)


def test_speedup_at_the_edge_of_the_range_is_a_tie() -> None:
    results = {"continuous": fake(49, 1, 1), "iteration": fake(40, 1, 1)}
    statuses = by_claim(evaluate(results, baseline=fake(10, 1, 1)))
    assert statuses["continuous batching gives 5-20x the throughput of no batching"] == TIE  # 4.9x
    assert statuses["iteration-level batching gives 5-20x the throughput of no batching"] == DISAGREES  # 4.0x
