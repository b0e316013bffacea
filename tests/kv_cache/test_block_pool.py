"""Property tests for the block pool and the KV manager's sharing rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kv_cache import BlockPool, KVCacheManager
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert all(c >= 0 for c in pool.ref_cnt), "a refcount went negative"
    in_tables: dict[int, int] = {}
    for table in kv.block_tables.values():
        for b in table:
            in_tables[b] = in_tables.get(b, 0) + 1
    for b, n in in_tables.items():
        assert b not in pool.free, f"block {b} is both free and in a block table"
        assert pool.ref_cnt[b] == n, f"block {b}: refcount {pool.ref_cnt[b]} but {n} tables"
    for b in pool.free:
        assert pool.ref_cnt[b] == 0
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
    assert len(pool.cached) <= pool.num_blocks


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork"]), st.integers(0, 7),
                           st.integers(1, 24), st.integers(0, 2)), max_size=60),
)
def test_refcounts_and_tables_stay_consistent(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    live: dict[int, Request] = {}
    for op, slot, n, prefix_family in ops:
        req = live.get(slot)
        if op == "add" and req is None:
            prompt = [prefix_family] * 6 + list(range(slot, slot + n))  # families share a prefix
            req = Request(f"r{slot}", prompt, SamplingParams(max_tokens=4))
            cached = kv.lookup_prefix(req)
            req.num_computed_tokens = 0
            want = req.num_tokens - len(cached) * block_size
            if kv.allocate_slots(req, want, cached):
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[slot] = req
        elif op == "grow" and req is not None:
            req.output_token_ids.extend([5] * n)
            if kv.allocate_slots(req, n):
                req.num_computed_tokens += n
                kv.cache_full_blocks(req)
            else:
                del req.output_token_ids[-n:]
        elif op == "fork" and req is not None and (slot + 1) % 8 not in live:
            child = Request(f"r{(slot + 1) % 8}", list(req.prompt_token_ids), SamplingParams(max_tokens=4))
            kv.fork(req, child, req.num_prompt_tokens - 1)
            child.num_computed_tokens = child.num_prompt_tokens - 1
            if kv.allocate_slots(child, 1):
                child.num_computed_tokens += 1
                live[(slot + 1) % 8] = child
            else:
                kv.free(child)
        elif op == "free" and req is not None:
            kv.free(req)
            del live[slot]
        check_invariants(kv)
    for req in live.values():
        kv.free(req)
    check_invariants(kv)
    assert kv.pool.num_used == 0 and kv.pool.num_free == num_blocks
    assert len(kv.pool.cached) <= num_blocks


def test_eviction_is_lru_and_tail_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.cache_block(b, 1000 + i)
    b2 = pool.allocate(2)
    for i, b in enumerate(b2):
        pool.cache_block(b, 2000 + i)
    pool.release(a)  # a's chain freed first: least recently used
    pool.release(b2)
    # the one never-used block goes first, then a's chain from its tail, then b2's
    order = pool.allocate(6)
    assert order[0] not in a + b2
    assert order[1:4] == list(reversed(a))
    assert order[4:6] == list(reversed(b2))
    assert pool.cached == {}


def test_revived_cached_block_is_not_evicted_while_in_use():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 42)
    pool.release([b])
    assert pool.lookup(42) == b
    pool.touch([b])  # a new request reuses it
    others = pool.allocate(2)
    assert b not in others and pool.lookup(42) == b
    try:
        pool.allocate(1)
        raise AssertionError("allocating beyond the pool must fail")
    except RuntimeError:
        pass
