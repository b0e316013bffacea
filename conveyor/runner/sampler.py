"""Choose the next token for every request in a step, vectorised over the batch.

Order (as in vLLM): penalties -> logit_bias -> grammar mask -> min_tokens EOS masking -> temperature ->
top-k -> top-p -> min-p -> sample. Greedy rows take the argmax of the penalised logits. Every other
row draws one uniform number u and takes the token where the cumulative probability of the kept
tokens, in token-id order, first exceeds u (inverse-CDF sampling). A seeded request draws its u from
a generator seeded by (seed, position), so its tokens depend neither on what else is in the batch,
nor on preemption, nor on speculation.

Two implementations of the cut-offs and the draw, given the same u they pick the same token (up to
float rounding at a cut-off's edge):
- the compiled kernel (`conveyor/kernels/csrc/sampler.cpp`): a threshold found by radix selection,
  no sort; 64 rows of SmolLM2's 49,152 logits in about a millisecond (`benchmarks/sampler.py`);
- `sample_reference`, pure torch: sorts each row, as vLLM's torch sampler does. It runs where the
  kernels are not built, on CUDA, and with `CONVEYOR_SAMPLER=torch`, and the kernel is tested
  against it (`tests/runner/test_sampler_kernel.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from conveyor import kernels
from conveyor.request import Request

if TYPE_CHECKING:
    from conveyor.pooling import PooledOutput
    from conveyor.runner.grammar_mask import GrammarMask


@dataclass
class SampleResult:
    """Per row (from `sample`), or per sampling item as lists of its new tokens (from the runner's `verify`)."""

    token_ids: list
    logprobs: list  # per row: {token: logprob} for sampled + top-k, or None
    sampled_logprobs: list
    bad: list[int] = field(default_factory=list)  # rows (per-row result) or items (verified) with non-finite logits
    pooled: list[PooledOutput] = field(default_factory=list)  # embedding requests whose prompt is now computed
    # the runner's step (`ModelRunner.execute`) also says, so that nobody reads them off the runner afterwards:
    # seconds in (prepare inputs, model forward, LM head, sampling); on CUDA the sampling phase absorbs the wait
    phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # prompt logprobs computed in this step, by request id (requests that asked for them; rarely any)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


def _penalise(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    b, v = logits.shape
    dev = logits.device
    rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
    for i in rows:  # per penalised request: a bincount over its own tokens (no per-token Python loop)
        r, p = reqs[i], reqs[i].params
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
        counts = torch.bincount(out, minlength=v)[:v].to(logits.dtype) if len(out) else None
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool, device=dev)
            seen[torch.tensor(r.all_token_ids, dtype=torch.long, device=dev)] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, pen, row)
        if counts is not None:
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """The noise of a seeded request's `position`-th output token: a function of (seed, position) only,
    so the token depends neither on the batch, nor on preemption, nor on how many rows speculative
    decoding sampled before it (with speculation, a seeded request's output is the one it has without)."""
    return torch.Generator().manual_seed(hash((seed, position)) & (2**63 - 1))


def uniforms(reqs: list[Request], positions: list[int] | None = None) -> torch.Tensor:
    """One u in [0, 1) per row (float64): from the row's own (seed, position) generator when its request
    is seeded, else from torch's global generator (one call for all of them)."""
    u = torch.rand(len(reqs), dtype=torch.float64)
    for i, r in enumerate(reqs):
        if r.params.seed is not None:
            pos = positions[i] if positions is not None else len(r.output_token_ids)
            u[i] = torch.rand(1, dtype=torch.float64, generator=seeded_generator(r.params.seed, pos))[0]
    return u


def kept_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The reference cut-offs on tempered logits `x` [B, V]: which tokens top-k, then top-p (on what top-k
    kept, renormalised: the smallest set whose mass reaches p), then min-p (relative to the best) keep.
    `top_k` <= 0 or >= V, `top_p` 1 and `min_p` 0 are off. Sorts every row."""
    v = x.shape[-1]
    keep = torch.isfinite(x)
    k = torch.where((top_k <= 0) | (top_k >= v), v, top_k)
    sorted_x, idx = x.sort(dim=-1, descending=True)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    keep &= x >= kth
    probs_sorted = sorted_x.masked_fill(sorted_x < kth, float("-inf")).softmax(dim=-1)
    exclusive = probs_sorted.cumsum(dim=-1) - probs_sorted
    drop_sorted = (exclusive > top_p[:, None]) & (top_p[:, None] < 1)  # keep the smallest set reaching top_p
    keep &= ~torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return keep


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Pure torch: the kept tokens' probabilities, and the token where their cumulative sum in token-id order
    first exceeds u times their total. The reference for the compiled `sample_rows`, and its fallback."""
    x = logits / temperature[:, None]
    keep = kept_mask(x, top_k, top_p, min_p)
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values).masked_fill(~keep, 0.0).double()
    cum = e.cumsum(dim=-1)
    target = (u.to(cum.device) * cum[:, -1])[:, None]
    return torch.searchsorted(cum, target, right=True).clamp(max=x.shape[-1] - 1)[:, 0]


