"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class StepDelta:
    """What one engine step added to one sequence (used for streaming)."""

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    extra: dict = field(default_factory=dict)
    embedding: list[float] | None = None  # an embedding request's pooled vector, with its final delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
