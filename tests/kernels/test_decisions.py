"""Machine-dependent choices are measured once per key and read back after."""

from __future__ import annotations

import json

from conveyor.kernels.decisions import cpu_facts, decide


def test_measured_once_per_key_then_remembered(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    calls = []

    def measure(choice):
        calls.append(choice)
        return choice, {"us": 1.0}

    assert decide("k", {"build": "a"}, lambda: measure("x")) == "x"
    assert decide("k", {"build": "a"}, lambda: measure("y")) == "x"  # remembered, not measured again
    assert decide("k", {"build": "b"}, lambda: measure("y")) == "y"  # another build: its own decision
    assert calls == ["x", "y"]
    monkeypatch.setenv("CONVEYOR_REMEASURE", "1")
    assert decide("k", {"build": "a"}, lambda: measure("z")) == "z"
    entries = json.loads((tmp_path / "decisions.json").read_text())["k"]
    assert {e["choice"] for e in entries.values()} == {"z", "y"}
    assert all(e["key"]["cpu"] == cpu_facts() for e in entries.values())


def test_a_corrupt_cache_still_decides(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    (tmp_path / "decisions.json").write_text("{not json")
    assert decide("k", {}, lambda: ("x", {})) == "x"
