"""`conveyor:engine_config_info` is generated from EngineConfig's declaration: every scalar option is a
label, so an option added to the dataclass shows up in /metrics without touching the metrics code."""

from __future__ import annotations

import dataclasses

from conveyor.config import EngineConfig
from conveyor.server.metrics import config_labels


def test_every_scalar_option_is_a_label_with_its_value():
    cfg = EngineConfig(max_num_seqs=7, scheduler="fair", kv_cache_memory=None, enable_lora=True)
    labels = config_labels(cfg)
    scalar = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "tokenizer")
              and (getattr(cfg, f.name) is None or isinstance(getattr(cfg, f.name), (str, int, float, bool)))]
    assert list(labels) == scalar and len(scalar) >= 30
    assert labels["max_num_seqs"] == "7" and labels["scheduler"] == "fair"
    assert labels["kv_cache_memory"] == "" and labels["enable_lora"] == "True"
    assert "model" not in labels