def _compiled(name: str):
    """The compiled sampler op `name` (`sample_rows`, `argmax_rows`), or None: kernels not built, an older build
    without it, or `CONVEYOR_SAMPLER=torch` (the pure-torch reference for both)."""
    if os.environ.get("CONVEYOR_SAMPLER", "auto") == "torch":
        return None
    k = kernels.load()
    return getattr(k, name, None) if k is not None else None


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.max(logits, dim=-1): each row's largest value and its first index, NaN propagating. On CPU the
    compiled `argmax_rows` (same answers: tests/runner/test_sampler_kernel.py) where it is built: torch's
    indexed reduction takes ~47 us for one row of 49,152 logits and ~1.8 ms for 64 rows (2-core Zen 4)."""
    op = _compiled("argmax_rows") if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if op is not None and logits.shape[-1] > 0:
        return tuple(op(logits.contiguous()))
    return logits.max(dim=-1)


def sample(logits: torch.Tensor, reqs: list[Request], grammar: GrammarMask | None = None,
           positions: list[int] | None = None) -> SampleResult:
    """logits: [B, V] float32, one row per request that samples this step; `grammar`: the allowed
    tokens of the rows whose output is constrained (structured outputs); `positions`: which output
    token each row samples (default: the next one; speculative rows sample later ones)."""
    b, v = logits.shape
    dev = logits.device
    if any(r.params.needs_penalties for r in reqs):
        logits = _penalise(logits.clone(), reqs)
    for i, r in enumerate(reqs):  # logit_bias: added to the raw logits, as OpenAI does
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), device=dev)
            logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype, device=dev)
    if grammar is not None:
        grammar.apply(logits)
    for i, r in enumerate(reqs):  # min_tokens: EOS and stop ids are not allowed yet (a grammar decides alone)
        if len(r.output_token_ids) < r.params.min_tokens and r.matcher is None:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, torch.tensor(banned, device=dev)] = float("-inf")

    want_logprobs = any(r.params.logprobs is not None for r in reqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    top, tokens = _argmax(logits)  # the argmax, and its value: NaN or +-inf means a broken row
    bad = (~torch.isfinite(top)).nonzero().flatten().tolist()
    rows = [i for i, r in enumerate(reqs) if not r.params.greedy]  # decided on the host: no device sync
    if rows:
        sub = [reqs[i] for i in rows]
        x = logits if len(rows) == b else logits[torch.tensor(rows, device=dev)]
        temperature = torch.tensor([r.params.temperature for r in sub], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in sub], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in sub], dtype=torch.float32)
        min_p = torch.tensor([r.params.min_p for r in sub], dtype=torch.float32)
        u = uniforms(sub, None if positions is None else [positions[i] for i in rows])
        kernel = _compiled("sample_rows") if dev.type == "cpu" and x.dtype == torch.float32 else None
        if kernel is not None:
            sampled = kernel(x.contiguous(), temperature, top_k, top_p, min_p, u)
        else:
            sampled = sample_reference(x, *(t.to(dev) for t in (temperature, top_k, top_p, min_p)), u)
        if len(rows) == b:
            tokens = sampled.to(dev)
        else:
            tokens[torch.tensor(rows, device=dev)] = sampled.to(dev)

    token_list = tokens.tolist()
    lps: list[dict[int, float] | None] = [None] * b
    sampled_lp: list[float | None] = [None] * b
    if raw_logprobs is not None:
        for i, r in enumerate(reqs):
            k = r.params.logprobs
            if k is None:
                continue
            row = raw_logprobs[i]
            entry = {token_list[i]: float(row[token_list[i]])}
            if k > 0:
                vals, ids = row.topk(k)
                for t, val in zip(ids.tolist(), vals.tolist()):
                    entry.setdefault(t, val)
            lps[i] = entry
            sampled_lp[i] = entry[token_list[i]]
    return SampleResult(token_list, lps, sampled_lp, bad)
