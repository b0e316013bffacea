"""Batch invariance: a request's tokens and logits do not depend on what else runs beside it.

8 probe prompts, each generated alone (iteration scheduler, whole prompts, no prefix cache), are the
reference. Then the same probes run inside a crowd of 255 other requests of random lengths, under
every scheduler, with a token budget of 8192 (whole prompts) and of 64 (prompts chunked, decodes and
chunks mixed), with prefix-cache hits, and with preemption forced by a small KV pool. Greedy tokens,
seeded samples at temperature 0.8 and the top-1 logit of every step must be identical, bit for bit.

The model is a small random Llama with head_dim 64 and GQA 3 (SmolLM2's head shape), so the fast
CPU path (compiled attention, fused ops, prepacked oneDNN linears) is what runs, in the default dtype.
`tests/test_smollm2.py` repeats the core of it on the real model.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.request import Tier, make_request
from conveyor.runner import model_runner
from conveyor.sampling_params import SamplingParams
from tests.conftest import build_tiny_llama

PROBES, CROWD, PROBE_TOKENS = 8, 255, 64
SHARED_PREFIX = 48  # tokens every probe starts with (three 16-token blocks: cacheable)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("invariance"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(1234)
    vocab = 300
    prefix = [rng.randrange(10, vocab) for _ in range(SHARED_PREFIX)]
    probes = {f"probe{i}": prefix + [rng.randrange(10, vocab) for _ in range(rng.randrange(5, 60))]
              for i in range(PROBES)}
    crowd = {}
    for i in range(CROWD):  # some of the crowd shares the probes' prefix and arrives first: cache hits
        head = prefix if i % 8 == 0 else []
        crowd[f"crowd{i}"] = (head + [rng.randrange(10, vocab) for _ in range(rng.randrange(1, 150))],
                              rng.randrange(1, PROBE_TOKENS + 1))
    return probes, crowd


def engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), device="cpu", max_model_len=512, num_kv_blocks=4096, block_size=16)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def probe_params(rid: str, sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.8, seed=1000 + int(rid[5:]), ignore_eos=True)
    return SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True)


def run(eng: LLMEngine, probes: dict, crowd: dict, sampled: bool, top1: dict, mixed: bool = False,
        probe_tier: Tier = Tier.INTERACTIVE) -> dict[str, list[int]]:
    """Queue the crowd with the probes spread through it, run to the end; {request id: tokens}.

    `mixed`: the probes come first at the lowest priority, and 12 steps later the crowd, from 4
    tenants with priorities 0-1 and TTFT targets: the strategies that reorder and preempt by those
    preempt the probes mid-generation. `probe_tier`: the probes' tier (batch lines: the crowd takes their seats
    and blocks back whatever the strategy)."""
    out: dict[str, list[int]] = defaultdict(list)
    top1.clear()

    def step() -> None:
        for d in eng.step().deltas:
            out[d.group_id].extend(d.new_token_ids)

    order = list(crowd)
    rng = random.Random(99)
    for rid in probes:
        order.insert(rng.randrange(len(order) + 1), rid)
    if mixed:
        order = list(probes) + list(crowd)
    for rid in order:
        if rid in probes:
            eng.add_request(make_request(probes[rid], probe_params(rid, sampled), request_id=rid,
                                         priority=2 if mixed else 0, tier=probe_tier))
            continue
        if mixed and rid == "crowd0":
            for _ in range(12):  # every probe is running (and decoding) when the crowd comes
                step()
        ids, n = crowd[rid]
        k = int(rid[5:])
        extra = dict(priority=k % 2, tenant=f"t{k % 4}", slo_ttft_ms=50 * (1 + k % 5)) if mixed else {}
        eng.add_request(make_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                     request_id=rid, **extra))
    eng.end_input()  # offline: static batches may flush, as LLM.generate does
    while eng.has_unfinished_requests():
        step()
    return {rid: out[rid] for rid in probes}


@pytest.fixture()
def top1(monkeypatch):
    """Records each request's top-1 logit at every sampled step, as the sampler saw it."""
    seen: dict[str, list[float]] = defaultdict(list)
    real = model_runner.sample

    def recording(logits: torch.Tensor, reqs, grammar=None, positions=None):
        best = logits.max(dim=-1).values.tolist()
        for r, v in zip(reqs, best):
            seen[r.request_id].append(v)
        return real(logits, reqs, grammar, positions)

    monkeypatch.setattr(model_runner, "sample", recording)
    return seen


@pytest.fixture(scope="module")
def reference(model_dir, workload):
    """Each probe alone in an otherwise empty engine: greedy and seeded-sampled tokens, top-1 logits."""
    probes, _ = workload
    eng = engine(model_dir, enable_prefix_caching=False)
    if not eng.runner.batch_invariant:  # no compiler (torch path), or oneDNN not row-invariant: said at startup
        pytest.skip(f"the engine reports batch-invariant outputs: no, on this machine "
                    f"(attention {eng.runner.attention_backend})")
    real = model_runner.sample
    result = {}
    for sampled in (False, True):
        seen: dict[str, list[float]] = defaultdict(list)

        def recording(logits, reqs, grammar=None, positions=None, seen=seen):
            for r, v in zip(reqs, logits.max(dim=-1).values.tolist()):
                seen[r.request_id].append(v)
            return real(logits, reqs, grammar, positions)

        model_runner.sample = recording
        try:
            tokens = {}
            for rid in probes:
                tokens.update(run(eng, {rid: probes[rid]}, {}, sampled, {}))
        finally:
            model_runner.sample = real
        result[sampled] = (tokens, dict(seen))
    return result


