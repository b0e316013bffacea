"""The prefix cache's second tier: full KV blocks on local disk, kept across evictions and restarts.

The pool (`block_pool.py`) holds what fits in memory; this tier keeps what the pool lets go of. Its
whole life in four steps:

- **Write.** When a full block is indexed in the pool (`BlockPool.on_cache`), a write job for it goes
  on a bounded queue (`offer_write`): a block id, its hash and key, and the block's `generation`. A
  writer thread copies the block's bytes out of the pool, checks that the generation did not move
  meanwhile (a seqlock: a block is only ever written after its hash was dropped, which bumps it), and
  writes one file per block. A block indexed in the pool never changes until it is evicted, so the
  copy needs no lock. If the pool evicts the block while its job still waits (`on_evict`), its bytes
  are copied then, on the engine's thread, before the block can be reused (a memcpy, bounded by
  `MAX_STAGED_BYTES`). Nothing ever waits: a full queue or staging budget drops the write, counted.
  Writing at indexing time rather than at eviction is what makes the tier survive a restart: the
  blocks still in the pool when the server stops are on disk already.
- **Find and load.** A waiting request's prompt blocks past its pool hits are looked up in the tier's
  index (an in-memory map of the files, LRU order). The policy (`LoadPolicy`) decides whether reading a
  block beats recomputing its tokens, from measured costs. Loaded blocks are read straight into pool
  blocks taken for the job (no staging copy), in a reader thread while the request waits (or inline
  when the read is short), and then indexed in the pool as if computed: the scheduler admits the
  request with them as cached blocks, and `cached_tokens` counts them.
- **Verify.** Every file carries the tier's namespace digest (model weights, dtypes, block size,
  layout, compute path: `namespace_digest`), the block's hash, its full `BlockKey` (parent hash, token
  ids, salt, adapter digest) and CRC-32s of its header and of its payload. A file that is truncated,
  corrupted, written for another model or configuration, or stands for another block is dropped and
  its tokens are recomputed: the request gets exactly what a cold run would compute.
- **Evict.** The tier's bytes stay under its cap, least recently used file first; a file that is read
  has its mtime bumped, so the LRU order survives a restart, which rebuilds the index from the files.

One directory per namespace under the root (`<root>/<digest>/`), locked by the process that uses it
(`flock`): two servers never share one, and replicas each get their own root (see docs/memory.md).
Anything that goes wrong with the directory degrades to no tier, or no more writes, with one log line;
never an error for a request.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from conveyor.config import KV_DISK_LOADS
from conveyor.kv_cache.block_pool import BlockKey, BlockPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger("conveyor.kv_cache")

MAGIC = b"CVKVBLK1"  # the file format; a change of format changes this (and the namespace digest)
SUFFIX = ".kvb"
MAX_QUEUED_WRITES = 4096  # write jobs waiting for the writer; more are dropped (counted)
MAX_STAGED_BYTES = 64 * 2**20  # bytes copied at eviction for jobs still waiting; more are dropped
INLINE_LOAD_S = 0.002  # a load expected to take less than this runs on the engine's thread, at once
MAX_LOAD_ATTEMPTS = 4  # reads per request at admission (a busy pool may evict what was read before it gets in)
UNCLAIMED_STEPS = 2  # steps a read waits for its request's admission before its share of the pool goes back
LOAD_POLICIES = KV_DISK_LOADS
_TAIL = struct.Struct("<QII")  # payload length, payload CRC-32, header CRC-32


# --- identity ---------------------------------------------------------------------------------------
def weights_digest(tensors: dict[str, torch.Tensor], samples: int = 4096) -> str:
    """A digest of a checkpoint's weights (not its name): every tensor's name, shape and dtype and
    `samples` of its elements, evenly spaced. Two checkpoints that differ anywhere that matters (a
    fine-tune, another quantization, another model under the same name) differ in every sample; reading
    a few thousand elements per tensor keeps it at milliseconds for any model size."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        flat = t.detach().reshape(-1)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\0".encode())
        if flat.numel():
            k = min(samples, flat.numel())
            idx = torch.arange(k, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)  # exact: no float rounding
            h.update(flat[idx].contiguous().cpu().view(torch.uint8).numpy().tobytes())  # the bits, as stored
    return h.hexdigest()


def namespace_digest(identity: dict) -> bytes:
    """SHA-256 of the canonical JSON of what a block's bytes depend on besides its own key (the
    model's weights digest, dtypes, block size, layout, compute path: `conveyor/engine/kv_disk.py`
    builds it). Blocks of another namespace are never read."""
    text = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(MAGIC + text.encode()).digest()


