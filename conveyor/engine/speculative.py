"""Speculative decoding: propose a few tokens per decoding sequence, verify them all in one step.

At small batch a decode step is memory-bound: the weights are read once whatever the number of
rows, so k + 1 rows of one sequence cost little more than one. A *proposer* guesses the next k
tokens; the step feeds `[last token, guess 1 .. guess k]` and the model's k + 1 output rows say
what it would have sampled at each position. Guess i is kept while the sample at its row equals it;
the first row whose sample differs gives the corrected token, and if every guess held the last
row gives a bonus token. So a step yields 1 to k + 1 tokens, each of them a sample of the target
model given exactly the tokens before it:

- greedy: each row's argmax; the output is token-identical to decoding without speculation.
- temperature > 0: the ngram proposer's guess is a point mass q = 1{d}. Standard rejection
  sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and, on rejection, samples the
  residual (p - q)+ normalised, which is p with d removed. Sampling x ~ p at the row and keeping d
  when x == d does exactly that: P(keep) = p(d), and a rejected row's x is distributed as p given
  x != d. So verification is the ordinary sampler run on every row, and the output distribution is
  the target's.

KV rollback: the step writes K/V for every guess; the scheduler then counts as computed only the
last real token and the kept guesses, and returns blocks that held only rejected guesses.

Back-off: extra rows are not free once a step is compute-bound (large batches on a CPU). The engine
measures the forward's cost per token count at startup and speculates only when the expected tokens
per second of the step with guesses beat the step without (`SpecBackoff`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from conveyor.config import QUANTIZATIONS, json_object
from conveyor.request import Request


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config`: `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}`, or `{"method": "draft", "model": PATH | "self", "quantization": "int4"}` (a
    config with a model and no method is a draft, as in vLLM); `disable_by_batch_size` turns speculation
    off from that many running sequences on (vLLM's name); `backoff` false keeps it on whatever it costs."""

    method: str = "ngram"  # ngram | draft (vLLM also says draft_model)
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft: a model with the target's vocabulary, or "self" (the default)
    quantization: str | None = None  # draft: its weights (default for "self": int4)
    num_layers: int | None = None  # draft: only its first N layers (layer skip)
    disable_by_batch_size: int | None = None
    backoff: bool = True

    @classmethod
    def parse(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": "draft"}
        cfg = cls(**value)
        if cfg.method == "draft_model":
            cfg.method = "draft"
        if cfg.method == "draft":
            cfg.model = cfg.model or "self"
            if cfg.model == "self" and cfg.quantization is None:
                cfg.quantization = "int4"
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def integer(name: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"speculative_config: {name} must be an integer >= {lo}, got {v!r}")

        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            integer(name, 1)
        integer("disable_by_batch_size", 1, optional=True)
        integer("num_layers", 1, optional=True)
        if self.method in ("ngram", "prompt_lookup") and (self.model or self.num_layers or self.quantization):
            raise ValueError("speculative_config: model, num_layers and quantization are for method draft")
        if self.method not in ("ngram", "prompt_lookup", "draft"):
            raise ValueError(f"speculative_config: method {self.method!r} is not supported (ngram, draft)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config: quantization must be {' or '.join(QUANTIZATIONS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")


def can_speculate(req: Request) -> bool:
    """Requests whose sampling depends on their own earlier output in ways a row cannot see (penalties
    count output tokens, min_tokens counts them, a grammar follows them) decode one token at a time."""
    p = req.params
    return (req.matcher is None and not p.needs_penalties and len(req.output_token_ids) >= p.min_tokens
            and req.prompt_logprobs is None and req.pooling is None)


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (n_max down to n_min long) that occurred
    before; propose the (up to) k tokens that followed its most recent earlier occurrence."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


@dataclass
class SpecStats:
    """Counters in vLLM's terms: drafts proposed, tokens drafted and accepted, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified draft, the bonus/corrected one included (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecBackoff:
    """Speculate only when it pays: with t(n) the forward's time for n tokens (measured at startup)
    and a the acceptance rate so far, a step of B decodes and P other tokens yields B tokens in
    t(B + P) without guesses, and B + a * D in t(B + P + D) with D guesses. Guess when the second
    rate is higher (by a small margin, since t is measured once and noisy)."""

    MARGIN = 1.05

    def __init__(self, costs: dict[int, float]) -> None:
        self.sizes = np.array(sorted(costs), dtype=np.float64)
        self.times = np.array([costs[n] for n in sorted(costs)], dtype=np.float64)
        self.accepted = 1.0  # optimistic start (prior of 2 of 2 accepted): the first guesses are tried
        self.proposed = 2.0

    def t(self, n: int) -> float:
        return float(np.interp(n, self.sizes, self.times, right=self.times[-1] * n / self.sizes[-1]))

    def observe(self, proposed: int, accepted: int) -> None:
        decay = 0.99  # an average over roughly the last hundred drafts: workloads change
        self.proposed = self.proposed * decay + proposed
        self.accepted = self.accepted * decay + accepted

    def worth_it(self, num_decodes: int, num_other: int, num_guesses: int, guess_cost_s: float = 0.0) -> bool:
        """`guess_cost_s`: what making the guesses costs (a draft model's forwards; ngram: nothing)."""
        if num_guesses == 0:
            return False
        rate = self.accepted / max(self.proposed, 1e-9)
        plain = num_decodes / self.t(num_decodes + num_other)
        spec = (num_decodes + rate * num_guesses) / (self.t(num_decodes + num_other + num_guesses) + guess_cost_s)
        return spec > plain * self.MARGIN


def measure_forward_costs(runner, max_rows: int, context: int = 256, repeats: int = 3) -> dict[int, float]:
    """Seconds of one forward over n decode-like rows (one query each, `context` tokens of history),
    for n = 1, 2, 4, ... up to `max_rows`: what a step of n decodes, or of fewer decodes with
    guesses, costs. Runs at startup in scratch blocks 0.. (every KV slot is written before it is
    read, so no request can see what this leaves there)."""
    import torch

    from conveyor.model.attention import build_metadata

    bs = runner.block_size
    context = min(context, runner.num_blocks * bs)
    blocks = list(range(-(-context // bs)))
    costs: dict[int, float] = {}
    n = 1
    while n <= max_rows:
        meta = build_metadata([1] * n, [context] * n, [blocks] * n, bs, runner.device, runner.attention_backend)
        ids = torch.zeros(n, dtype=torch.long, device=runner.device)
        pos = torch.full((n,), context - 1, dtype=torch.long, device=runner.device)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                t0 = time.perf_counter()
                h = runner.model(ids, pos, runner.kv_caches, meta)
                runner.model.compute_logits(h)
                if runner.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
        costs[n] = best
        n *= 2
    return costs
