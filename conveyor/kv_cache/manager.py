"""Per-request block tables on top of the shared `BlockPool`.

The scheduler asks three questions of it: how many prompt tokens are already cached
(`lookup_prefix`), can this request get room for N more tokens (`allocate_slots`), and give its
blocks back (`free`). Copy-on-write pairs for shared, partly written blocks are queued in
`pending_copies` for the model runner to apply before the step writes any KV.

With a disk tier (`disk_tier.py`), prompt blocks past the pool's hits may also be read back from
disk (`prefetch`, `fetch_from_tier`, `poll_loads`): they enter the pool as cached blocks, so
everything after that (admission, `cached_tokens`, sharing) treats them as prefix-cache hits.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import TYPE_CHECKING

from conveyor.kv_cache.block_pool import BlockKey, BlockPool
from conveyor.request import Request

if TYPE_CHECKING:
    from conveyor.kv_cache.disk_tier import DiskTier, LoadJob

log = logging.getLogger("conveyor.kv_cache")

_NO_PARENT = b"\0" * 32


def hash_block(parent: bytes | None, tokens: tuple[int, ...], salt: str | None, lora: str | None = None) -> bytes:
    """A full block's identity: SHA-256 over its parent's hash, its own token ids, the tenant's salt and
    the LoRA adapter's digest (an adapter on k/v or any earlier layer changes every K/V, so a prefix
    computed under one adapter must never serve another, as in vLLM).

    Chained through the parents, it names the block's whole prefix, which is what its K/V depend on.
    A cryptographic hash, not Python's 64-bit `hash()`: a crafted prompt must not be able to collide
    with another tenant's block and read its K/V (the bug vLLM fixed in GHSA-rm76-4mrf-v9r8). The pool
    also checks the block's own tokens, salt and parent hash on every hit (`BlockKey`)."""
    h = hashlib.sha256(parent or _NO_PARENT)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if salt is not None:
        s = salt.encode()
        h.update(struct.pack("<q", len(s)) + s)
    if lora is not None:
        s = lora.encode()
        h.update(b"lora" + struct.pack("<q", len(s)) + s)
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tier: DiskTier | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chained hashes of a request's full blocks
        self._keys: dict[str, list[BlockKey]] = {}  # what each hash stands for, checked on every hit
        self._num_indexed: dict[str, int] = {}  # how many of a request's blocks are indexed
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        # the disk tier (None: memory only): loads in flight per request, and loads started per request
        self.tier = tier if enable_caching else None
        self._loads: dict[str, LoadJob] = {}
        self._load_attempts: dict[str, int] = {}
        # blocks read for requests not admitted yet: rid -> [blocks, read ahead of admission, steps left]
        self._unclaimed: dict[str, list] = {}
        if self.tier is not None:
            self.tier.attach(self.pool)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free, or cached and evictable): the one number a policy needs."""
        return self.pool.num_free

    def num_blocks_of(self, req: Request) -> int:
        """Blocks `req` holds now."""
        return len(self.block_tables.get(req.request_id, ()))

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def _block_hashes(self, req: Request, num_full: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        keys = self._keys.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            own = tuple(tokens[i * bs:(i + 1) * bs])
            hashes.append(hash_block(parent, own, req.cache_salt, req.lora_key))
            keys.append(BlockKey(parent, own, req.cache_salt, req.lora_key))
        return hashes

    def prefix_block_hashes(self, req: Request) -> list[bytes]:
        """Chained hashes of the full blocks a prefix lookup for `req` may use (memoized per request)."""
        return self._block_hashes(req, (req.num_tokens - 1) // self.block_size)

    def lookup_prefix(self, req: Request) -> list[int]:
        """The longest run of cached full blocks that starts the request's tokens.

        At least one token is always left to compute, since the step needs its logits.
        """
        if not self.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        keys = self._keys[req.request_id]
        blocks = []
        for h, key in zip(hashes[:max_blocks], keys):
            b = self.pool.lookup(h, key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def _blocks_needed(self, req: Request, num_new_tokens: int, cached: list[int]) -> int:
        table = self.block_tables.get(req.request_id, [])
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(table) - len(cached)
        start = req.num_computed_tokens + len(cached) * self.block_size
        need += sum(1 for b in self._shared_write_blocks(req, table, start, num_new_tokens))
        revived = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)  # leave the free queue
        return max(need, 0) + revived

    def _shared_write_blocks(self, req: Request, table: list[int], start: int, num_new_tokens: int):
        """Indices of existing blocks that this step writes into (from token `start` on) but other
        tables share. `start` counts the cached prefix, which is read, never written."""
        if num_new_tokens <= 0:
            return
        first = start // self.block_size
        last = (start + num_new_tokens - 1) // self.block_size
        for i in range(first, min(last + 1, len(table))):
            if self.pool.ref_cnt[table[i]] > 1:
                yield i

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens (after `cached` prefix blocks). All or nothing."""
        if self._blocks_needed(req, num_new_tokens, cached) > self.pool.num_free:
            return False
        if self._unclaimed:
            self._unclaimed.pop(req.request_id, None)  # admitted (or running): what was read for it is its own
        table = self.block_tables.setdefault(req.request_id, [])
        if cached:
            self.pool.touch(list(cached))
            table.extend(cached)
        start = req.num_computed_tokens + len(cached) * self.block_size
        for i in list(self._shared_write_blocks(req, table, start, num_new_tokens)):
            (fresh,) = self.pool.allocate(1)
            self.pending_copies.append((table[i], fresh))
            self.pool.release([table[i]])
            table[i] = fresh
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `parent`'s first `num_tokens` tokens (parallel
        sampling). Nothing is copied now: a later write into a shared block copies that block."""
        table = self.block_tables[parent.request_id][: -(-num_tokens // self.block_size)]
        self.pool.touch(table)
        self.block_tables[child.request_id] = list(table)

    def cache_full_blocks(self, req: Request) -> None:
        """Index the request's newly completed full blocks so later requests can reuse them."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(table))
        start = self._num_indexed.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        keys = self._keys[req.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i], keys[i])
        self._num_indexed[req.request_id] = num_full

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks that hold the request's first `num_tokens` tokens (speculative
        decoding: the rest held rejected guesses). Never touches an indexed (cached) block."""
        table = self.block_tables.get(req.request_id)
        keep = max(-(-num_tokens // self.block_size), self._num_indexed.get(req.request_id, 0))
        if table and len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, req: Request) -> None:
        if self.tier is not None:
            self._cancel_load(req.request_id)
        table = self.block_tables.pop(req.request_id, None)
        if table:
            self.pool.release(table)
        self._hashes.pop(req.request_id, None)
        self._keys.pop(req.request_id, None)
        self._num_indexed.pop(req.request_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # --- the disk tier ---------------------------------------------------------------------------------
    # Blocks read from disk wait in the pool as cached blocks until their request is admitted ("unclaimed"),
    # the most recently used of the free blocks. Reads are bounded so that they cannot evict each other:
    # unclaimed blocks stay within a quarter of the pool for reads at admission, and as much again for reads
    # ahead of it (`prefetch`); a request whose read does not fit waits for its turn (a step or two: an
    # unclaimed read gives its share back after `UNCLAIMED_STEPS` steps). Without the bound, a policy that
    # tries many admissions per step (fair) had each read evict the one before it, and recomputed everything.
    def prefetch(self, req: Request) -> None:
        """Start reading the request's prefix blocks from disk now (it was just queued), so that they are in
        the pool by the time it is admitted; only if there is room in the read-ahead share."""
        if self.tier is not None and req.request_id not in self._loads and req.num_computed_tokens == 0:
            self._start_load(req, self.lookup_prefix(req), ahead=True)

    def fetch_from_tier(self, req: Request, cached: list[int]) -> list[int] | None:
        """The request's cached prefix blocks (`cached`: its pool hits) after reading what follows them
        from disk, or None while a read is under way or waits for its turn (the request is not admitted
        now; it is once its blocks are in)."""
        rid = req.request_id
        job = self._loads.get(rid)
        if job is not None:
            if not job.done.is_set():
                return None
            self._finish_load(rid)
            cached = self.lookup_prefix(req)
        started = self._start_load(req, cached, ahead=False)
        if started is None:
            return cached
        return self.lookup_prefix(req) if started else None

    def poll_loads(self) -> None:
        """Once per step: put the blocks of every finished read into the pool (as cached blocks), and age
        the unclaimed reads."""
        for rid in [rid for rid, job in self._loads.items() if job.done.is_set()]:
            self._finish_load(rid)
        for rid, entry in list(self._unclaimed.items()):
            if rid not in self._loads:
                entry[2] -= 1
                if entry[2] <= 0:
                    del self._unclaimed[rid]

    @property
    def loads_in_flight(self) -> bool:
        return any(not job.done.is_set() for job in self._loads.values())

    def wait_for_loads(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a read under way to finish (the engine has nothing else to do)."""
        for job in self._loads.values():
            if not job.done.is_set():
                job.done.wait(timeout)
                return

    def _start_load(self, req: Request, cached: list[int], ahead: bool) -> bool | None:
        """Read the blocks that follow `cached` from disk, as far as they are there and the policy says
        reading beats recomputing. None: nothing to read (compute); True: read already (a short read runs
        here, at once); False: reading in the background, or waiting for its turn to read."""
        from conveyor.kv_cache.disk_tier import INLINE_LOAD_S, MAX_LOAD_ATTEMPTS, UNCLAIMED_STEPS, LoadJob

        tier = self.tier
        rid = req.request_id
        attempts = self._load_attempts.get(rid, 0)
        max_blocks = (req.num_tokens - 1) // self.block_size
        start = len(cached)
        mine = self._unclaimed.get(rid)  # one read at a time per request; admission may add to a read-ahead
        if (attempts >= MAX_LOAD_ATTEMPTS and not ahead) or start >= max_blocks or (mine and (ahead or not mine[1])):
            return None
        hashes = self._block_hashes(req, max_blocks)
        found = tier.run_length(hashes[start:max_blocks])
        if not found:
            return None
        want = tier.policy.blocks_to_load(found)
        if want == 0:  # recompute: decided once for this request
            tier.hits += found
            tier.recomputed += found
            self._load_attempts[rid] = MAX_LOAD_ATTEMPTS
            return None
        # a block read is a block the request would take anyway to compute those tokens: at admission a read
        # may take every free block; ahead of admission, at most half of them. Reads at admission count only
        # each other against their share; reads ahead count every unclaimed read
        share = max(self.num_blocks // 4, 1)
        unclaimed = sum(e[0] for r, e in self._unclaimed.items() if r != rid and (ahead or not e[1]))
        room = self.num_free_blocks - sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        n = min(want, room // 2 if ahead else room)
        if n <= 0 or (unclaimed and unclaimed + n > share):  # (a read alone may be larger than the share)
            return None if ahead else False  # no room now: it waits for its turn (a read ahead is not owed one)
        tier.hits += n
        if not ahead:
            self._load_attempts[rid] = attempts + 1
        self._unclaimed[rid] = [n + (mine[0] if mine else 0), ahead, UNCLAIMED_STEPS]
        self.pool.touch(cached)  # the hits must not be evicted to make room for what follows them
        blocks = self.pool.allocate(n)
        self.pool.release(cached)
        job = LoadJob(blocks, hashes[start:start + n], self._keys[rid][start:start + n])
        self._loads[rid] = job
        inline = n * tier.policy.read_s <= INLINE_LOAD_S
        log.debug("request %s: %d prompt blocks found on disk after %d in the pool; reading %d %s%s", rid, found,
                  start, n, "now" if inline else "in the background", " (ahead of admission)" if ahead else "")
        tier.start_load(job, inline)
        if inline:
            self._finish_load(rid)
        return inline

    def _finish_load(self, rid: str) -> None:
        """Index a read's verified blocks in the pool and let go of them: they wait as cached blocks,
        found by the request's next lookup; the rest (a bad or missing file stopped the read) go back empty."""
        job = self._loads.pop(rid)
        for i in range(job.ok):
            self.pool.cache_block(job.blocks[i], job.hashes[i], job.keys[i])
        self.pool.release(job.blocks)
        self.tier.loads += job.ok
        self.tier.load_seconds += job.seconds

    def _cancel_load(self, rid: str) -> None:
        job = self._loads.get(rid)
        if job is not None:
            job.cancelled = True
            job.done.wait()  # the reader writes into its blocks until then (it stops at the next block)
            self._finish_load(rid)
        self._load_attempts.pop(rid, None)
        self._unclaimed.pop(rid, None)