def encode_key(key: BlockKey) -> bytes:
    """A block's key, byte for byte: its parent hash, token ids, salt and adapter digest."""
    out = [b"\1" + key.parent if key.parent is not None else b"\0",
           struct.pack(f"<I{len(key.tokens)}q", len(key.tokens), *key.tokens)]
    for s in (key.salt, key.lora):
        if s is None:
            out.append(b"\xff\xff\xff\xff")
        else:
            b = s.encode()
            out.append(struct.pack("<I", len(b)) + b)
    return b"".join(out)


# --- the pool's bytes ---------------------------------------------------------------------------------
class BlockIO:
    """One block's bytes in the KV pool's tensors (every tensor's leading dimension is the block id:
    K and V of each layer, and their scales for an int8 cache), as a list of byte views (CPU) or copied
    to and from host memory (any device). A block's payload on disk is these views, in order."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        import torch

        self.tensors = list(tensors)
        if not self.tensors:
            raise ValueError("no KV tensors")
        self.num_blocks = int(self.tensors[0].shape[0])
        if any(int(t.shape[0]) != self.num_blocks for t in self.tensors):
            raise ValueError("every KV tensor must have one row per block")
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        self.layout = [[list(t.shape[1:]), str(t.dtype).removeprefix("torch.")] for t in self.tensors]
        self.host = all(t.device.type == "cpu" and t.is_contiguous() for t in self.tensors)
        self._arrays = ([t.view(torch.uint8).reshape(self.num_blocks, -1).numpy() for t in self.tensors]
                        if self.host else [])

    def views(self, block: int) -> list[np.ndarray]:
        """The block's bytes in place (CPU pools only): read or written without a copy."""
        return [a[block] for a in self._arrays]

    def copy_out(self, block: int) -> np.ndarray:
        """A copy of the block's bytes in host memory."""
        if self.host:
            return np.concatenate(self.views(block))
        import torch

        flat = [t[block].reshape(-1).view(torch.uint8) for t in self.tensors]
        return torch.cat(flat).cpu().numpy()

    def copy_in(self, block: int, data: np.ndarray) -> None:
        """Put `data` (block_bytes bytes) into the block."""
        off = 0
        if self.host:
            for view, n in zip(self.views(block), self.sizes):
                view[:] = data[off:off + n]
                off += n
            return
        import torch

        src = torch.from_numpy(np.ascontiguousarray(data)).to(self.tensors[0].device)
        for t, n in zip(self.tensors, self.sizes):
            t[block].reshape(-1).view(torch.uint8).copy_(src[off:off + n])
            off += n


