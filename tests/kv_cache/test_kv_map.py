"""The dashboard's map of the KV pool (`conveyor/kv_cache/kv_map.py`), on a real engine's pool."""

from __future__ import annotations

from conveyor.engine.llm_engine import LLMEngine
from conveyor.kv_cache.kv_map import kv_map
from conveyor.request import make_request
from conveyor.sampling_params import SamplingParams
from tests.server.conftest import tiny_config


def test_kv_map_shows_shared_and_cached_blocks(tiny_llama):
    engine = LLMEngine(tiny_config(tiny_llama, num_kv_blocks=64))
    prompt = list(range(100, 100 + 40))
    engine.add_request(make_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True), request_id="a"))
    engine.step()
    engine.add_request(make_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True), request_id="b"))
    engine.step()
    m = kv_map(engine.kv.pool)
    assert m.num_blocks == 64 and m.blocks_per_cell == 1 and sum(m.totals) == 64
    assert m.totals[3] == 2  # the two full prompt blocks both requests point at
    assert m.totals[2] + m.totals[3] == engine.snapshot().kv_blocks_used
    while engine.has_unfinished_requests():
        engine.step()
    m = kv_map(engine.kv.pool)
    assert m.totals[2] == m.totals[3] == 0 and m.totals[1] > 0  # finished: cached, evictable
    small = kv_map(engine.kv.pool, max_cells=16)
    assert small.blocks_per_cell == 4 and len(small.cells) == 16
