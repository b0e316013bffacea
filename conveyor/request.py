"""One sequence's life in the engine: its tokens, its progress and its timestamps.

The scheduler only looks at two numbers, `num_computed_tokens` and
`num_tokens` (vLLM v1's rule): whatever lies between them is work to do,
whether it is a prompt, a chunk of one, a recompute after preemption or one
decode token. There are no prefill/decode phases to keep in sync.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.lora.request import LoRARequest
from conveyor.outputs import FinishReason
from conveyor.pooling import PoolingParams
from conveyor.sampling_params import SamplingParams

DEFAULT_TENANT = "default"  # the tenant of requests that name none


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field-by-field: requests are compared in queue removals
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    parent_id: str | None = None  # the user's request id when n > 1 fans out
    index: int = 0  # which of the n samples
    priority: int = 0  # lower is served first (iteration policy)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    fork_from: Request | None = field(default=None, repr=False)  # n > 1: share this sibling's prompt blocks
    pooling: PoolingParams | None = None  # an embedding request: prefill only, pooled (conveyor/pooling.py)
    tenant: str | None = None  # who sent it (the OpenAI `user` field by default); None: DEFAULT_TENANT
    slo_ttft_s: float | None = None  # latency targets (time to first token, time per output token), if any
    slo_tpot_s: float | None = None
    lora_request: LoRARequest | None = None  # the adapter this request runs under (None: the base model)
    lora_key: str | None = None  # that adapter's content digest: part of every KV block hash


    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0

    output_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt is computed
    cumulative_logprob: float = 0.0
    matcher: Any = field(default=None, repr=False)  # llguidance LLMatcher when the output has a grammar
    spec_token_ids: list[int] = field(default_factory=list)  # guessed next tokens, verified in the next step
    pool_sum: Any = field(default=None, repr=False)  # mean pooling: the hidden states summed so far

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    waited_steps: int = 0  # steps spent waiting, for priority aging
    total_waited_steps: int = 0  # steps spent waiting over its whole life (not reset at admission or preemption)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (nothing predicts it)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_remaining_work(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is pending: a prompt, a chunk of one, or a recompute."""
        return self.num_remaining_work > 1

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 1 << 30

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def group_id(self) -> str:
        return self.parent_id or self.request_id

    @property
    def tenant_id(self) -> str:
        """The tenant this request counts for: its own, or the default one when it named none."""
        return self.tenant if self.tenant is not None else DEFAULT_TENANT

    @property
    def ttft_deadline(self) -> float | None:
        """When its first token is due (arrival + TTFT target), on the `time.monotonic()` clock."""
        return None if self.slo_ttft_s is None else self.arrival_time + self.slo_ttft_s


@dataclass
class ScheduledItem:
    """One request's share of a step: feed `num_tokens` tokens starting at its `num_computed_tokens`."""

    request: Request
    num_tokens: int  # including `num_draft` guessed tokens after the real ones
    num_draft: int = 0

    @property
    def samples(self) -> bool:
        """This step ends the pending work and a token is drawn (an embedding request draws none)."""
        return (self.request.num_computed_tokens + self.num_tokens - self.num_draft == self.request.num_tokens
                and self.request.pooling is None)


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: itself when n == 1, else `id#0` .. `id#{n-1}` (the one
    place this naming rule lives)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

