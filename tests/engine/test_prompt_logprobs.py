"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions) against a plain
full-prompt forward pass of HF transformers, whole, chunked, and with the prefix cache warm."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.hf_reference import hf_logits


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(5, 250) for _ in range(75)]


def check(out, prompt, hf_tiny, k):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    ref = torch.log_softmax(hf_logits(hf_tiny, prompt), dim=-1)
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert abs(entry[prompt[i]] - ref[i - 1, prompt[i]].item()) < 1e-3, i
        assert k <= len(entry) <= k + 1
        best = int(ref[i - 1].argmax())
        if k:
            assert best in entry and abs(entry[best] - ref[i - 1, best].item()) < 1e-3


@pytest.mark.parametrize("budget", [4096, 16])  # whole, and chunked into 16-token pieces
def test_prompt_logprobs_match_hf(tiny_llama, hf_tiny, prompt, budget):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=budget)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, ignore_eos=True)
    check(llm.generate([prompt], sp, use_tqdm=False)[0], prompt, hf_tiny, 3)


def test_prompt_logprobs_with_the_prefix_cache_warm(tiny_llama, hf_tiny, prompt):
    """The prompt is cached by a first request; a request asking for prompt logprobs recomputes it."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    check(out, prompt, hf_tiny, 0)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still use the cache


def test_prompt_logprobs_with_parallel_samples_and_preemption(tiny_llama, hf_tiny, prompt):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=32)
    sp = SamplingParams(n=2, max_tokens=40, temperature=0, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([prompt, prompt[:50]], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    check(outs[0], prompt, hf_tiny, 1)
    check(outs[1], prompt[:50], hf_tiny, 1)
