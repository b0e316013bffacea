"""The default KV pool follows the model and the free RAM (runner/memory.py), and a start that cannot fit is
refused before any weight is read."""

from __future__ import annotations

import logging

import pytest

import conveyor.runner.model_runner as model_runner
from conveyor import LLM
from conveyor.model.loader import SafetensorsSource
from conveyor.runner import memory
from conveyor.runner.memory import KV_WEIGHT_MULTIPLE, default_kv_size, estimate_weight_bytes

GiB = 2**30
MiB = 2**20


def size(**kw) -> memory.KVSize:
    args = dict(bytes_per_token=1000, weight_bytes=100 * MiB, max_num_seqs=8, context=4096, min_tokens=1024,
                available=16 * GiB, headroom=GiB, fraction=0.5)
    return default_kv_size(**{**args, **kw})


def test_the_least_of_seats_weights_and_free_ram():
    # a model whose weights are small beside its K/V: 4x the weights wins
    s = size(max_num_seqs=256)
    assert s.budget == KV_WEIGHT_MULTIPLE * 100 * MiB and s.note.startswith(f"{KV_WEIGHT_MULTIPLE:g}x the weights")
    # few seats of short sequences: every seat at full length is all that could ever be used
    s = size(max_num_seqs=2, context=1024)
    assert s.budget == 2 * 1024 * 1000 and s.note.startswith("every seat at full length")
    # large weights on a full machine: half of what is free after them
    s = size(max_num_seqs=256, bytes_per_token=10_000, weight_bytes=8 * GiB, available=5 * GiB)
    assert s.budget == 0.5 * 4 * GiB and s.note.startswith("0.5 of the free RAM")
    # never less than one sequence of the minimum length
    s = size(max_num_seqs=1, context=16, weight_bytes=1)
    assert s.budget == 1024 * 1000


def test_no_room_for_one_sequence_is_refused():
    with pytest.raises(ValueError, match="not enough memory left for the KV cache: one 1024-token sequence"):
        size(bytes_per_token=GiB // 100, available=5 * GiB)


def test_weight_estimate_matches_what_the_runner_holds(tiny_llama, monkeypatch):
    """The refusal is only as good as the estimate: it matches the loaded model's bytes for every mode."""
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "none")
    import torch

    from conveyor.model.packed_linear import packing_available

    packed = packing_available(torch.device("cpu"), torch.bfloat16)
    for quantization in (None, "int8", "int4", "int8_per_channel"):
        llm = LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=8, max_model_len=64, quantization=quantization)
        held = llm.engine.info.weight_bytes
        est = estimate_weight_bytes(llm.engine.model_config, 2, quantization, packed)
        assert abs(est - held) <= 0.01 * held, (quantization, est, held)


def test_default_pool_is_sized_and_logged(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "available_ram", lambda: 8 * GiB)
    with caplog.at_level(logging.INFO, logger="conveyor.runner"):
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    info = llm.engine.info
    pool = info.num_kv_blocks * info.bytes_per_block
    # the tiny model's weights are ~0.5 MB: 4x them is less than every seat at 256 tokens and than free RAM
    want = max(KV_WEIGHT_MULTIPLE * info.weight_bytes, 256 * info.bytes_per_block // info.block_size)
    assert want - info.bytes_per_block < pool <= want
    assert "KV pool:" in caplog.text and "4x the weights" in caplog.text
    assert f"{info.num_kv_blocks * 16 // 256} full-length sequences of 256 tokens" in caplog.text


def test_refused_before_any_weight_is_read(tiny_llama, monkeypatch):
    reads = []
    real = SafetensorsSource.read
    monkeypatch.setattr(SafetensorsSource, "read", lambda self, *a, **k: reads.append(a[0]) or real(self, *a, **k))
    monkeypatch.setattr(model_runner, "available_ram", lambda: 2 * MiB)
    with pytest.raises(ValueError, match=r"not enough memory for .*: its weights take ~0\.00 GiB in float32, one "
                                         r"256-token sequence's KV cache .* only 0\.00 GiB of RAM are available"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    assert reads == []


def test_explicit_sizes_are_kept(tiny_llama, monkeypatch):
    """--kv-cache-memory and num_kv_blocks size the pool as given, whatever the default rule would say."""
    monkeypatch.setattr(model_runner, "available_ram", lambda: 8 * GiB)
    info = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=0.01).engine.info
    assert info.num_kv_blocks == int(0.01 * GiB // info.bytes_per_block)
    assert LLM(str(tiny_llama), dtype="float32", max_model_len=256, num_kv_blocks=40).engine.info.num_kv_blocks == 40


def test_an_explicit_pool_shorter_than_max_model_len_is_refused_before_reading(tiny_llama, monkeypatch):
    reads = []
    real = SafetensorsSource.read
    monkeypatch.setattr(SafetensorsSource, "read", lambda self, *a, **k: reads.append(a[0]) or real(self, *a, **k))
    with pytest.raises(ValueError, match=r"max_model_len \(256\) is larger than the KV cache can hold \(128 tokens\)"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=256, num_kv_blocks=8)
    assert reads == []
