"""Embeddings: pooling a prompt's last hidden states into one vector (vLLM's pooling API, OpenAI's output).

An embedding request is a prefill-only request: it goes through the same scheduler and KV budget as a
generation (chunked when long, batched beside decodes), samples nothing, and finishes the step its last
prompt token is computed, which frees its blocks at once. The runner pools the hidden states after the
model's final norm:
- `last`: the last token's state (what decoder-only embedding models such as e5-mistral and gte-Qwen
  use, and vLLM's default for a causal LM): under causal attention it is the only token that has
  seen the whole input. A cached prefix is reused as for any request (only the last row is needed);
- `mean`: the average over every token, as sentence-transformers' mean pooling. It needs every
  token's hidden state, which a prefix-cache hit would skip, so a mean-pooled request never takes
  cached blocks: it computes its whole prompt (chunk by chunk, summing as it goes).
Vectors are L2-normalised, as OpenAI's are; `dimensions` keeps the first d components and normalises
again (Matryoshka truncation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How one embedding request is pooled (vLLM's `PoolingParams`, with the pooling type per request)."""

    method: str = "last"
    dimensions: int | None = None  # keep the first d components (then normalise again)
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean pooling reads every prompt token's hidden state, so no prefix-cache hit may skip any."""
        return self.method == "mean"


@dataclass
class PooledOutput:
    """The runner's result for one embedding request whose prompt is now fully computed."""

    request_id: str
    embedding: list[float]


def finish_vector(vec, params: PoolingParams) -> list[float]:
    """Truncate to `dimensions` and L2-normalise (a torch vector in, floats out)."""
    vec = vec.float()
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        vec = vec / vec.norm().clamp_min(1e-12)
    return vec.tolist()


def pool_step(items, query_lens: list[int], hidden) -> list[PooledOutput]:
    """Pool this step's hidden rows into the embedding requests among `items` (the runner's batch, rows
    in item order): mean-pooled requests add their rows to a running sum kept on the request (reset when
    a prompt starts over, e.g. after preemption); a request whose last prompt token is in this step
    gets its vector."""
    out: list[PooledOutput] = []
    end = 0
    for it, q in zip(items, query_lens):
        row0, end = end, end + q
        r = it.request
        p = r.pooling
        if p is None:
            continue
        start = r.num_computed_tokens
        if p.method == "mean":
            part = hidden[row0:end].float().sum(0)
            r.pool_sum = part if start == 0 or r.pool_sum is None else r.pool_sum + part
        if start + q < r.num_prompt_tokens:
            continue
        vec = hidden[end - 1] if p.method == "last" else r.pool_sum / r.num_prompt_tokens
        r.pool_sum = None
        out.append(PooledOutput(r.request_id, finish_vector(vec, p)))
    return out


def default_pooling(model: str | Path) -> str:
    """The pooling a model says it was trained with (sentence-transformers' `1_Pooling/config.json`),
    else `last` (a causal LM: the last token is the one that saw everything)."""
    cfg = Path(model) / "1_Pooling" / "config.json"
    try:
        modes = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return "last"
    if modes.get("pooling_mode_mean_tokens"):
        return "mean"
    return "last"
