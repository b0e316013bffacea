"""The disk tier on its own: real files, real tensors standing in for the KV pool, no model.

Every test fills pool blocks with bytes derived from their tokens (as a model's K/V depend on them),
lets them go to disk, and checks what comes back byte for byte; or damages files and checks that
nothing damaged ever reaches the pool."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import zlib

import pytest
import torch

from conveyor.kv_cache import disk_tier
from conveyor.kv_cache.disk_tier import BlockIO, DiskTier, LoadPolicy, encode_key, open_disk_tier
from conveyor.kv_cache.manager import KVCacheManager
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 16
IDENTITY = {"weights": "w0", "dtype": "bfloat16", "block_size": BS}


def pool_tensors(num_blocks: int = NUM_BLOCKS, int8: bool = False) -> list[torch.Tensor]:
    """Two layers' K and V in the runner's shapes (and int8's scales)."""
    dt = torch.int8 if int8 else torch.bfloat16
    out = []
    for _ in range(2):
        out += [torch.zeros(num_blocks, 2, 8, BS, dtype=dt), torch.zeros(num_blocks, 2, BS, 8, dtype=dt)]
        if int8:
            out += [torch.zeros(num_blocks, 2, BS, dtype=torch.float16) for _ in range(2)]
    return out


def content(req: Request, i: int, nbytes: int) -> torch.Tensor:
    """The bytes block `i` of `req` holds once computed: a function of its whole prefix and salt."""
    seed = hashlib.sha256(repr((req.all_token_ids[:(i + 1) * BS], req.cache_salt)).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def compute(kv: KVCacheManager, io: BlockIO, req: Request) -> None:
    """What a prefill does to the pool: take blocks, write every block's K/V, index the full ones."""
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    table = kv.block_tables[req.request_id]
    for i in range(req.num_computed_tokens // BS, len(table)):
        io.copy_in(table[i], content(req, i, io.block_bytes).numpy())
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def req_(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), cache_salt=salt)


def prompt(seed: int, n: int = 4 * BS + 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


@pytest.fixture
def tiers(tmp_path):
    """Open tiers on demand (`make(...)`), all closed at the end."""
    made: list[DiskTier] = []

    def make(root=None, identity=IDENTITY, tensors=None, gib=1.0, mode="always"):
        tensors = tensors if tensors is not None else pool_tensors()
        tier = open_disk_tier(root or tmp_path / "tier", gib, identity, tensors, BS, mode)
        if tier is not None:
            made.append(tier)
        return tier, tensors

    yield make
    for t in made:
        t.close()


def fill_and_flush(tier: DiskTier, kv: KVCacheManager, reqs: list[Request]) -> None:
    for r in reqs:
        compute(kv, tier.io, r)
        kv.free(r)
    assert tier.flush(10)


def load(kv: KVCacheManager, req: Request) -> list[int]:
    """Admission's view: the request's cached blocks after the tier had its say (waiting for a read)."""
    cached = kv.lookup_prefix(req)
    got = kv.fetch_from_tier(req, cached)
    for _ in range(100):
        if got is not None:
            return got
        kv.wait_for_loads(1.0)
        kv.poll_loads()  # what each engine step does first
        got = kv.fetch_from_tier(req, cached)
    raise AssertionError("the read never finished")


def assert_blocks_hold(io: BlockIO, req: Request, blocks: list[int]) -> None:
    for i, b in enumerate(blocks):
        assert torch.equal(torch.from_numpy(io.copy_out(b)), content(req, i, io.block_bytes)), f"block {i}"


def test_blocks_evicted_from_the_pool_come_back_from_disk_byte_for_byte(tiers):
    tier, tensors = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    reqs = [req_(f"r{i}", prompt(i)) for i in range(6)]  # 6 x 5 blocks through a 12-block pool
    fill_and_flush(tier, kv, reqs)
    assert tier.num_blocks == 6 * 4 and tier.writes == 24
    assert kv.lookup_prefix(req_("again", reqs[0].prompt_token_ids)) == []  # long evicted from the pool
    again = req_("again", reqs[0].prompt_token_ids)
    blocks = load(kv, again)
    assert len(blocks) == 4 and tier.loads == 4 and tier.hits == 4
    assert_blocks_hold(tier.io, again, blocks)
    assert kv.allocate_slots(again, 1, blocks)  # admitted with them, as with pool hits


def test_int8_pools_spill_their_scales_too(tiers):
    tier, tensors = tiers(tensors=pool_tensors(int8=True))
    assert len(tier.io.sizes) == 8 and tier.io.block_bytes == 2 * (2 * 2 * 8 * BS + 2 * 2 * BS * 2)
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    reqs = [req_(f"r{i}", prompt(i)) for i in range(4)]
    fill_and_flush(tier, kv, reqs)
    again = req_("again", reqs[1].prompt_token_ids)
    assert_blocks_hold(tier.io, again, load(kv, again))


def test_a_restart_rebuilds_the_index_from_the_files(tiers, tmp_path):
    tier, tensors = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    reqs = [req_(f"r{i}", prompt(i)) for i in range(3)]
    fill_and_flush(tier, kv, reqs)
    tier.close()
    tier2, tensors2 = tiers()  # a new process: a fresh pool, same identity
    assert tier2.num_blocks == 12 and tier2.dir == tier.dir
    kv2 = KVCacheManager(NUM_BLOCKS, BS, tier=tier2)
    again = req_("again", reqs[2].prompt_token_ids)
    blocks = load(kv2, again)
    assert len(blocks) == 4
    assert_blocks_hold(tier2.io, again, blocks)


def test_another_identity_never_sees_the_tier(tiers):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    reqs = [req_("r0", prompt(0))]
    fill_and_flush(tier, kv, reqs)
    for other in ({**IDENTITY, "weights": "w1"}, {**IDENTITY, "dtype": "float32"}, {**IDENTITY, "kv_dtype": "int8"}):
        t2, _ = tiers(identity=other)
        assert t2.dir != tier.dir and t2.num_blocks == 0
        kv2 = KVCacheManager(NUM_BLOCKS, BS, tier=t2)
        assert load(kv2, req_("x", reqs[0].prompt_token_ids)) == []
        t2.close()


def test_salts_and_adapters_keep_tenants_apart_on_disk(tiers):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    tokens = prompt(7)
    fill_and_flush(tier, kv, [req_("a", tokens, salt="tenant-a")])
    kv.pool.reset_cache()
    assert load(kv, req_("b", tokens, salt="tenant-b")) == []
    assert load(kv, req_("n", tokens)) == []
    lora = Request("l", list(tokens), SamplingParams(max_tokens=1), cache_salt="tenant-a", lora_key="adapter-1")
    assert load(kv, lora) == []
    same = req_("a2", tokens, salt="tenant-a")
    assert len(load(kv, same)) == 4


def keys_of(tokens: list[int], salt: str | None = None) -> tuple[list[bytes], list]:
    """The chained hashes and keys of a prompt's full blocks (what the manager computes for it)."""
    probe = KVCacheManager(NUM_BLOCKS, BS)
    hashes = probe.prefix_block_hashes(req_("probe", tokens, salt))
    return hashes, probe._keys["probe"]


def damage(tier: DiskTier, h: bytes, key, how: str, other: bytes) -> None:
    path = tier.path(h)
    data = bytearray(path.read_bytes())
    meta = encode_key(key)
    hlen = len(disk_tier.MAGIC) + 32 + 32 + 4 + len(meta) + 16
    if how == "payload":
        data[-7] ^= 0x40
    elif how == "header":
        data[len(disk_tier.MAGIC) + 32 + 5] ^= 0x01  # inside the block hash
    elif how == "tokens":  # a token id of the key changed and the header CRC made to match: a forged file
        data[data.index(meta) + 1 + 32 + 4] ^= 0x01
        data[hlen - 4:hlen] = (zlib.crc32(bytes(data[:hlen - 4]))).to_bytes(4, "little")
    elif how == "truncate":
        data = data[:len(data) // 2]
    elif how == "swap":  # a whole, valid file of another block under this block's name
        data = bytearray(tier.path(other).read_bytes())
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["payload", "header", "tokens", "truncate", "swap", "empty"])
def test_a_damaged_file_is_dropped_and_never_reaches_the_pool(tiers, how, caplog):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    r = req_("r", prompt(3))
    fill_and_flush(tier, kv, [r, req_("other", prompt(4))])
    kv.pool.reset_cache()
    hashes, keys = keys_of(r.prompt_token_ids)
    other_hashes, _ = keys_of(prompt(4))
    damage(tier, hashes[2], keys[2], how, other_hashes[2])
    with caplog.at_level(logging.WARNING, logger="conveyor.kv_cache"):
        again = req_("again", r.prompt_token_ids)
        blocks = load(kv, again)
    assert len(blocks) == 2  # the read stopped at the bad block: the rest is recomputed
    assert_blocks_hold(tier.io, again, blocks)
    assert tier.corrupt == 1 and hashes[2] not in tier and not tier.path(hashes[2]).exists()
    assert sum("dropped block" in rec.message for rec in caplog.records) == 1
    assert hashes[3] in tier  # the blocks after it are fine and stay


def test_a_file_from_another_namespace_is_foreign(tiers, tmp_path):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    r = req_("r", prompt(5))
    fill_and_flush(tier, kv, [r])
    t2, _ = tiers(root=tmp_path / "other", identity={**IDENTITY, "weights": "another-model"})
    kv2 = KVCacheManager(NUM_BLOCKS, BS, tier=t2)
    fill_and_flush(t2, kv2, [req_("r", prompt(5))])  # the same tokens, another model's K/V
    h = kv.prefix_block_hashes(req_("h", r.prompt_token_ids))[0]
    shutil.copy(t2.path(h), tier.path(h))  # slipped in under the right name
    kv.pool.reset_cache()
    assert load(kv, req_("again", r.prompt_token_ids)) == []
    assert tier.corrupt == 1


def test_the_cap_evicts_least_recently_used_files_and_a_read_renews_one(tiers):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    a, b, c = (req_(x, prompt(10 + i)) for i, x in enumerate("abc"))
    fill_and_flush(tier, kv, [a, b])
    tier.capacity_bytes = tier._bytes + tier._bytes // 16  # room for a's and b's 8 files, not one more
    kv.pool.reset_cache()
    assert len(load(kv, again := req_("a-again", a.prompt_token_ids))) == 4  # a's files are the most recent now
    kv.free(again)
    fill_and_flush(tier, kv, [c])
    assert tier.num_blocks == 8 and tier.evictions == 4 and tier._bytes <= tier.capacity_bytes
    for r, kept in ((a, True), (b, False), (c, True)):
        assert all((h in tier) == kept and tier.path(h).exists() == kept for h in keys_of(r.prompt_token_ids)[0])


@pytest.mark.parametrize("staging_blocks", [2, 0])
def test_a_block_reused_before_its_write_is_copied_at_eviction_or_dropped(tiers, monkeypatch, staging_blocks):
    """The writer is stopped, so a's blocks are evicted and overwritten by b's while their writes wait.
    With staging room, their bytes are copied at eviction and written as a's; without, the writer's
    seqlock check sees the reuse and drops them. Never are b's bytes written under a's hashes."""
    tier, _ = tiers()
    tier._writes.put(None)  # stop the writer: jobs stay queued until the test runs them
    tier._writer.join()
    monkeypatch.setattr(disk_tier, "MAX_STAGED_BYTES", staging_blocks * tier.io.block_bytes)
    kv = KVCacheManager(4, BS, tier=tier)  # a 4-block pool: the next prompt evicts everything
    a = req_("a", prompt(20, 2 * BS + 1))
    compute(kv, tier.io, a)
    kv.free(a)
    compute(kv, tier.io, b := req_("b", prompt(21, 4 * BS)))  # takes every block: a's are evicted, overwritten
    jobs = [tier._writes.get_nowait() for _ in range(tier._writes.qsize())]
    assert [j.data is not None for j in jobs] == [staging_blocks > 0] * 2 + [False] * 4
    for job in jobs:
        tier._write(job)
        tier._finish(job)
    ha = keys_of(a.prompt_token_ids)[0]
    assert all((h in tier) == (staging_blocks > 0) for h in ha)
    assert tier._writer_drops == (0 if staging_blocks else 2) and tier._staged == 0
    kv.free(b)
    kv.pool.reset_cache()
    again = req_("again", a.prompt_token_ids)
    blocks = kv.fetch_from_tier(again, kv.lookup_prefix(again))
    assert len(blocks) == (2 if staging_blocks else 0)
    assert_blocks_hold(tier.io, again, blocks)  # a's bytes, not b's


def test_a_full_queue_drops_writes_and_never_waits(tiers, monkeypatch):
    tier, _ = tiers()
    monkeypatch.setattr(disk_tier, "MAX_QUEUED_WRITES", 0)
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    compute(kv, tier.io, req_("a", prompt(30)))
    assert tier.write_drops == 4 and tier.num_blocks == 0


def test_an_unusable_directory_means_no_tier_and_one_log_line(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="conveyor.kv_cache"):
        assert open_disk_tier(blocker / "tier", 1.0, IDENTITY, pool_tensors(), BS) is None
    lines = [r.message for r in caplog.records if r.name == "conveyor.kv_cache"]
    assert len(lines) == 1 and lines[0].startswith("disk tier off")


def test_a_directory_in_use_by_another_server_is_not_shared(tiers, caplog):
    tier, _ = tiers()
    with caplog.at_level(logging.WARNING, logger="conveyor.kv_cache"):
        t2, _ = tiers()
    assert t2 is None and "in use by another process" in caplog.text


def test_a_failing_disk_stops_the_writes_with_one_log_line_and_keeps_serving(tiers, caplog):
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    fill_and_flush(tier, kv, [req_("a", prompt(40))])
    for sub in tier.dir.iterdir():  # the disk goes away under the server (as a full one refuses writes)
        if sub.is_dir():
            shutil.rmtree(sub)
    with caplog.at_level(logging.WARNING, logger="conveyor.kv_cache"):
        fill_and_flush(tier, kv, [req_(f"b{i}", prompt(41 + i)) for i in range(3)])
    assert not tier.writing and tier.stats().writing is False
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    kv.pool.reset_cache()
    assert load(kv, req_("a-again", prompt(40))) == []  # its files are gone: recomputed, no error


def test_files_survive_only_whole(tiers):
    """A write is a temp file renamed into place: a crash mid-write leaves a temp file, which the next
    open deletes, never a half block under a block's name."""
    tier, _ = tiers()
    stale = tier.dir / "ab" / (".ab" + "0" * 62 + ".kvb.123.tmp")
    stale.write_bytes(b"half a block")
    tier.close()
    tier2, _ = tiers()
    assert not stale.exists() and tier2.num_blocks == 0
    assert not any(p.name.startswith(".") and p.suffix == ".tmp" for p in tier2.dir.rglob("*"))
    assert os.path.exists(tier2.dir / "tier.json")


def test_the_policy_reads_while_reading_is_cheaper_and_says_what_it_chose(caplog):
    p = LoadPolicy(16, read_s=1e-3)
    with caplog.at_level(logging.INFO, logger="conveyor.kv_cache"):
        assert p.blocks_to_load(5) == 5  # nothing measured yet: a read wins
        p.observe_compute(8, 10.0)  # a step of half a block says nothing about a block's cost
        assert p.token_s is None
        p.observe_compute(64, 64e-3)  # 16 ms per block against 1 ms per read
        assert p.blocks_to_load(5) == 5 and p.recompute_s == pytest.approx(16e-3)
        for _ in range(30):
            p.observe_read(0.1)  # the disk got slow: 100 ms per block
        assert p.blocks_to_load(5) == 0
    said = [r.message for r in caplog.records]
    assert len(said) == 2 and said[0].endswith("are loaded") and said[1].endswith("are recomputed")
    assert LoadPolicy(16, 1.0, "always").blocks_to_load(3) == 3


def test_a_recompute_decision_reads_nothing_and_is_counted(tiers):
    tier, _ = tiers(mode="auto")
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    fill_and_flush(tier, kv, [req_("a", prompt(50))])
    kv.pool.reset_cache()
    tier.policy.read_s = 1.0
    tier.policy.observe_compute(64, 64e-6)  # computing is far cheaper than this "disk"
    again = req_("again", prompt(50))
    assert load(kv, again) == [] and tier.loads == 0 and tier.recomputed == 4 and tier.hits == 4
    assert load(kv, again) == [] and tier.recomputed == 4  # decided once per request


def test_the_weights_digest_reads_values_not_names():
    big = torch.arange(28_311_552, dtype=torch.float32)  # SmolLM2's embedding size: float index rounding once overran
    w = {"a": big, "b": torch.ones(3, 4)}
    d = disk_tier.weights_digest(w)
    assert d == disk_tier.weights_digest({"b": torch.ones(3, 4), "a": big.clone()})
    big2 = big.clone()
    big2[-1] = -5.0  # the last element is always sampled
    assert disk_tier.weights_digest({"a": big2, "b": torch.ones(3, 4)}) != d
    assert disk_tier.weights_digest({"a": big, "b": torch.ones(4, 3)}) != d
    assert disk_tier.weights_digest({"a": big, "b": 2 * torch.ones(3, 4)}) != d


def test_the_device_path_moves_the_same_bytes(tiers):
    """Pools off the CPU (CUDA) are copied through host memory instead of read in place: the same path,
    forced here on CPU tensors, writes and reads the same files."""
    tier, _ = tiers(tensors=pool_tensors(int8=True))
    tier.io.host = False
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    reqs = [req_(f"r{i}", prompt(60 + i)) for i in range(4)]
    fill_and_flush(tier, kv, reqs)
    assert tier.writes == 16
    again = req_("again", reqs[0].prompt_token_ids)
    assert_blocks_hold(tier.io, again, load(kv, again))
    tier.io.host = True  # and the CPU path reads what the device path wrote
    kv.pool.reset_cache()
    again2 = req_("again2", reqs[1].prompt_token_ids)
    assert_blocks_hold(tier.io, again2, load(kv, again2))


def test_reads_for_requests_not_admitted_yet_take_turns(tiers, monkeypatch):
    """At most a quarter of the pool is read for requests that are not admitted yet; the next request's
    read waits (held, not recomputed) until the first is admitted or its share expires."""
    monkeypatch.setattr(disk_tier, "INLINE_LOAD_S", 0.0)  # reads in the reader thread, as for a long prompt
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)  # a share of 16 // 4 = 4 blocks
    a_tokens, b_tokens = prompt(70), prompt(71)
    fill_and_flush(tier, kv, [req_("a0", a_tokens), req_("b0", b_tokens)])
    kv.pool.reset_cache()
    a, b = req_("a", a_tokens), req_("b", b_tokens)
    assert kv.fetch_from_tier(a, []) is None  # a's 4 blocks are being read
    kv.wait_for_loads(5.0)
    assert kv.fetch_from_tier(b, []) is None  # b waits for its turn: a's read is not claimed yet
    assert not kv.loads_in_flight
    got_a = kv.fetch_from_tier(a, [])
    assert len(got_a) == 4 and kv.allocate_slots(a, 1, got_a)  # a is admitted: the share is free again
    assert kv.fetch_from_tier(b, []) is None  # now b's read starts
    kv.wait_for_loads(5.0)
    got_b = kv.fetch_from_tier(b, [])
    assert len(got_b) == 4
    assert_blocks_hold(tier.io, b, got_b)
    c = req_("c", prompt(70))  # a's prompt again, for another request: in the pool now, nothing to read
    assert kv.fetch_from_tier(c, kv.lookup_prefix(c)) == got_a


def test_an_unclaimed_read_gives_its_share_back_after_two_steps(tiers, monkeypatch):
    monkeypatch.setattr(disk_tier, "INLINE_LOAD_S", 0.0)
    tier, _ = tiers()
    kv = KVCacheManager(NUM_BLOCKS, BS, tier=tier)
    fill_and_flush(tier, kv, [req_("a0", prompt(80)), req_("b0", prompt(81))])
    kv.pool.reset_cache()
    a, b = req_("a", prompt(80)), req_("b", prompt(81))
    assert kv.fetch_from_tier(a, []) is None
    kv.wait_for_loads(5.0)
    kv.poll_loads()  # a step: a's read is in the pool, a is not admitted (say the step was full)
    assert kv.fetch_from_tier(b, []) is None and not kv.loads_in_flight  # b waits
    kv.poll_loads()  # a second step: a's share expires
    assert kv.fetch_from_tier(b, []) is None and kv.loads_in_flight  # b reads
    kv.wait_for_loads(5.0)
    assert len(kv.fetch_from_tier(b, [])) == 4
