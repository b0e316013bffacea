"""The disk tier in the engine: never a wrong token, whatever the strategy, KV dtype, adapter, restart or
damage, and reuse proven by counters and `cached_tokens` (timings are the benchmark's business:
benchmarks/kv_disk.py).

The model has SmolLM2's head shape, so the compiled, batch-invariant path runs: a request's tokens and
logprobs do not depend on what ran beside it, and every output here must equal the request's cold run
(alone, no prefix cache) bit for bit. The pool holds 40 blocks; the prompts' distinct full blocks are
about twice that, so the pool alone cannot keep them."""

from __future__ import annotations

import random
import shutil
import threading

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import EngineConfig
from conveyor.engine.clients import ProcessEngineClient
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.messages import Stop
from conveyor.kv_cache import disk_tier
from conveyor.lora import LoRARequest
from conveyor.request import make_request
from conveyor.scheduler.policies import POLICIES
from tests.conftest import build_tiny_llama
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter

BS = 16
POOL = dict(num_kv_blocks=40, block_size=BS, max_model_len=256, max_num_seqs=16, kv_disk_load="always")
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("kv-disk"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """10 prompts of 90-150 tokens, two pairs sharing a 64-token head (hits inside the tier too)."""
    rng = random.Random(52)
    out = [[rng.randrange(10, 300) for _ in range(rng.randrange(90, 150))] for _ in range(8)]
    out += [out[0][:64] + [rng.randrange(10, 300) for _ in range(40)], out[1][:64] + [7, 8, 9]]
    return out


def result(o) -> tuple:
    c = o.outputs[0]
    return c.token_ids, repr([sorted(d.items()) for d in c.logprobs])


def generate(llm: LLM, prompts, **kw) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False, **kw)


def cold_results(model_dir, prompts, lora_request: LoRARequest | None = None, **kw) -> list[tuple]:
    """Each prompt alone on an engine without any prefix cache: what a cold server computes."""
    llm = LLM(str(model_dir), use_tqdm_on_load=False, **{**POOL, "enable_prefix_caching": False, **kw})
    assert llm.engine.info.batch_invariant
    extra = {"lora_request": lora_request} if lora_request is not None else {}
    return [result(generate(llm, [p], **extra)[0]) for p in prompts]


@pytest.fixture(scope="module")
def cold(model_dir, prompts) -> list[tuple]:
    return cold_results(model_dir, prompts)


def full_blocks(p: list[int]) -> int:
    return (len(p) - 1) // BS * BS


def tier_llm(model_dir, path, **kw) -> LLM:
    return LLM(str(model_dir), use_tqdm_on_load=False, **{**POOL, "kv_disk_dir": str(path), **kw})


def test_every_strategy_serves_from_disk_with_the_cold_run_s_tokens(model_dir, prompts, cold, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "INLINE_LOAD_S", 0.0)  # every read in the reader thread, requests held meanwhile
    llm = tier_llm(model_dir, tmp_path / "tier")
    try:
        assert [result(o) for o in generate(llm, prompts)] == cold  # the first pass writes the tier
        assert llm.engine.kv_disk.flush()
        loads = 0
        for name in POLICIES:
            llm.engine.set_scheduler(name)
            llm.engine.reset_prefix_cache()  # the pool forgets: what is cached comes from disk
            outs = generate(llm, prompts)  # all at once: 10 prompts' blocks are twice the pool
            assert [result(o) for o in outs] == cold, name
            cached = sum(o.num_cached_tokens for o in outs)
            assert cached >= 0.5 * sum(full_blocks(p) for p in prompts), (name, [o.num_cached_tokens for o in outs])
            stats = llm.engine.snapshot().kv_disk
            assert stats.loads > loads and stats.corrupt == 0, name
            loads = stats.loads
        assert llm.engine.snapshot().kv_blocks_used == 0
    finally:
        llm.engine.close()


def test_int8_kv_spills_quantized_blocks_and_their_scales(model_dir, prompts, tmp_path):
    cold8 = cold_results(model_dir, prompts[:5], kv_cache_dtype="int8")
    llm = tier_llm(model_dir, tmp_path / "tier", kv_cache_dtype="int8")
    try:
        generate(llm, prompts[:5])
        assert llm.engine.kv_disk.flush()
        llm.engine.reset_prefix_cache()
        outs = generate(llm, prompts[:5])
        assert [result(o) for o in outs] == cold8
        assert all(o.num_cached_tokens == full_blocks(p) for o, p in zip(outs, prompts))
    finally:
        llm.engine.close()


def test_a_restart_reuses_the_tier_and_another_configuration_never_does(model_dir, prompts, cold, tmp_path):
    path = tmp_path / "tier"
    first = tier_llm(model_dir, path)
    generate(first, prompts)
    first.engine.close()  # a server that stops: the queued writes are finished
    again = tier_llm(model_dir, path)  # the restarted server
    try:
        outs = [generate(again, [p])[0] for p in prompts]  # one at a time: the pool holds each one's blocks
        assert [result(o) for o in outs] == cold
        assert [o.num_cached_tokens for o in outs] == [full_blocks(p) for p in prompts]
        stats = again.engine.snapshot().kv_disk
        assert stats.loads >= sum(full_blocks(p) for p in prompts[:8]) // BS and stats.corrupt == 0
        assert stats.writes == 0  # nothing new to write
    finally:
        again.engine.close()
    other_model = build_tiny_llama(tmp_path / "other-model", seed=1, hidden_size=192, intermediate_size=384,
                                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024)
    for model, kw in ((model_dir, {"block_size": 32}), (model_dir, {"kv_cache_dtype": "int8"}),
                      (model_dir, {"dtype": "float32"}), (other_model, {})):
        other = tier_llm(model, path, **kw)
        try:
            outs = generate(other, prompts[:3])
            assert [o.num_cached_tokens for o in outs] == [0, 0, 0], kw or "another model"
            assert other.engine.snapshot().kv_disk.hits == 0
        finally:
            other.engine.close()


