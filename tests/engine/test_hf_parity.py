"""Greedy outputs and logits equal Hugging Face transformers' on the same weights, in float32.

HF's `LlamaForCausalLM` is the reference implementation: if our paged attention, RoPE, fused
projections, scheduling (chunking, preemption, prefix reuse, any policy) or weight loading is off
by anything, the random tiny models used here amplify it into a different greedy token quickly.
The prompts are random token ids (3..200 tokens) run *together*, so padding and batching bugs show.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.attention import build_metadata
from conveyor.model.llama import rope_inv_freq
from conveyor.scheduler.policies import POLICIES
from tests.conftest import record_steps
from tests.hf_reference import hf_greedy, hf_logits

PROMPT_LENS = [3, 4, 5, 7, 9, 12, 16, 17, 23, 31, 32, 33, 48, 64, 65, 100, 127, 150, 200]
SHARED_PREFIX_LEN = 48  # a few prompts share this many leading tokens, so prefix caching has work
MAX_MODEL_LEN = 256
LOGITS_ATOL = 1e-4


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
    base = prompts[PROMPT_LENS.index(64)]
    for tail in (5, 16, 40):  # share a 3-block prefix with the 64-token prompt
        prompts.append(base[:SHARED_PREFIX_LEN] + [rng.randrange(vocab) for _ in range(tail)])
    prompts.append(list(base))  # an exact duplicate
    return prompts


def max_tokens_for(i: int) -> int:
    return 6 + (i * 5) % 11  # 6..16, so requests finish at different steps


@pytest.fixture(scope="module")
def prompts(hf_tiny) -> list[list[int]]:
    return make_prompts(hf_tiny.config.vocab_size)


@pytest.fixture(scope="module")
def reference(hf_tiny, prompts) -> list[list[int]]:
    return [hf_greedy(hf_tiny, p, max_tokens_for(i)) for i, p in enumerate(prompts)]


def run_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens_for(i), ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(want)} prompts diverge from HF, first: {bad[0]}"


def test_prompt_set_is_varied(prompts):
    """The parity tests below are only as good as the mix they run."""
    lens = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16 and lens[0] <= 3 and lens[-1] >= 200


def test_greedy_matches_hf_all_together(tiny_llama, prompts, reference):
    # prefix caching off: with it on, prompts sharing a prefix wait one step for the first to cache it
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=False)
    steps = record_steps(llm.engine)
    assert_same(run_greedy(llm, prompts), reference)
    first = steps[0]
    assert first.num_seqs == len(prompts), "all prompts should have been prefilled in one batch"


def test_greedy_matches_hf_with_chunked_prefill(tiny_llama, prompts, reference):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=32)
    stats = record_steps(llm.engine)
    assert_same(run_greedy(llm, prompts), reference)
    assert max(s.num_tokens for s in stats) <= 32
    assert max(len(p) for p in prompts) > 32  # so some prompt really was split across steps


def test_greedy_matches_hf_under_preemption(tiny_llama, prompts, reference):
    # 16 blocks x 16 tokens: the longest request (200 + 16 tokens) just fits, all of them never do
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    assert_same(run_greedy(llm, prompts), reference)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.pool.num_free == 16


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight"])
@pytest.mark.parametrize("scheduler", list(POLICIES))
def test_every_scheduler_gives_hf_tokens(tiny_llama, prompts, reference, scheduler, tight):
    kw = dict(num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=6) if tight else dict(num_kv_blocks=256)
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN, scheduler=scheduler, batch_size=5,
              **kw)
    assert_same(run_greedy(llm, prompts), reference)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_prefix_caching_on_and_off(tiny_llama, prompts, reference, caching):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=caching)
    assert_same(run_greedy(llm, prompts), reference)
    # a second pass over the same prompts: with caching on, their prefixes come from the cache
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens_for(i), ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same([o.outputs[0].token_ids for o in outs], reference)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    if caching:
        assert cached > 0
        assert llm.engine.kv.prefix_hits > 0
    else:
        assert cached == 0 and llm.engine.kv.prefix_hits == 0


# --- logits of one prefill --------------------------------------------------------------------------

def engine_prefill_logits(llm: LLM, ids: list[int], chunks: list[int] | None = None) -> torch.Tensor:
    """Logits for every prompt position from our model, fed in `chunks` (default: one piece).

    Drives the model directly on blocks 0.. of a fresh engine's KV cache, as the runner would.
    """
    runner = llm.engine.runner
    assert not llm.engine.has_unfinished_requests()
    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))
    sizes = chunks or [len(ids)]
    assert sum(sizes) == len(ids)
    out, start = [], 0
    with torch.inference_mode():
        for n in sizes:
            end = start + n
            meta = build_metadata([n], [end], [table], bs, runner.device, runner.attention_backend)
            hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_caches, meta)
            out.append(runner.model.compute_logits(hidden))
            start = end
    llm.engine.kv.pool.reset_cache()  # the blocks we wrote are not indexed; make sure of it
    return torch.cat(out)


def test_prefill_logits_match_hf(tiny_llama, hf_tiny, prompts):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)
    ids = prompts[PROMPT_LENS.index(200)]
    assert len(ids) == 200
    want = hf_logits(hf_tiny, ids)
    got = engine_prefill_logits(llm, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
    # the same logits when the prompt is prefilled in uneven chunks against the paged cache
    chunked = engine_prefill_logits(llm, ids, chunks=[1, 15, 16, 17, 50, 100, 1])
    torch.testing.assert_close(chunked, want, atol=LOGITS_ATOL, rtol=0)


def test_logits_are_not_trivially_close(tiny_llama, hf_tiny, prompts):
    """Guard: a one-token shift in position changes HF's logits by far more than the tolerance."""
    ids = prompts[PROMPT_LENS.index(200)]
    a, b = hf_logits(hf_tiny, ids), hf_logits(hf_tiny, [ids[0]] + ids)[1:]
    assert (a - b).abs().max() > 100 * LOGITS_ATOL


