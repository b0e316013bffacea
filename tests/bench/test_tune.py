"""`conveyor tune` on the tiny model: successive halving over a small grid, resumable from its
results file, bounded by its time budget; and the Pareto front and serve line it prints."""

from __future__ import annotations

from conveyor.bench.cli import main as bench_main
from conveyor.bench.tune import Point, pareto, serve_command, short_count

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "0.01", "--num-prompts", "12",
        "--input-len", "32", "--output-len", "8", "--request-rate", "30", "--slo-ttft-ms", "5000",
        "--slo-tpot-ms", "1000", "--seqs", "2,8", "--tokens", "64,256", "--strategies", "iteration,continuous",
        "--no-progress"]


def test_tune_finds_a_config_and_resumes(tiny_llama, tmp_path, capsys):
    results = tmp_path / "tune.jsonl"
    assert bench_main(["tune", "--model", str(tiny_llama), "--results", str(results), *ARGS]) == 0
    out = capsys.readouterr().out
    assert "best configuration:" in out and "Pareto front" in out
    serve = [line for line in out.splitlines() if line.strip().startswith("conveyor serve")][0]
    assert "--max-num-seqs" in serve and "--scheduler" in serve and str(tiny_llama) in serve
    lines = results.read_text().splitlines()
    short = [ln for ln in lines if '"stage": "short"' in ln]
    assert len(short) == 8  # 2 strategies x 2 x 2, each once
    assert any('"stage": "full"' in ln for ln in lines)
    # a rerun with the same file measures nothing new
    assert bench_main(["tune", "--model", str(tiny_llama), "--results", str(results), *ARGS]) == 0
    assert results.read_text().splitlines() == lines


def test_time_budget_stops_new_points(tiny_llama, tmp_path, capsys):
    results = tmp_path / "tune.jsonl"
    assert bench_main(["tune", "--model", str(tiny_llama), "--results", str(results), "--time-budget", "0",
                       *ARGS]) == 1
    assert "nothing was measured" in capsys.readouterr().out
    assert len(results.read_text().splitlines()) == 1  # the fingerprint header, no point


def test_results_of_another_workload_are_not_resumed(tiny_llama, tmp_path, capsys):
    results = tmp_path / "tune.jsonl"
    assert bench_main(["tune", "--model", str(tiny_llama), "--results", str(results), "--time-budget", "0",
                       *ARGS]) == 1
    other = [a if a != "12" else "16" for a in ARGS]  # --num-prompts 16
    assert bench_main(["tune", "--model", str(tiny_llama), "--results", str(results), *other]) == 2
    assert "another model, engine, workload" in capsys.readouterr().err


def _p(tok: float, ttft: float) -> Point:
    return Point(knobs={"scheduler": "iteration", "max_num_seqs": 1, "max_num_batched_tokens": 1}, stage="full",
                 output_tok_s=tok, goodput_req_s=1.0, attainment=1.0, ttft_p99_ms=ttft, tpot_p50_ms=1.0,
                 tpot_p99_ms=1.0, completed=1, num_requests=1)


def test_pareto_front_keeps_only_undominated_points():
    a, b, c, d = _p(100, 50), _p(200, 100), _p(150, 120), _p(300, 400)
    assert pareto([a, b, c, d]) == [a, b, d]  # c: b has more throughput and lower TTFT


def test_serve_command_sets_the_knobs():
    line = serve_command(["--model", "m", "--max-num-seqs", "4"], {"max_num_seqs": 64, "scheduler": "continuous"})
    assert line == "conveyor serve --model m --max-num-seqs 64 --scheduler continuous"


def test_short_runs_of_a_closed_loop_are_long_enough_to_queue():
    assert short_count(64, 0.25, None) == 16  # open loop: a quarter
    assert short_count(64, 0.25, 24) == 36  # 24 clients: more requests than clients, so small max_num_seqs queue
    assert short_count(64, 0.25, 4) == 16
    assert short_count(12, 0.25, 64) == 12  # never more than the workload
    assert short_count(8, 0.25, None) == 4
