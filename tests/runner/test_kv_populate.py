"""`kv_cache_populate`: a server faults its KV pool's pages in at startup (so a fresh server's first
requests do not page-fault inside the attention's parallel region); one-off runs leave it lazy."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import threading
import time

from conveyor import LLM, SamplingParams
from conveyor.engine.args import add_engine_args, engine_config_from_args
from tests.engine.insides import kv_pool_is_zero, kv_pool_resident_bytes, wait_for_kv_populate

POOL_GIB = 0.25


def make(tiny_llama, populate: bool) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=POOL_GIB,
               kv_cache_populate=populate)


def test_populated_pool_is_resident_and_lazy_one_is_not(tiny_llama):
    lazy = make(tiny_llama, False)
    pool = lazy.engine.info.num_kv_blocks * lazy.engine.info.bytes_per_block
    assert pool > 0.2 * 2**30
    eager = make(tiny_llama, True)
    assert kv_pool_resident_bytes(lazy.engine) < 0.5 * pool, "a lazy pool should not be resident before it is used"
    assert kv_pool_resident_bytes(eager.engine) > 0.9 * pool, "a populated pool should be resident after startup"
    # the contents were left zero (a masked slot must meet 0, never garbage) and outputs do not change
    assert kv_pool_is_zero(eager.engine)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    out_lazy = [o.outputs[0].token_ids for o in lazy.generate(prompts, params, use_tqdm=False)]
    out_eager = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert out_lazy == out_eager


def test_without_madvise_populate_the_pool_is_written_with_zeros(tiny_llama, monkeypatch):
    """Kernels before Linux 5.14 (and other systems): the fallback touches every page by zeroing it."""
    import conveyor.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "_madvise_populate", lambda t: errno.EINVAL)
    llm = make(tiny_llama, True)
    pool = llm.engine.info.num_kv_blocks * llm.engine.info.bytes_per_block
    assert kv_pool_resident_bytes(llm.engine) > 0.9 * pool
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_out_of_memory_leaves_the_pool_lazy(tiny_llama, monkeypatch, caplog):
    import conveyor.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "_madvise_populate", lambda t: errno.ENOMEM)
    llm = make(tiny_llama, True)
    pool = llm.engine.info.num_kv_blocks * llm.engine.info.bytes_per_block
    assert kv_pool_resident_bytes(llm.engine) < 0.5 * pool
    assert "stays lazy" in caplog.text


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_cli_default_depends_on_the_command():
    assert engine_config_from_args(parse([]), {"kv_cache_populate": True}).kv_cache_populate is True
    assert engine_config_from_args(parse([])).kv_cache_populate is False
    populate = {"kv_cache_populate": True}
    assert engine_config_from_args(parse(["--no-kv-cache-populate"]), populate).kv_cache_populate is False
    assert engine_config_from_args(parse(["--kv-cache-populate"])).kv_cache_populate is True


def test_beyond_the_first_part_the_pool_is_faulted_in_in_the_background(tiny_llama, monkeypatch, caplog):
    """Only the blocks handed out first are faulted in before the engine serves; the rest follows on a thread,
    contents unchanged, and a new pool stops it (the knob lab rebuilds pools)."""
    import logging

    import conveyor.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "KV_POPULATE_SYNC_BYTES", 16 * 2**20)

    def populating() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "conveyor-kv-populate"]

    with caplog.at_level(logging.INFO, logger="conveyor.runner"):
        llm = make(tiny_llama, True)
        assert "on a background thread" in caplog.text
        for thread in populating():
            thread.join(timeout=60)
    pool = llm.engine.info.num_kv_blocks * llm.engine.info.bytes_per_block
    assert "the rest of the pool" in caplog.text
    assert kv_pool_resident_bytes(llm.engine) > 0.9 * pool
    assert kv_pool_is_zero(llm.engine)
    # a new pool (the knob lab's reset): a background fault-in of the old one is stopped and joined first
    monkeypatch.setattr(model_runner, "_madvise_populate", lambda t: time.sleep(0.05) or 0)  # a slow fault-in
    llm.engine.reset(dataclasses.replace(llm.engine.config, kv_cache_memory=POOL_GIB / 2))
    slow = populating()
    assert slow
    llm.engine.reset(dataclasses.replace(llm.engine.config, kv_cache_memory=POOL_GIB / 4))
    assert not any(t.is_alive() for t in slow)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_background_part_runs_at_the_idle_class(tiny_llama, monkeypatch):
    """Past its first part the pool is faulted in on a thread of the idle scheduling class: at the normal class
    it took a core from the engine's own compute threads, whose steps wait for the slowest one (a 1B prefill
    1.5x slower while it ran). Only that thread changes class; the pool still fills (the test above)."""
    from conveyor.runner import model_runner

    monkeypatch.setattr(model_runner, "KV_POPULATE_SYNC_BYTES", 16 << 20)
    classes = []
    real = model_runner._lowest_priority

    def spy() -> None:
        real()
        classes.append(os.sched_getscheduler(0))

    monkeypatch.setattr(model_runner, "_lowest_priority", spy)
    llm = make(tiny_llama, True)
    assert wait_for_kv_populate(llm.engine, timeout=120), "past its first part the pool fills in the background"
    assert classes == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the process and its other threads keep theirs