# --- other members of the family ----------------------------------------------------------------------

def randomise(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1; randomise both so that loading them matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)


def build_variant(path: Path, tokenizer_dir: Path, arch: str, seed: int = 1, **overrides) -> Path:
    """A tiny random checkpoint of another family member, sharing the tiny Llama's tokenizer."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    cfg = dict(vocab_size=base["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
               initializer_range=0.3, eos_token_id=base["eos_token_id"], bos_token_id=base["bos_token_id"],
               tie_word_embeddings=False)
    cfg.update(overrides)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).eval()
    randomise(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["architectures"] == [arch]
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
VARIANTS = {
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", dict(rope_theta=50000.0, use_sliding_window=False)),
    "llama3-rope": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "tied-embeddings": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-all-biases": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "wide-head-dim": ("LlamaForCausalLM", dict(head_dim=32)),
    "mistral-mha": ("MistralForCausalLM", dict(num_key_value_heads=4, sliding_window=None)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tiny_llama, tmp_path_factory):
    """(name, checkpoint dir, HF model in float32) for each family member."""
    from transformers import AutoModelForCausalLM

    name = request.param
    arch, overrides = VARIANTS[name]
    path = build_variant(tmp_path_factory.mktemp(name), tiny_llama, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return name, path, hf


def test_variant_matches_hf(variant):
    name, path, hf = variant
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    cfg = llm.engine.model_config
    if name == "qwen2-qkv-bias":
        assert cfg.qkv_bias and not cfg.o_bias and cfg.rope_theta == 50000.0
    elif name == "llama3-rope":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        plain = rope_inv_freq(type(cfg)(**{**vars(cfg), "rope_scaling": None}))
        assert not torch.allclose(rope_inv_freq(cfg), plain)  # the scaling really changes frequencies
    elif name == "tied-embeddings":
        assert cfg.tie_word_embeddings
        head = llm.engine.runner.model.lm_head
        head_ptr = head.source_ptr if hasattr(head, "source_ptr") else head.weight.data_ptr()  # packed or not
        assert head_ptr == llm.engine.runner.model.embed_tokens.weight.data_ptr()
    elif name == "llama-all-biases":
        assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    elif name == "wide-head-dim":
        assert cfg.head_dim == 32
    prompts = make_prompts(cfg.vocab_size, seed=7)[::3]
    # prefill logits at every position (llama3 rope: positions past the original context included)
    long = max(prompts, key=len)
    torch.testing.assert_close(engine_prefill_logits(llm, long), hf_logits(hf, long), atol=LOGITS_ATOL, rtol=0)
    want = [hf_greedy(hf, p, max_tokens_for(i)) for i, p in enumerate(prompts)]
    assert_same(run_greedy(llm, prompts), want)
