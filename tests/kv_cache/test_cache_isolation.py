"""Tenant isolation in the prefix cache: SHA-256 block hashes, salts, and a full key check on every hit."""

from __future__ import annotations

from conveyor.kv_cache import manager as kv_manager
from conveyor.kv_cache.manager import KVCacheManager, hash_block
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def _fill(kv: KVCacheManager, req: Request) -> None:
    """Compute the request's whole prompt and index its full blocks, as a finished prefill would."""
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_block_hashes_are_sha256_and_cover_parent_tokens_and_salt():
    h = hash_block(None, (1, 2, 3, 4), None)
    assert isinstance(h, bytes) and len(h) == 32
    assert h != hash_block(None, (1, 2, 3, 5), None)
    assert h != hash_block(None, (1, 2, 3, 4), "tenant-a")
    assert hash_block(h, (5, 6, 7, 8), None) != hash_block(hash_block(None, (9, 9, 9, 9), None), (5, 6, 7, 8), None)
    assert hash_block(None, (1, 2, 3, 4), "a") == hash_block(None, (1, 2, 3, 4), "a")  # stable across calls


def test_different_salts_never_share_a_block():
    kv = KVCacheManager(64, BS)
    prompt = list(range(10, 30))
    a = _req("a", prompt, "tenant-a")
    _fill(kv, a)
    assert len(kv.lookup_prefix(_req("a2", prompt, "tenant-a"))) == (len(prompt) - 1) // BS  # same salt: shared
    assert kv.lookup_prefix(_req("b", prompt, "tenant-b")) == []  # another tenant: nothing
    assert kv.lookup_prefix(_req("c", prompt, None)) == []  # no salt is a salt of its own


def test_a_forced_hash_collision_is_caught_by_the_key_check(monkeypatch):
    """With a hash that collides for everything, a lookup still only returns a block whose tokens,
    salt and parent are the request's own."""
    monkeypatch.setattr(kv_manager, "hash_block", lambda parent, tokens, salt, lora=None: b"weak")
    kv = KVCacheManager(64, BS)
    victim = _req("victim", [1, 2, 3, 4, 5, 6, 7, 8, 9], "secret-tenant")
    _fill(kv, victim)
    attacker = _req("attacker", [9, 9, 9, 9, 9, 9, 9, 9, 9], "secret-tenant")
    assert kv.lookup_prefix(attacker) == []
    other_salt = _req("other", [1, 2, 3, 4, 5, 6, 7, 8, 9], "other-tenant")
    assert kv.lookup_prefix(other_salt) == []
    assert kv.pool.num_key_mismatches >= 2
    same = _req("same", [1, 2, 3, 4, 5, 6, 7, 8, 9], "secret-tenant")
    assert kv.lookup_prefix(same)[:1] == kv.block_tables["victim"][:1]  # the genuine owner still hits
