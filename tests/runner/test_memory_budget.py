"""vLLM's `--gpu-memory-utilization` on CPU: a fraction of total RAM for the whole engine, the KV
cache getting what the weights, the runtime and a step's activations leave."""

from __future__ import annotations

import gc
import threading

import psutil
import pytest

from conveyor import LLM
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine

GiB = 2**30


def fraction(extra_gib: float) -> float:
    """The utilization that leaves about `extra_gib` beyond what this process holds now."""
    return min(1.0, (psutil.Process().memory_info().rss + extra_gib * GiB) / psutil.virtual_memory().total)


def test_higher_utilization_gives_more_kv_blocks(tiny_llama):
    if psutil.virtual_memory().available < 2 * GiB:
        pytest.skip("needs 2 GiB of free RAM")
    # the budget reads the machine's free RAM: a pool of an earlier test still being faulted in (at the idle
    # class, in the gaps) would take some of it between the two builds
    gc.collect()
    for t in threading.enumerate():
        if t.name == "conveyor-kv-populate":
            t.join(timeout=120)
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8)
    small = LLM(str(tiny_llama), gpu_memory_utilization=fraction(0.3), **kw).engine.info
    large = LLM(str(tiny_llama), gpu_memory_utilization=fraction(0.6), **kw).engine.info
    assert large.num_kv_blocks > small.num_kv_blocks > 0
    # about 0.3 GiB more RAM buys about 0.3 GiB more KV (the process's RSS moved a little in between)
    extra = (large.num_kv_blocks - small.num_kv_blocks) * large.bytes_per_block / GiB
    assert 0.15 < extra < 0.45, extra


def test_kv_cache_memory_wins(tiny_llama):
    info = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=0.01,
               gpu_memory_utilization=fraction(0.5)).engine.info
    assert info.num_kv_blocks * info.bytes_per_block <= 0.01 * GiB


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
        EngineConfig(model="x", gpu_memory_utilization=bad)


def test_too_small_to_hold_the_engine_is_a_clear_error(tiny_llama):
    # less RAM than this process already holds: nothing left for the KV cache
    u = psutil.Process().memory_info().rss * 0.5 / psutil.virtual_memory().total
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=256,
                               gpu_memory_utilization=u))


def test_more_than_the_machine_has_free_is_a_clear_error(tiny_llama, monkeypatch):
    """A machine whose RAM is mostly taken by others: asking for 90% of it is refused up front."""
    import conveyor.runner.model_runner as mr

    real = psutil.virtual_memory()
    busy = real._replace(available=psutil.Process().memory_info().rss + GiB // 2)
    monkeypatch.setattr(mr.psutil, "virtual_memory", lambda: busy)
    with pytest.raises(ValueError, match="available to this process; lower it"):
        LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=256, gpu_memory_utilization=0.9))
