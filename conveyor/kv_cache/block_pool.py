"""The pool of physical KV blocks: a free list in LRU order, reference counts and the prefix-hash index.

A block is in exactly one of three states:
- in use: ref_cnt > 0 (one or more block tables point at it);
- free and cached: ref_cnt == 0 but it still holds a full block whose hash is indexed, so a later
  request with the same prefix can revive it;
- free and empty: ref_cnt == 0, no hash.
Free blocks sit in one ordered dict used as an LRU queue. Empty blocks go to the head so they are
handed out first; cached blocks go to the tail, so the least recently used cached block is the one
evicted when the pool runs dry. Eviction never touches a block in use, because in-use blocks are
not in the queue at all.

A second tier on disk (`disk_tier.py`) hooks in through two callbacks, `on_cache` (a block was just
indexed) and `on_evict` (a cached block is about to be handed out again), and reads `generation`: each
block's count of times its hash was dropped, so that a copy taken from the block off the engine's
thread can tell afterwards whether the block was reused meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class BlockKey(NamedTuple):
    """What a cached block's hash stands for, compared in full on every lookup: a hit must be the same
    tokens, under the same salt and adapter, after the same parent, whatever the hash function does."""

    parent: bytes | None
    tokens: tuple[int, ...]
    salt: str | None
    lora: str | None = None  # the LoRA adapter's digest: its K/V differ from the base model's


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.block_key: list[BlockKey | None] = [None] * num_blocks  # of each cached block
        self.num_key_mismatches = 0  # lookups whose hash matched but whose block was another
        self.num_evictions = 0
        # the disk tier's hooks (None without one) and its seqlock: +1 whenever a block's hash is dropped
        self.on_cache: Callable[[int, bytes, BlockKey | None], None] | None = None
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.generation = [0] * num_blocks
        self.retired = False  # replaced by another pool (`LLMEngine.reset`): its generations say nothing more

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty ones plus evictable cached ones)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.free if self.block_hash[b] is not None)

    def state_codes(self) -> np.ndarray:
        """One byte per block: 0 free and empty, 1 free but cached (evictable), 2 in use, 3 shared (ref > 1)."""
        ref = np.fromiter(self.ref_cnt, dtype=np.int32, count=self.num_blocks)
        cached = np.fromiter((h is not None for h in self.block_hash), dtype=bool, count=self.num_blocks)
        return np.where(ref > 1, 3, np.where(ref == 1, 2, cached.astype(np.int32))).astype(np.uint8)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, evicting their cached contents."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                self.num_evictions += 1
                if self.on_evict is not None:  # before anyone can write into it
                    self.on_evict(block, h)
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.block_hash[block] = None
                self.block_key[block] = None
                self.generation[block] += 1
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, block_hash, key: BlockKey | None = None) -> int | None:
        """The cached block under `block_hash`, if its `key` matches too (a hash collision is a miss)."""
        if not self.enable_caching:
            return None
        b = self.cached.get(block_hash)
        if b is not None and key is not None and self.block_key[b] is not None and self.block_key[b] != key:
            self.num_key_mismatches += 1
            return None
        return b

    def touch(self, blocks: list[int]) -> None:
        """Add a reference to each block, taking free (cached) ones out of the free queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop a reference to each block. Freed cached blocks join the LRU tail.

        Blocks are released in reverse so that, of one request's chain, the tail blocks are nearer
        the head of the queue and evicted before the shared prefix blocks in front of them.
        """
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise AssertionError(f"block {b} released more often than taken")
            if self.ref_cnt[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    def cache_block(self, block: int, block_hash, key: BlockKey | None = None) -> None:
        """Index a full, in-use block under its chained hash (first writer wins)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return  # an identical block already exists (or a colliding one): this copy stays private
        self.block_hash[block] = block_hash
        self.block_key[block] = key
        self.cached[block_hash] = block
        if self.on_cache is not None:
            self.on_cache(block, block_hash, key)

    def reset_cache(self) -> None:
        """Forget every cached-but-free block (used by tests and benchmarks for a cold start)."""
        for b in list(self.free):
            h = self.block_hash[b]
            if h is not None:
                self.cached.pop(h, None)
                self.block_hash[b] = None
                self.block_key[b] = None
                self.generation[b] += 1
