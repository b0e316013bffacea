"""The lab's arithmetic on hand-checked numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.stats import (
    FlopModel,
    attention_ctx_sum,
    contiguous_waste,
    meets_slo,
    paged_waste,
    percentile,
    request_work,
    summarize,
    tpot,
)


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0


@settings(deadline=None)  # a busy machine may stall one example past hypothesis's 200 ms
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=50))
def test_percentiles_are_ordered_and_bounded(xs: list[float]) -> None:
    s = summarize(xs)
    assert min(xs) <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"] == max(xs)
    assert min(xs) - 1e-6 <= s["mean"] <= max(xs) + 1e-6


def test_tpot_and_goodput() -> None:
    assert tpot(e2e=1.0, ttft=0.1, output_len=10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None  # one token: no time *between* tokens
    assert meets_slo(0.2, 0.05, slo_ttft_s=0.3, slo_tpot_s=0.1)
    assert not meets_slo(0.4, 0.05, slo_ttft_s=0.3, slo_tpot_s=0.1)
    assert not meets_slo(0.2, 0.2, slo_ttft_s=0.3, slo_tpot_s=0.1)
    assert meets_slo(0.2, None, slo_ttft_s=0.3, slo_tpot_s=0.1)  # single-token request
    assert not meets_slo(None, None, None, None)  # never got a token


def test_flop_model_counts_by_hand() -> None:
    cfg = SimpleNamespace(hidden_size=8, num_heads=2, head_dim=4, num_kv_heads=1, intermediate_size=16,
                          num_layers=3, vocab_size=100)
    fm = FlopModel.from_config(cfg)
    # qkv 8*(8+4+4) + o 8*8 + gate/up/down 3*8*16 = 128 + 64 + 384 = 576 per layer
    assert fm.linear_params == 576 * 3
    assert fm.lm_head_params == 800
    assert fm.q_width == 8
    # 10 tokens, 2 sampled, attention over 55 keys in all
    assert fm.flops(10, 2, 55) == 2 * 1728 * 10 + 2 * 800 * 2 + 4 * 3 * 8 * 55


def test_request_work_counts_what_runs() -> None:
    # prompt 4, output 3: positions 0..5 are fed (the last sampled token never is)
    assert request_work(4, 3) == (6, 1 + 2 + 3 + 4 + 5 + 6)
    # 2 cached prompt tokens: positions 2..5 are computed
    assert request_work(4, 3, cached_tokens=2) == (4, 3 + 4 + 5 + 6)
    # a fully cached prompt still computes its last token
    assert request_work(4, 1, cached_tokens=4) == (1, 4)
    assert attention_ctx_sum(3, 3) == 0


def test_kv_waste() -> None:
    assert paged_waste(used_slots=30, used_blocks=2, block_size=16) == pytest.approx(1 - 30 / 32)
    assert paged_waste(0, 0, 16) is None
    assert contiguous_waste(num_tokens=300, num_running=3, max_model_len=1000) == pytest.approx(0.9)
    assert contiguous_waste(10, 0, 1000) is None


def test_measure_peak_flops_is_positive() -> None:
    from conveyor.bench.stats import measure_peak_flops

    assert measure_peak_flops(n=128, repeats=2) > 1e6


def test_per_tenant_results_jain_and_goodput_by_own_targets() -> None:
    from conveyor.bench.loadgen import RequestRecord, RunTiming
    from conveyor.bench.result import EngineRunStats, build_result

    def rec(i: int, tenant: str, ttft: float, out: int, slo_ttft_ms: float | None = None) -> RequestRecord:
        r = RequestRecord(i, 10, out, tenant=tenant, slo_ttft_ms=slo_ttft_ms)
        r.sent, r.token_times, r.end, r.output_len = 0.0, [ttft + 0.01 * k for k in range(out)], ttft + out, out
        return r

    records = [rec(0, "a", 0.1, 10, 200), rec(1, "a", 0.5, 10, 200), rec(2, "b", 0.2, 20), rec(3, "b", 0.3, 20)]
    res = build_result(records, RunTiming(0.0, 10.0, None, 2), EngineRunStats(), flop_model=None, peak_flops=None,
                       slo_ttft_ms=1000)
    assert res.tenants["a"]["output_tok_s"] == 2.0 and res.tenants["b"]["output_tok_s"] == 4.0
    assert abs(res.jain - 36 / 40) < 1e-9  # (2 + 4)^2 / (2 * (4 + 16))
    assert res.tenants["a"]["goodput_rps"] == 0.1  # its own 200 ms target: one of two met it
    assert res.tenants["b"]["goodput_rps"] == 0.2  # no own target: the run's 1000 ms
    assert res.goodput.requests_per_s == 0.3
    plain = build_result([rec(0, None, 0.1, 5)], RunTiming(0.0, 1.0, None, 2), EngineRunStats(), flop_model=None,
                         peak_flops=None)
    assert plain.tenants is None and plain.jain is None


def test_report_has_a_per_tenant_table_for_multi_tenant_runs() -> None:
    from conveyor.bench.loadgen import RequestRecord, RunTiming
    from conveyor.bench.report import tenant_table
    from conveyor.bench.result import EngineRunStats, build_result

    def run(tenants: list[str | None]):
        records = []
        for i, t in enumerate(tenants):
            r = RequestRecord(i, 10, 4, tenant=t)
            r.sent, r.token_times, r.end, r.output_len = 0.0, [0.1, 0.2, 0.3, 0.4], 0.4, 4
            records.append(r)
        return build_result(records, RunTiming(0.0, 1.0, None, 2), EngineRunStats(), flop_model=None,
                            peak_flops=None)

    lines = tenant_table({"x": run(["noisy", "noisy", "quiet"]), "y": run([None, None])}, ["x", "y"])
    rows = [ln for ln in lines if ln.startswith("| ") and "strategy" not in ln]
    assert [ln.split("|")[3].strip() for ln in rows] == ["noisy", "quiet"]  # y has no tenants: no rows
    assert "0.900" in rows[0]  # Jain of (8, 4) tok/s
    assert tenant_table({"y": run([None])}, ["y"]) == []
