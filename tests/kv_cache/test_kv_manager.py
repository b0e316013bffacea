"""`KVCacheManager` block arithmetic at the edges: reused prefixes, copy-on-write, all-or-nothing."""

from __future__ import annotations

from conveyor.kv_cache import KVCacheManager
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

BS = 4


def make(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))


def compute(kv: KVCacheManager, req: Request, n: int, cached: list[int] = ()) -> None:
    """What the scheduler + runner do: allocate, then mark the tokens computed and index full blocks."""
    assert kv.allocate_slots(req, n, list(cached))
    req.num_computed_tokens += len(cached) * BS + n
    kv.cache_full_blocks(req)


def test_reusing_a_prefix_held_by_a_running_request_copies_nothing():
    """Regression: the reused prefix is read, never written, so it needs no copy-on-write (a copy
    here used to be uncounted and made a just-fitting admission raise on an empty free list)."""
    kv = KVCacheManager(5, BS)
    prompt = list(range(10, 20))  # 10 tokens: two full blocks and a partial one
    a = make("a", prompt)
    compute(kv, a, len(prompt))
    assert kv.pool.num_free == 2
    b = make("b", prompt[:8] + [99, 98])
    cached = kv.lookup_prefix(b)
    assert cached == kv.block_tables["a"][:2]
    # b needs exactly one new block for its last two tokens; two are free
    assert kv._blocks_needed(b, 2, cached) == 1 <= kv.pool.num_free
    compute(kv, b, 2, cached)
    assert kv.take_copies() == []
    assert kv.block_tables["b"][:2] == kv.block_tables["a"][:2]
    assert [kv.pool.ref_cnt[x] for x in kv.block_tables["a"][:2]] == [2, 2]
    assert kv.pool.num_free == 1
    # and with the pool exactly full, admission still fits
    c = make("c", prompt[:8] + [7, 6])
    compute(kv, c, 2, kv.lookup_prefix(c))
    assert kv.pool.num_free == 0 and kv.take_copies() == []


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(3, BS)
    r = make("r", list(range(13)))  # needs 4 blocks
    assert not kv.allocate_slots(r, 13)
    assert kv.pool.num_free == 3 and "r" not in kv.block_tables


def test_fork_then_write_copies_only_the_partial_block():
    kv = KVCacheManager(6, BS)
    parent = make("p", list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    compute(kv, parent, 6)
    child = make("c", list(range(6)))
    kv.fork(parent, child, 5)  # share the first 5 tokens' blocks; the child recomputes token 5
    child.num_computed_tokens = 5
    assert kv.block_tables["c"] == kv.block_tables["p"]
    assert kv.allocate_slots(child, 1)
    copies = kv.take_copies()
    assert copies == [(kv.block_tables["p"][1], kv.block_tables["c"][1])]
    assert kv.block_tables["c"][0] == kv.block_tables["p"][0]
    assert kv.pool.ref_cnt[kv.block_tables["p"][0]] == 2 and kv.pool.ref_cnt[kv.block_tables["p"][1]] == 1
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 6 and all(c == 0 for c in kv.pool.ref_cnt)


def test_caching_off_never_finds_a_prefix():
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make("a", list(range(12)))
    compute(kv, a, 12)
    assert kv.lookup_prefix(make("b", list(range(12)))) == []
    assert kv.pool.cached == {}
