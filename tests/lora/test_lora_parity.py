"""Greedy outputs under LoRA adapters equal HF transformers + peft with each adapter merged into the base.

Four adapters made here with peft (random, non-zero lora_B; different ranks, targets, alphas and one
rsLoRA), saved and loaded from disk as a user's would be, run mixed with base-model requests in one
batch of 36 requests, under chunked prefill and with prefix caching on: any slip in the fused q/k/v
or gate/up slices, the scaling, the per-adapter row segments or the prefix cache's adapter identity
turns into a different greedy token on these random tiny models.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.lora import LoRARequest
from conveyor.lora.layers import LoRABatch, LoRALinear, segments_for, sgmv_kernel
from tests.conftest import record_steps
from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter, merged_reference

ADAPTERS = {  # name: (r, targets, alpha, rslora)
    "all7": (8, ALL_PROJECTIONS, 16, False),
    "qv": (4, ["q_proj", "v_proj"], 32, False),
    "mlp-rs": (16, ["gate_proj", "up_proj", "down_proj"], 8, True),
    "ko": (2, ["k_proj", "o_proj"], 4, False),
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (r, targets, alpha, rs)) in enumerate(ADAPTERS.items()):
        path = make_adapter(tiny_llama, root / name, r, targets, seed=10 + i, alpha=alpha, rslora=rs)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def workload(hf_tiny, tiny_llama, adapters):
    """(prompts, adapter per prompt, HF + peft greedy tokens per prompt)."""
    rng = random.Random(3)
    vocab = hf_tiny.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(40)]  # one prefix under every adapter and the base
    names = list(adapters)
    prompts, loras = [], []
    for i in range(36):
        n = rng.choice([3, 9, 17, 33, 50, 70])
        p = shared + [rng.randrange(vocab) for _ in range(n % 20)] if i % 3 == 0 else \
            [rng.randrange(vocab) for _ in range(n)]
        prompts.append(p)
        loras.append(names[i % 4] if i < 32 else None)  # 32 requests over 4 adapters, 4 on the base
    refs = {name: merged_reference(tiny_llama, adapters[name].lora_path) for name in adapters}
    refs[None] = hf_tiny
    want = [hf_greedy(refs[name], p, MAX_TOKENS) for p, name in zip(prompts, loras)]
    return prompts, loras, want


def run(llm: LLM, prompts, loras, adapters) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = [adapters[name] if name else None for name in loras]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=reqs)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_mixed_adapters_match_hf_peft_merged(tiny_llama, adapters, workload, path, monkeypatch):
    prompts, loras, want = workload
    monkeypatch.setenv("CONVEYOR_LORA_KERNEL", "1" if path == "kernel" else "0")
    assert sum(1 for x in loras if x) >= 32 and len(set(loras)) == 5
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256, enable_lora=True,
              max_loras=4, max_num_batched_tokens=64, max_num_seqs=64)
    assert llm.engine.config.enable_prefix_caching
    assert llm.engine.info.lora_kernel == (path == "kernel")
    steps = record_steps(llm.engine)
    for attempt in ("cold", "cached"):  # the second pass reads its prefixes from the cache
        outs = run(llm, prompts, loras, adapters)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [(i, loras[i], g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not bad, f"{attempt}: {len(bad)} of {len(want)} requests diverge from HF + peft, first: {bad[0]}"
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert max(s.num_tokens for s in steps) <= 64 and max(len(p) for p in prompts) > 64  # chunked prefill ran
    assert max(s.num_seqs for s in steps) >= 16  # the adapters really shared steps
    assert llm.engine.snapshot().kv_blocks_used == 0


def test_adapter_really_changes_outputs(hf_tiny, workload):
    """Guard: every adapter moves the greedy tokens away from the base model's (non-zero lora_B)."""
    prompts, loras, want = workload
    for name in {x for x in loras if x}:
        idx = [i for i, x in enumerate(loras) if x == name]
        base = [hf_greedy(hf_tiny, prompts[i], MAX_TOKENS) for i in idx]
        assert any(b != want[i] for b, i in zip(base, idx)), name


def test_max_loras_caps_adapters_per_step(tiny_llama, adapters, workload):
    prompts, loras, want = workload
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256, enable_lora=True,
              max_loras=2, max_cpu_loras=4)
    steps = record_steps(llm.engine)
    outs = run(llm, prompts, loras, adapters)
    assert [o.outputs[0].token_ids for o in outs] == want  # the order the scheduler picks changes no token
    assert max(len(s.lora_ids) for s in steps) == 2
    assert llm.engine.snapshot().lora_deferrals > 0  # resident adapters went first (prefer_resident_loras)