def test_damaged_and_foreign_files_are_recomputed_token_for_token(model_dir, prompts, cold, tmp_path):
    path = tmp_path / "tier"
    first = tier_llm(model_dir, path)
    generate(first, prompts)
    first.engine.close()
    foreign = tmp_path / "foreign"  # the same prompts on another model: files under the very same names
    other_model = build_tiny_llama(tmp_path / "other-model", seed=2, hidden_size=192, intermediate_size=384,
                                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024)
    other = tier_llm(other_model, foreign)
    generate(other, prompts[:4])
    other.engine.close()
    (ns,) = [d for d in path.iterdir() if d.is_dir()]
    (other_ns,) = [d for d in foreign.iterdir() if d.is_dir()]
    files = {f.name: f for f in ns.rglob("*.kvb")}
    damaged = 0
    for i, name in enumerate(sorted(f.name for f in other_ns.rglob("*.kvb") if f.name in files)):
        f = files[name]
        if i % 4 == 0:  # a byte flipped in the K/V
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))
        elif i % 4 == 1:  # cut short (a crash, a full disk)
            f.write_bytes(f.read_bytes()[:1000])
        elif i % 4 == 2:  # another model's block under this name
            shutil.copy(other_ns / name[:2] / name, f)
        else:
            continue
        damaged += 1
    assert damaged >= 6
    again = tier_llm(model_dir, path)
    try:
        outs = generate(again, prompts)
        assert [result(o) for o in outs] == cold
        stats = again.engine.snapshot().kv_disk
        assert stats.corrupt >= 4 and stats.loads > 0  # each read stops at its first bad file
        assert sum(o.num_cached_tokens for o in outs) < sum(full_blocks(p) for p in prompts)
        assert again.engine.kv_disk.flush()  # the recomputed blocks were written again, whole
        assert again.engine.snapshot().kv_disk.writes >= stats.corrupt
    finally:
        again.engine.close()


def test_tenants_stay_apart_on_disk(model_dir, prompts, tmp_path):
    eng = LLMEngine(EngineConfig(model=str(model_dir), **POOL, kv_disk_dir=str(tmp_path / "tier")))

    def run(rid: str, salt: str | None) -> int:
        (req,) = eng.add_request(make_request(prompts[0], PARAMS, request_id=rid, cache_salt=salt))
        while eng.has_unfinished_requests():
            eng.step()
        return req.num_cached_tokens

    try:
        assert run("a1", "tenant-a") == 0
        assert eng.kv_disk.flush()
        eng.reset_prefix_cache()
        assert run("b", "tenant-b") == 0 and run("n", None) == 0  # same tokens, another tenant: nothing
        assert eng.snapshot().kv_disk.hits == 0
        eng.reset_prefix_cache()
        assert run("a2", "tenant-a") == full_blocks(prompts[0])
    finally:
        eng.close()


def test_adapters_have_their_own_blocks_on_disk_and_keep_them_across_restarts(model_dir, prompts, tmp_path):
    adapter = make_adapter(model_dir, tmp_path / "adapter", 8, ALL_PROJECTIONS, seed=1)
    lora = LoRARequest("a", 1, str(adapter))
    kw = dict(enable_lora=True, max_loras=2)
    cold_lora = cold_results(model_dir, prompts[:3], lora, **kw)
    first = tier_llm(model_dir, tmp_path / "tier", **kw)
    generate(first, prompts[:3], lora_request=lora)
    first.engine.close()
    again = tier_llm(model_dir, tmp_path / "tier", **kw)
    try:
        plain = generate(again, prompts[:3])  # the base model: the adapter's blocks are not its own
        assert [o.num_cached_tokens for o in plain] == [0, 0, 0]
        again.engine.reset_prefix_cache()
        outs = generate(again, prompts[:3], lora_request=lora)
        assert [result(o) for o in outs] == cold_lora
        assert [o.num_cached_tokens for o in outs] == [full_blocks(p) for p in prompts[:3]]
    finally:
        again.engine.close()


def test_the_engine_in_its_own_process_reads_and_writes_the_tier(model_dir, prompts, cold, tmp_path):
    path = tmp_path / "tier"
    first = tier_llm(model_dir, path)
    generate(first, prompts[:2])
    first.engine.close()
    cfg = EngineConfig(model=str(model_dir), **POOL, kv_disk_dir=str(path))
    client = ProcessEngineClient(cfg)
    got: dict[str, list] = {}
    cached: dict[str, int] = {}
    done = []
    finished = threading.Event()

    def on_output(out):
        for d in out.deltas:
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
            cached[d.request_id] = max(cached.get(d.request_id, 0), d.num_cached_tokens)
            if d.finished:
                done.append(d.request_id)
        if len(done) == 3 or out.final:
            finished.set()

    client.on_output = on_output
    client.start()
    try:
        for i in (0, 1, 2):
            client.send(make_request(list(prompts[i]), PARAMS, request_id=f"r{i}"))
        assert finished.wait(120)
        assert [got[f"r{i}"] for i in (0, 1, 2)] == [c[0] for c in cold[:3]]
        assert cached == {"r0": full_blocks(prompts[0]), "r1": full_blocks(prompts[1]), "r2": 0}
    finally:
        client.send(Stop())
        client.join(60)
    after = tier_llm(model_dir, path)  # the process wrote prompt 2's blocks before it exited
    try:
        outs = generate(after, [prompts[2]])
        assert outs[0].num_cached_tokens == full_blocks(prompts[2])
    finally:
        after.engine.close()
