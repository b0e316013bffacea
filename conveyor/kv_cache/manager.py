"""Per-request block tables on top of the shared `BlockPool`.

The scheduler asks three questions of it: how many prompt tokens are already cached
(`lookup_prefix`), can this request get room for N more tokens (`allocate_slots`), and give its
blocks back (`free`). Copy-on-write pairs for shared, partly written blocks are queued in
`pending_copies` for the model runner to apply before the step writes any KV.
"""

from __future__ import annotations

import hashlib
import struct

from conveyor.kv_cache.block_pool import BlockKey, BlockPool
from conveyor.request import Request

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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
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
        table = self.block_tables.pop(req.request_id, None)
        if table:
            self.pool.release(table)
        self._hashes.pop(req.request_id, None)
        self._keys.pop(req.request_id, None)
        self._num_indexed.pop(req.request_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