# --- the policy ---------------------------------------------------------------------------------------
class LoadPolicy:
    """Whether a block found on disk is read back or recomputed, from two measured costs: reading one
    block (measured when the tier opens, then from every load) and computing one token of a prompt
    (from the engine's prefill steps, `observe_compute`). Per block: read it when that costs less than
    computing its `block_size` tokens. Until a prefill step has been seen, reading wins (on any model
    the engine serves, a forward per block costs more than a local read; measured in docs/memory.md).
    `mode="always"` reads every block found (tests, and machines where the estimate misleads)."""

    def __init__(self, block_size: int, read_s: float, mode: str = "auto", alpha: float = 0.2) -> None:
        if mode not in LOAD_POLICIES:
            raise ValueError(f"kv_disk_load must be one of {', '.join(LOAD_POLICIES)}, got {mode!r}")
        self.block_size = block_size
        self.read_s = read_s
        self.token_s: float | None = None
        self.mode = mode
        self.alpha = alpha
        self.loading: bool | None = None  # the last choice, logged when it changes

    def observe_read(self, seconds_per_block: float) -> None:
        self.read_s += self.alpha * (seconds_per_block - self.read_s)

    def observe_compute(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens in `seconds` of forward (only steps of a
        few blocks or more: a small step's fixed cost would be charged to its tokens)."""
        if prompt_tokens < 4 * self.block_size or seconds <= 0:
            return
        per = seconds / prompt_tokens
        self.token_s = per if self.token_s is None else self.token_s + self.alpha * (per - self.token_s)

    @property
    def recompute_s(self) -> float | None:
        """Computing one block's tokens, as measured (None: not yet)."""
        return None if self.token_s is None else self.block_size * self.token_s

    def blocks_to_load(self, found: int) -> int:
        """Of `found` consecutive blocks on disk, how many to read (the rest are recomputed)."""
        if self.mode == "always":
            return found
        load = self.recompute_s is None or self.read_s < self.recompute_s
        if load != self.loading:
            self.loading = load
            what = ("not measured yet" if self.recompute_s is None else f"{1e3 * self.recompute_s:.2f} ms")
            log.info("disk tier: reading a KV block takes %.3f ms, computing its %d tokens %s: %s", 1e3 * self.read_s,
                     self.block_size, what, "blocks found on disk are loaded" if load
                     else "blocks found on disk are recomputed")
        return found if load else 0


# --- jobs -----------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Write:
    hash: bytes
    key: BlockKey
    block: int
    generation: int
    pool: BlockPool
    data: np.ndarray | None = None  # copied at eviction while the job waited
    done: bool = False

    def still_valid(self) -> bool:
        """The block still holds the bytes this job was made for (seqlock check, after the copy)."""
        return not self.pool.retired and self.pool.generation[self.block] == self.generation


class LoadJob:
    """Blocks of one request read from disk into the pool blocks taken for them (`blocks`, held by
    the job until `KVCacheManager` finishes it). `ok`: how many of them, from the first, were read and
    verified; `done` is set when the reader is through (or stopped at a bad or missing file)."""

    def __init__(self, blocks: list[int], hashes: list[bytes], keys: list[BlockKey]) -> None:
        self.blocks = blocks
        self.hashes = hashes
        self.keys = keys
        self.ok = 0
        self.seconds = 0.0
        self.cancelled = False
        self.done = threading.Event()


@dataclass(frozen=True)
class DiskTierStats:
    """The tier's counters, read between steps (metrics, the dashboard, the log). Blocks throughout."""

    path: str
    capacity_bytes: int
    blocks: int  # files in the tier now
    bytes: int
    hits: int  # prompt blocks found on disk (past the pool's hits)
    loads: int  # blocks read back into the pool and used
    load_seconds: float
    recomputed: int  # blocks found on disk that the policy chose to recompute
    writes: int  # blocks written
    write_bytes: int
    write_cpu_s: float  # CPU seconds the writer thread used (checksums, copies into the page cache)
    write_drops: int  # spills given up (queue or staging budget full, block reused first, or writes off)
    evictions: int  # files removed to stay under the cap
    corrupt: int  # files dropped as truncated, corrupted or foreign
    writing: bool  # False once a write failed (disk full, directory gone): reads go on
    read_ms: float  # the policy's current estimates
    recompute_ms: float | None


# --- the tier --------------------------------------------------------------------------------------------
class DiskTier:
    """See the module docstring. Built by `open_disk_tier`, which degrades to None on a bad directory."""

    def __init__(self, root: Path, capacity_bytes: int, namespace: bytes, identity: dict, io: BlockIO,
                 block_size: int, load_mode: str = "auto") -> None:
        self.root = root
        self.dir = root / namespace.hex()[:32]
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.io = io
        self.block_size = block_size
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self._pending: dict[bytes, _Write] = {}
        self._staged = 0
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._reads: queue.Queue[LoadJob | None] = queue.Queue()
        self._pool: BlockPool | None = None
        self.writing = True
        self.closed = False
        # counters: hits, loads, load_seconds, recomputed and write_drops on the engine's thread; writes,
        # write_bytes and evictions on the writer's; corrupt under the lock (reader and engine threads)
        self.hits = self.loads = self.recomputed = self.write_drops = 0
        self.load_seconds = 0.0
        self.writes = self.write_bytes = self.evictions = self.corrupt = self._writer_drops = 0
        self.write_cpu_s = 0.0  # the writer thread's CPU time: what keeping the tier costs the machine
        self._lock_fd = -1
        try:
            self._open(identity)
            read_s = self._measure_read()
        except BaseException:
            self._unlock()
            raise
        self.policy = LoadPolicy(block_size, read_s, load_mode)
        self._writer = threading.Thread(target=self._write_loop, name="conveyor-kv-disk-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="conveyor-kv-disk-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        _OPEN.add(self)

    # --- opening ----------------------------------------------------------------------------------------
    def _open(self, identity: dict) -> None:
        """Create and lock the namespace directory, drop stale temp files, rebuild the index from the
        files (oldest mtime first) and trim it to the cap. Raises OSError if the directory is unusable."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._unlock()
            raise OSError(e.errno, f"{self.dir} is in use by another process") from None
        probe = self.dir / ".probe"
        probe.write_bytes(b"x")  # writable? (raises otherwise)
        probe.unlink()
        meta = self.dir / "tier.json"
        if not meta.exists():
            tmp = self.dir / ".tier.json.tmp"
            tmp.write_text(json.dumps(identity, indent=1, sort_keys=True, default=str))
            os.replace(tmp, meta)
        found: list[tuple[float, bytes, int]] = []
        for sub in range(256):
            d = self.dir / f"{sub:02x}"
            d.mkdir(exist_ok=True)
            with os.scandir(d) as it:
                for entry in it:
                    if entry.name.startswith("."):  # a temp file of a writer that died: never renamed, never valid
                        _unlink(entry.path)
                        continue
                    if not entry.name.endswith(SUFFIX):
                        continue
                    try:
                        h = bytes.fromhex(entry.name[:-len(SUFFIX)])
                        st = entry.stat()
                    except (ValueError, OSError):
                        continue
                    if len(h) == 32:
                        found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self._bytes += size
        self._trim()

    def _measure_read(self, reps: int = 5) -> float:
        """Seconds to read and check one block's file here (the page cache's speed, as for a block written
        a while ago; from a cold disk it is slower, and every load updates the estimate)."""
        data = np.arange(self.io.block_bytes, dtype=np.uint32).astype(np.uint8)  # any bytes will do
        path = self.dir / ".measure"
        try:
            path.write_bytes(data.tobytes())
            buf = np.empty_like(data)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.readv(fd, [buf])
                finally:
                    os.close(fd)
                zlib.crc32(buf)
                times.append(time.perf_counter() - t0)
        finally:
            _unlink(path)
        return sorted(times)[len(times) // 2]

    def attach(self, pool: BlockPool) -> None:
        """Serve `pool` from now on (a new KV manager: `LLMEngine.reset`); the previous pool's pending
        writes can no longer be checked, so they are dropped unless their bytes were copied already."""
        if self._pool is not None and self._pool is not pool:
            self._pool.retired = True
            self._pool.on_cache = self._pool.on_evict = None
        self._pool = pool
        pool.on_cache = self.offer_write
        pool.on_evict = self.on_evict

    # --- paths and the index --------------------------------------------------------------------------
    def path(self, block_hash: bytes) -> Path:
        hx = block_hash.hex()
        return self.dir / hx[:2] / (hx + SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def run_length(self, hashes: Iterable[bytes]) -> int:
        """How many of `hashes`, from the first, have a file in the tier."""
        n = 0
        for h in hashes:
            if h not in self._index:
                break
            n += 1
        return n

    def _add(self, block_hash: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(block_hash, None)
            self._bytes += size - (old or 0)
            self._index[block_hash] = size
        self._trim()

    def _trim(self) -> None:
        """Remove least recently used files until the tier is under its cap."""
        while True:
            with self._lock:
                if self._bytes <= self.capacity_bytes or not self._index:
                    return
                h, size = self._index.popitem(last=False)
                self._bytes -= size
            _unlink(self.path(h))
            self.evictions += 1

    def _drop(self, block_hash: bytes, reason: str | None) -> None:
        """Forget a file (and delete it). `reason`: why it is bad (None: it is simply gone)."""
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
            if reason is not None:
                self.corrupt += 1
        _unlink(self.path(block_hash))
        if reason is not None:
            log.warning("disk tier: dropped block %s (%s); its tokens are recomputed", block_hash.hex()[:16], reason)

    # --- writing ---------------------------------------------------------------------------------------
    def offer_write(self, block: int, block_hash: bytes, key: BlockKey | None) -> None:
        """`BlockPool.on_cache`: queue a newly indexed block for writing, unless it is on disk already.
        On the engine's thread: never waits."""
        if not self.writing or key is None or block_hash in self._index or block_hash in self._pending:
            return
        if self._writes.qsize() >= MAX_QUEUED_WRITES:
            self.write_drops += 1
            return
        job = _Write(block_hash, key, block, self._pool.generation[block], self._pool)
        with self._lock:
            self._pending[block_hash] = job
        self._writes.put_nowait(job)

    def on_evict(self, block: int, block_hash: bytes) -> None:
        """`BlockPool.on_evict`: the block is about to be reused. If its write still waits, copy its bytes
        now (the one copy on the engine's thread; dropped beyond `MAX_STAGED_BYTES`)."""
        job = self._pending.get(block_hash)
        if job is None or job.block != block or job.pool is not self._pool:
            return
        with self._lock:
            if job.done or job.data is not None:
                return
            if self._staged + self.io.block_bytes > MAX_STAGED_BYTES:
                return  # the writer's check will fail and drop it
            job.data = self.io.copy_out(block)
            self._staged += self.io.block_bytes

    def _header(self, block_hash: bytes, key: BlockKey, payload: list) -> bytes:
        payload_crc = 0
        for b in payload:
            payload_crc = zlib.crc32(b, payload_crc)
        meta = encode_key(key)
        head = MAGIC + self.namespace + block_hash + struct.pack("<I", len(meta)) + meta
        body = head + struct.pack("<QI", self.io.block_bytes, payload_crc)
        return body + struct.pack("<I", zlib.crc32(body))

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            t0 = time.thread_time()
            try:
                if self.writing:
                    self._write(job)
                else:
                    self._dropped(job)
            except Exception:  # noqa: BLE001 - a bug here must not kill the writer; the block is simply not kept
                log.exception("disk tier: writing block %s failed", job.hash.hex()[:16])
                self._dropped(job)
            finally:
                self._finish(job)
                self.write_cpu_s += time.thread_time() - t0

    def _finish(self, job: _Write) -> None:
        with self._lock:
            job.done = True
            if self._pending.get(job.hash) is job:
                del self._pending[job.hash]
            if job.data is not None:
                self._staged -= self.io.block_bytes

    def _dropped(self, job: _Write) -> None:
        self._writer_drops += 1  # the writer's own count (the engine's thread counts in `write_drops`)

    def _write(self, job: _Write) -> None:
        """Write one block's file: its bytes copied out of the pool (one memcpy, then the seqlock check: the
        copy is good only if the block was not reused meanwhile), or the copy taken at eviction. One copy
        and one checksum call over it cost the engine far less than checksumming the pool's ~60 pieces of a
        block in place: each such call hands the GIL back and forth. Written to a temp name and renamed, so
        a file is whole or absent."""
        if job.hash in self._index:
            return
        data = job.data
        if data is None:
            copy = self.io.copy_out(job.block)
            if job.still_valid():
                data = copy
            else:  # reused before or while we copied it: only a copy taken at eviction can save it
                with self._lock:
                    data = job.data
                if data is None:
                    self._dropped(job)
                    return
        path = self.path(job.hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        if not self._write_file(tmp, self._header(job.hash, job.key, [data]), [data]):
            return
        try:
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self._stop_writing(e)
            return
        size = self._header_len(job.key) + self.io.block_bytes
        self.writes += 1
        self.write_bytes += size
        self._add(job.hash, size)

    def _header_len(self, key: BlockKey) -> int:
        return len(MAGIC) + 32 + 32 + 4 + len(encode_key(key)) + _TAIL.size

    def _write_file(self, path: Path, header: bytes, payload: list) -> bool:
        bufs = [header, *payload]
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            self._stop_writing(e)
            return False
        try:
            views = [memoryview(b).cast("B") for b in bufs]
            while views:
                n = os.writev(fd, views)
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            return True
        except OSError as e:
            _unlink(path)
            self._stop_writing(e)
            return False
        finally:
            os.close(fd)

    def _stop_writing(self, e: OSError) -> None:
        if self.writing:
            self.writing = False
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else os.strerror(e.errno or 0) or str(e)
            log.warning("disk tier: cannot write to %s (%s): no more KV blocks are written there; the blocks already "
                        "on disk are still used", self.dir, why)

    # --- reading ---------------------------------------------------------------------------------------
    def start_load(self, job: LoadJob, inline: bool) -> None:
        """Read `job`'s blocks: now, on this thread (`inline`), or in the reader thread."""
        if inline:
            self._load(job)
        else:
            self._reads.put_nowait(job)

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            try:
                self._load(job)
            except Exception:  # noqa: BLE001 - a bug here must not kill the reader; the blocks are recomputed
                log.exception("disk tier: a load failed")
                job.done.set()

    def _load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        for i, (h, key, block) in enumerate(zip(job.hashes, job.keys, job.blocks)):
            if job.cancelled or not self._read(h, key, block):
                break
            job.ok = i + 1
        job.seconds = time.perf_counter() - t0
        if job.ok:
            self.policy.observe_read(job.seconds / job.ok)
        job.done.set()

    def _read(self, block_hash: bytes, key: BlockKey, block: int) -> bool:
        """Read one block's file into pool block `block` and verify it; False (file dropped) if it is
        missing or bad. Nobody else uses `block` meanwhile: it is held for the job, unindexed."""
        path = self.path(block_hash)
        meta = encode_key(key)
        head = MAGIC + self.namespace + block_hash + struct.pack("<I", len(meta)) + meta
        hdr = bytearray(len(head) + _TAIL.size)
        total = len(hdr) + self.io.block_bytes
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self._drop(block_hash, None)
            return False
        host = self.io.host
        payload = self.io.views(block) if host else [np.empty(self.io.block_bytes, dtype=np.uint8)]
        try:
            size = os.fstat(fd).st_size
            got = os.readv(fd, [hdr, *payload]) if size == total else 0
        except OSError as e:
            self._drop(block_hash, f"unreadable: {e}")
            return False
        finally:
            os.close(fd)
        reason = None
        if size != total or got != total:
            reason = f"{size} bytes where {total} were expected: truncated or not a block of this tier"
        elif hdr[:len(MAGIC)] != MAGIC:
            reason = "not a KV block file"
        elif hdr[len(MAGIC):len(MAGIC) + 32] != self.namespace:
            reason = "written for another model or configuration"
        elif bytes(hdr[:len(head)]) != head:
            reason = "it holds another block (hash, tokens, salt or adapter differ)"
        else:
            payload_len, payload_crc, header_crc = _TAIL.unpack_from(hdr, len(head))
            crc = 0
            for b in payload:
                crc = zlib.crc32(b, crc)
            if zlib.crc32(memoryview(hdr)[:-4]) != header_crc or payload_len != self.io.block_bytes:
                reason = "header checksum mismatch"
            elif crc != payload_crc:
                reason = "payload checksum mismatch"
        if reason is not None:
            self._drop(block_hash, reason)
            return False
        if not host:
            self.io.copy_in(block, payload[0])
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return True

    # --- the engine's view ----------------------------------------------------------------------------
    def observe_compute(self, prompt_tokens: int, seconds: float) -> None:
        self.policy.observe_compute(prompt_tokens, seconds)

    def stats(self) -> DiskTierStats:
        rc = self.policy.recompute_s
        return DiskTierStats(
            path=str(self.dir), capacity_bytes=self.capacity_bytes, blocks=len(self._index), bytes=self._bytes,
            hits=self.hits, loads=self.loads, load_seconds=self.load_seconds, recomputed=self.recomputed,
            writes=self.writes, write_bytes=self.write_bytes, write_cpu_s=self.write_cpu_s,
            write_drops=self.write_drops + self._writer_drops,
            evictions=self.evictions, corrupt=self.corrupt, writing=self.writing,
            read_ms=1e3 * self.policy.read_s, recompute_ms=None if rc is None else 1e3 * rc)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (up to `timeout` seconds) until every queued write is on disk; True if it got there."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (up to `timeout`), stop the threads and unlock the directory."""
        if self.closed:
            return
        self.closed = True
        if self._pool is not None:
            self._pool.on_cache = self._pool.on_evict = None
        self.flush(timeout)
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)
        self._unlock()
        _OPEN.discard(self)

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            try:
                os.close(self._lock_fd)  # releases the flock
            except OSError:
                pass
            self._lock_fd = -1


_OPEN: set[DiskTier] = set()


@atexit.register
def _close_open_tiers() -> None:
    """At interpreter exit: finish the queued writes of every tier still open (a server that stops)."""
    for tier in list(_OPEN):
        tier.close(timeout=5.0)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_disk_tier(root: str | os.PathLike, capacity_gib: float, identity: dict, tensors: Iterable[torch.Tensor],
                   block_size: int, load_mode: str = "auto") -> DiskTier | None:
    """The tier under `root` for this `identity` (its namespace directory), or None, with one log line
    saying why, if the directory cannot be used (not writable, in use by another process, ...)."""
    io = BlockIO(tensors)
    ns = namespace_digest(identity)
    try:
        t0 = time.perf_counter()
        tier = DiskTier(Path(root).expanduser(), int(capacity_gib * 2**30), ns, identity, io, block_size, load_mode)
    except OSError as e:
        log.warning("disk tier off: cannot use %s (%s); the prefix cache stays in memory only", root,
                    e.strerror or e)
        return None
    log.info("disk tier at %s: %d blocks (%.2f of %.2f GiB) kept from earlier runs, %d KiB per block; reading one "
             "takes %.3f ms (opened in %.2f s)", tier.dir, tier.num_blocks, tier._bytes / 2**30,
             tier.capacity_bytes / 2**30, io.block_bytes // 1024, 1e3 * tier.policy.read_s, time.perf_counter() - t0)
    return tier
