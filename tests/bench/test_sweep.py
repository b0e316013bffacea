"""`conveyor bench sweep` on the tiny model: every point runs cold with its own knobs, a new KV pool
when the block size changes, and the table, JSON and plot are written."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.cli import main as bench_main
from conveyor.bench.sweep import parse_knob

WORKLOAD = ["--num-prompts", "12", "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
            "--no-progress", "--timeout", "60", "--concurrency", "6"]


def test_sweep_grid_runs_every_point_cold(tiny_llama, tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(tiny_llama), "--kv-cache-memory", "0.01", "--max-model-len", "256",
            "--knob", "block_size=8,32", "--knob", "max-num-seqs=1,4", "--out-dir", str(out), *WORKLOAD]
    assert bench_main(argv) == 0
    data = json.loads((out / "sweep.json").read_text())
    pts = data["points"]
    assert [p["knobs"] for p in pts] == [{"block_size": b, "max_num_seqs": s} for b in (8, 32) for s in (1, 4)]
    for p in pts:
        r = p["result"]
        assert r["completed"] == 12 and r["failed"] == 0
        assert r["engine"]["block_size"] == p["knobs"]["block_size"] == p["block_size"]
        assert r["engine"]["mean_batch_size"] <= p["knobs"]["max_num_seqs"] + 1e-9
        assert 0 < p["mbu"] < 1.5  # an estimate: bytes every step must read over time x measured bandwidth
    # same memory, 4x the block size: about a quarter of the blocks
    small, large = pts[0]["num_kv_blocks"], pts[2]["num_kv_blocks"]
    assert 3.5 < small / large < 4.5, (small, large)
    assert max(p["result"]["engine"]["mean_batch_size"] for p in pts if p["knobs"]["max_num_seqs"] == 4) > 1.5
    table = (out / "sweep.md").read_text()
    assert table.count("\n| ") == 4 and "output tok/s" in table and "MBU" in table


def test_one_knob_sweep_plots_and_reports_points_that_cannot_run(tiny_llama, tmp_path):
    out = tmp_path / "sweep"
    # 16 blocks of 8 tokens cannot hold one 256-token sequence: that point is reported, not dropped
    argv = ["sweep", "--model", str(tiny_llama), "--max-model-len", "256", "--kv-cache-memory", "0.01",
            "--knob", "num_kv_blocks=16,64", "--out-dir", str(out), "--block-size", "8", *WORKLOAD]
    assert bench_main(argv) == 0
    data = json.loads((out / "sweep.json").read_text())
    assert data["points"][0]["result"] is None and "cannot hold" in data["points"][0]["error"]
    assert data["points"][1]["result"]["completed"] == 12
    assert (out / "sweep_num_kv_blocks.png").stat().st_size > 0
    assert "cannot run" in (out / "sweep.md").read_text()


@pytest.mark.parametrize("bad", ["max_num_seqs", "nope=1,2", "max_num_seqs=a,b", "block_size="])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError, match="--knob"):
        parse_knob(bad)
