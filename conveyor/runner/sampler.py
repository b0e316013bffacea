"""Choose the next token for every request in a step, vectorised over the batch.

Order (as in vLLM): penalties -> logit_bias -> grammar mask -> min_tokens EOS masking -> temperature ->
top-k -> top-p -> min-p -> sample. Greedy rows take the argmax of the penalised logits. Random rows use
the exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals multinomial sampling; a seeded
request draws each token's E from a generator seeded by (seed, position), so its tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from conveyor.request import Request

if TYPE_CHECKING:
    from conveyor.engine.structured_output import GrammarMask
    from conveyor.pooling import PooledOutput


@dataclass
class SampleResult:
    """Per row (from `sample`), or per sampling item as lists of its new tokens (from the runner's `verify`)."""

    token_ids: list
    logprobs: list  # per row: {token: logprob} for sampled + top-k, or None
    sampled_logprobs: list
    bad: list[int] = field(default_factory=list)  # rows (per-row result) or items (verified) with non-finite logits
    pooled: list[PooledOutput] = field(default_factory=list)  # embedding requests whose prompt is now computed


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

    greedy_list = [r.params.greedy for r in reqs]  # decided on the host: no device sync per step
    top, tokens = logits.max(dim=-1)  # the argmax, and its value: NaN or +-inf means a broken row
    bad = (~torch.isfinite(top)).nonzero().flatten().tolist()
    if not all(greedy_list):
        greedy = torch.tensor(greedy_list, device=dev)
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in reqs], device=dev)
        x = logits / temps[:, None]
        top_k = [r.params.top_k if r.params.top_k > 0 else v for r in reqs]
        if any(k < v for k in top_k):
            k_t = torch.tensor(top_k, device=dev).clamp(max=v)
            kth = x.sort(dim=-1, descending=True).values.gather(1, (k_t - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        if any(r.params.top_p < 1 for r in reqs):
            top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
            sorted_x, idx = x.sort(dim=-1, descending=True)
            probs_sorted = sorted_x.softmax(dim=-1)
            cum = probs_sorted.cumsum(dim=-1)
            drop_sorted = (cum - probs_sorted) > top_p[:, None]  # keep the smallest set reaching top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        probs = x.softmax(dim=-1)
        if any(r.params.min_p > 0 for r in reqs):
            min_p = torch.tensor([r.params.min_p for r in reqs], device=dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        race = torch.empty_like(probs).exponential_()
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not r.params.greedy:
                pos = positions[i] if positions is not None else len(r.output_token_ids)
                race[i] = torch.empty(v).exponential_(generator=seeded_generator(r.params.seed, pos)).to(dev)
        sampled = (probs / race).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)

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