def check(reference, sampled: bool, got: dict[str, list[int]], top1: dict[str, list[float]]) -> None:
    want_tokens, want_top1 = reference[sampled]
    for rid, tokens in want_tokens.items():
        assert len(tokens) == PROBE_TOKENS
        first = next((i for i, (a, b) in enumerate(zip(got[rid], tokens)) if a != b), None)
        assert got[rid] == tokens, f"{rid}: tokens diverge at {first}"
        assert top1[rid] == want_top1[rid], f"{rid}: top-1 logits differ"


@pytest.mark.parametrize("budget", [8192, 64])
@pytest.mark.parametrize("scheduler", ["static", "dynamic", "continuous", "iteration"])
def test_greedy_probes_unchanged_in_a_crowd(model_dir, workload, reference, top1, scheduler, budget):
    probes, crowd = workload
    eng = engine(model_dir, scheduler=scheduler, max_num_batched_tokens=budget)
    got = run(eng, probes, crowd, False, top1)
    check(reference, False, got, top1)


def test_greedy_probes_unchanged_when_steps_fill_the_budget(model_dir, workload, reference, top1):
    """Steps that end a prompt and start another one's chunk as well (`--no-isolate-prompt-ends`, vLLM's way)."""
    probes, crowd = workload
    eng = engine(model_dir, max_num_batched_tokens=64, isolate_prompt_ends=False)
    got = run(eng, probes, crowd, False, top1)
    check(reference, False, got, top1)


@pytest.mark.parametrize("scheduler", ["priority", "fair", "slo"])
def test_greedy_probes_unchanged_under_sharing_strategies(model_dir, workload, reference, top1, scheduler):
    """The strategies that reorder and preempt by priority, tenant and deadline, with a crowd that has
    all three (and a small running set, so priority preemption happens): chunked budget only."""
    probes, crowd = workload
    eng = engine(model_dir, scheduler=scheduler, max_num_batched_tokens=64, max_num_seqs=16)
    got = run(eng, probes, crowd, False, top1, mixed=True)
    if scheduler == "priority":
        assert eng.scheduler.num_preemptions >= PROBES, "the crowd was meant to preempt the probes"
    check(reference, False, got, top1)


@pytest.mark.parametrize("scheduler", ["iteration", "fair"])
def test_batch_lines_taken_back_for_interactive_work_are_unchanged(model_dir, workload, reference, top1, scheduler):
    """The probes run as batch lines; 12 steps in, the crowd of interactive requests takes their seats and blocks
    back (recompute preemption) and the probes resume from their cached prefix: the same tokens and logits."""
    probes, crowd = workload
    eng = engine(model_dir, scheduler=scheduler, max_num_batched_tokens=64, max_num_seqs=16, batch_tier_slowdown=0)
    got = run(eng, probes, crowd, False, top1, mixed=True, probe_tier=Tier.BATCH)
    assert eng.scheduler.num_preemptions >= PROBES, "the crowd was meant to take the probes' seats"
    check(reference, False, got, top1)


@pytest.mark.parametrize("scheduler", ["static", "dynamic", "continuous", "iteration"])
def test_seeded_samples_unchanged_in_a_crowd(model_dir, workload, reference, top1, scheduler):
    probes, crowd = workload
    eng = engine(model_dir, scheduler=scheduler, max_num_batched_tokens=64)
    got = run(eng, probes, crowd, True, top1)
    check(reference, True, got, top1)


def test_prefix_cache_hits_change_nothing(model_dir, workload, reference, top1):
    probes, crowd = workload
    eng = engine(model_dir, enable_prefix_caching=True)
    got = run(eng, probes, crowd, False, top1)
    assert eng.kv.prefix_hits >= PROBES * SHARED_PREFIX  # the probes (at least) hit the cached prefix
    check(reference, False, got, top1)


@pytest.mark.parametrize("sampled", [False, True])
def test_preemption_changes_nothing(model_dir, workload, reference, top1, sampled):
    probes, crowd = workload
    eng = engine(model_dir, num_kv_blocks=160, max_num_batched_tokens=256)
    got = run(eng, probes, crowd, sampled, top1)
    assert eng.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    check(reference, sampled, got, top1)


@pytest.mark.parametrize("kw", [dict(kv_cache_dtype="int8"), dict(quantization="int8"),
                                dict(quantization="int4", kv_cache_dtype="int8"),
                                dict(quantization="int8_per_channel")],
                         ids=["kv-int8", "w-int8", "w-int4+kv-int8", "w8a8"])
def test_quantized_engine_unchanged_in_a_crowd(model_dir, workload, monkeypatch, kw):
    """Quantized weights (on their kernels for every step size) and the int8 KV cache keep a request's
    tokens independent of its batch: the int8 KV scales are per token, the int kernels per row, and W8A8
    quantizes each row's activations alone and sums integers exactly."""
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "none")
    probes, crowd = workload
    crowd = dict(list(crowd.items())[:127])  # the int kernels at every step size are slow without AVX-512 VNNI
    alone = engine(model_dir, enable_prefix_caching=False, **kw)
    if not alone.runner.batch_invariant:
        pytest.skip("the engine reports batch-invariant outputs: no, on this machine")
    want: dict[str, list[int]] = {}
    for rid in probes:
        want.update(run(alone, {rid: probes[rid]}, {}, False, {}))
    eng = engine(model_dir, max_num_batched_tokens=256, **kw)
    got = run(eng, probes, crowd, False, {})
    for rid in probes:
        assert got[rid] == want[rid], f"{rid} changed in a crowd with {kw}"


def test_dense_copies_are_reported_as_not_invariant(model_dir, monkeypatch):
    """Where big steps switch to the dense copies, the engine says so instead of claiming invariance."""
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "4")
    assert not engine(model_dir, quantization="int8").runner.batch_invariant
