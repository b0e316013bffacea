"""Seeded request generators: what the lab sends, fixed before any strategy runs.

Every strategy is measured on byte-identical requests (same prompts, same lengths, same arrival
offsets), so differences in the results come from batching alone. Prompts are random token ids,
not text: detokenization cost and tokenizer quirks stay out of the measurement, and with
`ignore_eos` the output lengths hold exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("random", "longtail", "shared-prefix", "noisy-neighbour", "mixed-slo")
QUIET, NOISY = "quiet", "noisy"  # noisy-neighbour's tenants
CHAT, BATCH = "chat", "batch"  # mixed-slo's tenants
FIRST_TOKEN_ID = 100  # below this, vocabularies keep their special tokens


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: str | None = None  # sent as the OpenAI `user` field (None: the default tenant)
    slo_ttft_ms: float | None = None  # its own latency targets (None: the run's --slo-*-ms, if any)
    slo_tpot_ms: float | None = None
    lora: str | None = None  # the LoRA adapter it runs under, by name (None: the base model; bench/lora.py)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class WorkloadSpec:
    """All knobs of all workloads; each generator reads the ones it needs."""

    name: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    # longtail: a chat-like mix, most requests short and a few very long
    long_fraction: float = 0.2
    short_input: tuple[int, int] = (32, 128)
    short_output: tuple[int, int] = (32, 128)
    long_input: tuple[int, int] = (512, 1500)
    long_output: tuple[int, int] = (128, 384)
    # shared-prefix: a common system prompt of prefix_len tokens, then input_len random tokens
    prefix_len: int = 256
    num_prefixes: int = 1  # shared-prefix: distinct system prompts, taken in turn (tenants; what a prefix router sorts)
    # noisy-neighbour: random-sized requests (input_len, output_len) from two tenants, the noisy one sending
    # noisy_ratio times as many as the quiet one (each request is noisy with probability ratio / (ratio + 1),
    # so in an open loop both tenants are Poisson streams, the noisy at ratio x the quiet's rate)
    noisy_ratio: float = 8.0
    # mixed-slo: interactive chat (short_input/short_output, tight targets) beside batch jobs (long_input /
    # long_output, loose TTFT target), a long_fraction of the requests
    chat_ttft_ms: float = 1000.0
    chat_tpot_ms: float = 200.0
    batch_ttft_ms: float = 30000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        for name in ("short_input", "short_output", "long_input", "long_output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {self.num_prefixes}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if not self.noisy_ratio > 0:
            raise ValueError(f"noisy_ratio must be > 0, got {self.noisy_ratio}")
        for name in ("chat_ttft_ms", "chat_tpot_ms", "batch_ttft_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def _token_range(vocab_size: int) -> tuple[int, int]:
    low = FIRST_TOKEN_ID if vocab_size > 2 * FIRST_TOKEN_ID else vocab_size // 4
    return low, vocab_size - 1


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = _token_range(vocab_size)
    return [rng.randint(lo, hi) for _ in range(n)]


def _around(rng: random.Random, center: int, ratio: float) -> int:
    """vLLM's random-dataset rule: uniform in [center * (1 - ratio), center * (1 + ratio)], at least 1."""
    lo, hi = int(center * (1 - ratio)), int(center * (1 + ratio))
    return max(1, rng.randint(lo, hi))


def generate(spec: WorkloadSpec, vocab_size: int, max_model_len: int | None = None) -> list[BenchRequest]:
    """The workload's requests, identical for identical (spec, vocab_size, max_model_len).

    With `max_model_len`, a request is shortened (prompt first, keeping at least one output token)
    so that prompt + output fits; otherwise the engine would cut it and the lengths would not hold.
    """
    rng = random.Random(spec.seed)
    shared = spec.name == "shared-prefix"
    prefixes = [_tokens(rng, spec.prefix_len, vocab_size) for _ in range(spec.num_prefixes)] if shared else [[]]
    out = []
    for i in range(spec.num_prompts):
        prefix = prefixes[i % len(prefixes)]
        extra: dict = {}
        if spec.name == "mixed-slo":
            long = rng.random() < spec.long_fraction
            p_lo, p_hi = spec.long_input if long else spec.short_input
            o_lo, o_hi = spec.long_output if long else spec.short_output
            n_in, n_out = rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)
            extra = (dict(tenant=BATCH, slo_ttft_ms=spec.batch_ttft_ms) if long else
                     dict(tenant=CHAT, slo_ttft_ms=spec.chat_ttft_ms, slo_tpot_ms=spec.chat_tpot_ms))
        elif spec.name == "longtail":
            long = rng.random() < spec.long_fraction
            p_lo, p_hi = spec.long_input if long else spec.short_input
            o_lo, o_hi = spec.long_output if long else spec.short_output
            n_in, n_out = rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)
        else:
            n_in = _around(rng, spec.input_len, spec.range_ratio)
            n_out = _around(rng, spec.output_len, spec.range_ratio)
            if spec.name == "noisy-neighbour":
                extra = dict(tenant=NOISY if rng.random() < spec.noisy_ratio / (spec.noisy_ratio + 1) else QUIET)
        prompt = prefix + _tokens(rng, n_in, vocab_size)
        if max_model_len is not None:
            n_out = max(1, min(n_out, max_model_len - 1))
            prompt = prompt[: max_model_len - n_out]
        out.append(BenchRequest(prompt, n_out, **extra))
    return out


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent (open loop).

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as in vLLM's
    benchmark: burstiness 1 is a Poisson process, below 1 is burstier, above 1 more regular. An
    infinite rate sends everything at once (the offline / saturation case).
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 7919)  # independent of the prompt stream, so rates do not change prompts
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
