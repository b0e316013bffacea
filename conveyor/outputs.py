"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence ended. A `StrEnum`: each member is its string, so the OpenAI API's JSON
    (`"finish_reason": "stop"`) and every comparison with a plain string stay as they were."""

    STOP = "stop"  # EOS, a stop string or token, or a complete grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the caller aborted it (client gone, timeout, shutdown)
    ERROR = "error"  # it failed alone (its `StepDelta.error` says why); the engine carries on


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
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
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector, with its final delta
    error: str | None = None  # finish_reason ERROR: why this request failed ("TypeName: message")
    # with a sequence's first token, when its params asked for prompt logprobs (as vLLM)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with a sequence's last delta: what the caller's metrics and usage need from the engine's side
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    first_scheduled_time: float | None = None  # time.monotonic() of its first step
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