def test_lru_keeps_at_most_max_cpu_loras(tiny_llama, adapters, workload):
    prompts, loras, want = workload
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256, enable_lora=True,
              max_loras=1, max_cpu_loras=1)
    outs = run(llm, prompts, loras, adapters)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(llm.engine.list_loras()) == 1  # held past the limit while in use, trimmed once free


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_and_torch_paths_match_rowwise_reference(dtype):
    """The compiled kernel and the torch path (grouped shrink/expand over segments in any order, with gaps
    of base rows) both equal a row-by-row fp32 computation of each row's adapter delta."""
    kernel = sgmv_kernel(dtype, torch.device("cpu"))
    assert kernel is not None, "the compiled kernels should build here"
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(32, 48, bias=True).to(dtype)
    batch = LoRABatch()
    lin = LoRALinear(base, [("q_proj", 16), ("k_proj", 16), ("v_proj", 16)], batch)
    pairs = {1: {"q_proj": (4, 16), "v_proj": (4, 16)}, 2: {"k_proj": (8, 16)},
             3: {"q_proj": (2, 16), "k_proj": (2, 16), "v_proj": (2, 16)}}
    for lid, parts in pairs.items():
        lin.add(lid, {p: (torch.randn(r, 32, generator=g).to(dtype), torch.randn(out, r, generator=g).to(dtype))
                      for p, (r, out) in parts.items()})
    ids = [None, 2, 2, 1, None, 3, 1, 1, None, 2, 9]  # 9: an adapter this linear does not hold
    rows = [1, 3, 1, 2, 4, 1, 1, 5, 2, 40, 2]  # adapter 2's 40 rows: a prefill-sized segment
    x = torch.randn(sum(rows), 32, generator=g).to(dtype)
    row_ids = [lid for lid, n in zip(ids, rows) for _ in range(n)]
    batch.set(segments_for(ids, rows))
    with torch.no_grad():
        want = lin.reference(x, row_ids)
        got_torch = lin(x).float()
        lin.kernel = kernel
        got_kernel = lin(x).float()
        plain = base(x).float()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.3, rtol=0.02)
    torch.testing.assert_close(got_torch, want, **tol)
    torch.testing.assert_close(got_kernel, want, **tol)
    # a projection an adapter leaves out gets nothing from it: adapter 2's rows equal the base in q and v
    i = row_ids.index(2)
    torch.testing.assert_close(got_kernel[i, :16], plain[i, :16])
    torch.testing.assert_close(got_kernel[i, 32:], plain[i, 32:])
    assert not torch.allclose(got_kernel[i, 16:32], plain[i, 16:32])
    base_rows = [j for j, lid in enumerate(row_ids) if lid in (None, 9)]
    assert torch.equal(got_kernel[base_rows], plain[base_rows])  # rows without an adapter pay nothing
    # the kernel's rows are batch-invariant: a row's delta alone is the same bits as among the others,
    # in a segment of one row or of many (decode or prefill)
    for lid in (3, 2):
        a, bt, blocks = lin.stacked[lid]
        full = torch.zeros(len(row_ids), 48, dtype=dtype)
        kernel(full, x, torch.tensor([[0, len(row_ids)]]), [a], [bt], [blocks])
        for j in (row_ids.index(lid), len(row_ids) - 3):
            alone = torch.zeros(1, 48, dtype=dtype)
            kernel(alone, x[j:j + 1].contiguous(), torch.tensor([[0, 1]]), [a], [bt], [blocks])
            assert torch.equal(alone[0], full[j])
    # through the layer, with the step's own segments: each row's delta is the bits it gets alone
    zero = lambda t: t.new_zeros(t.shape[0], 48)  # noqa: E731 (a base whose rows cannot differ)
    deltas = LoRALinear(zero, lin.parts, batch, kernel)
    deltas.stacked = lin.stacked
    one = LoRABatch()
    solo = LoRALinear(zero, lin.parts, one, kernel)
    solo.stacked = lin.stacked
    with torch.no_grad():
        together = deltas(x)
        for j in (row_ids.index(2), row_ids.index(2) + 20, row_ids.index(1), row_ids.index(3)):
            one.set([(row_ids[j], 0, 1)])
            assert torch.equal(solo(x[j:j + 1].contiguous())[0], together[j])
    assert segments_for([1, 1, None, 1, 2], [2, 3, 4, 1, 1]) == [(1, 0, 5), (1, 9, 10), (2, 10, 11)]
