"""A request, as every front end hands it to the engine (`EngineRequest`), and one sequence's life inside it
(`Request`).

`EngineRequest` is the one record of what a caller asks: the server's endpoints, `LLM`, the lab and any
batch path build it with `make_request`, which validates it, turns milliseconds into seconds and fills in
what the caller left unset from the engine's `RequestDefaults` (the model's recommended sampling, the
engine's latency targets). The engine takes nothing else (`LLMEngine.add_request`) and makes one `Request`
per sequence from it. A new per-request field is a protocol field, a field here, and the code that reads it.

Inside the engine the scheduler only looks at two numbers of a `Request`, `num_computed_tokens` and
`num_tokens` (vLLM v1's rule): whatever lies between them is work to do, whether it is a prompt, a chunk
of one, a recompute after preemption or one decode token. There are no prefill/decode phases to keep in sync.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.lora.request import LoRARequest
from conveyor.outputs import FinishReason
from conveyor.pooling import PoolingParams
from conveyor.sampling_params import SamplingParams

DEFAULT_TENANT = "default"  # the tenant of requests that name none

# the sampling fields a model may recommend (generation_config.json, `--generation-config`)
RECOMMENDED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Tier(enum.IntEnum):
    """A request's service class. Interactive requests (every endpoint's) are served first; batch lines (the Batch
    API, `conveyor/server/batch/`) form a lower tier that only takes the seats, tokens and KV blocks interactive work
    leaves, and gives them back at once when it comes (`conveyor/scheduler/core.py`). Inside each tier the strategy
    (priorities, tenants, deadlines) decides as it always does."""

    INTERACTIVE = 0
    BATCH = 1


def tenant_name(tenant: str | None) -> str:
    """The tenant a request counts for: its own, or the default one when it named none (the one place this
    rule lives: the scheduler's policies, the engine's counts and the server's metrics all read it)."""
    return tenant if tenant is not None else DEFAULT_TENANT


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for the fields it leaves unset, from the engine it goes to (`EngineInfo`): the
    model's recommended sampling (`--generation-config`) and the engine's latency targets (`--slo-ttft-ms`,
    `--slo-tpot-ms`)."""

    sampling: Mapping[str, Any] = field(default_factory=dict)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """`SamplingParams(**fields)`, where a recommendable field given as None (or not given) takes the
        model's recommendation, else `SamplingParams`' own default. Other fields pass as given (None included:
        `max_tokens=None` means no limit)."""
        for name in RECOMMENDED_SAMPLING:
            if fields.get(name) is None:
                fields.pop(name, None)
                if name in self.sampling:
                    fields[name] = self.sampling[name]
        return SamplingParams(**fields)


def _check_seconds(name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it in (vLLM's `EngineCoreRequest`): a prompt's token ids, how to sample
    `params.n` continuations of it (or, with `pooling`, to embed it), and the strategy-neutral fields the
    scheduler may read. Built by `make_request`; valid by construction (checked here, whoever builds it),
    so the engine only checks what depends on it (the vocabulary, the context length, the adapter).
    Sent as it is to the engine loop, in a thread or over a pipe."""

    request_id: str | None  # None: the engine names it ("req-N")
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    pooling: PoolingParams | None = None  # an embedding request: pooled, not sampled (conveyor/pooling.py)
    tenant: str | None = None  # who it is served for (None: the default tenant, `tenant_name`)
    slo_ttft_s: float | None = None  # latency targets, seconds (the engine's defaults already applied)
    slo_tpot_s: float | None = None
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names (None: the base model)
    tier: Tier = Tier.INTERACTIVE  # batch lines: Tier.BATCH, served only with what interactive work leaves
    # time.monotonic() (the same clock in every process on Linux); None: when the engine takes it in
    arrival_time: float | None = None

    def __post_init__(self) -> None:
        if self.request_id is not None and not (isinstance(self.request_id, str) and self.request_id):
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.pooling is not None and (self.params.n != 1 or self.params.structured_outputs is not None):
            raise ValueError("an embedding request samples nothing: n must be 1 and no output grammar")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string, got {self.tenant!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {self.cache_salt!r}")
        _check_seconds("slo_ttft", self.slo_ttft_s)
        _check_seconds("slo_tpot", self.slo_tpot_s)
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(self.lora_request).__name__}")
        if not isinstance(self.tier, Tier):
            raise ValueError(f"tier must be a Tier, got {self.tier!r}")

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for it (`n`; an embedding: one)."""
        return self.params.n


def slo_seconds(ms: float | None) -> float | None:
    """A latency target in seconds, from the milliseconds the API, the flags and the lab's workloads give
    (None stays None: no target)."""
    return ms / 1000.0 if ms is not None else None


def _target_s(name: str, ms: float | None, default_ms: float | None) -> float | None:
    if ms is None:
        ms = default_ms
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < math.inf):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {ms!r}")
    return slo_seconds(ms)


def make_request(prompt_token_ids: list[int], params: SamplingParams, *, defaults: RequestDefaults | None = None,
                 request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                 pooling: PoolingParams | None = None, tenant: str | None = None, slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None, lora_request: LoRARequest | None = None,
                 arrival_time: float | None = None, tier: Tier = Tier.INTERACTIVE) -> EngineRequest:
    """The one way to build an `EngineRequest`: latency targets in milliseconds (as the API, the flags and the
    lab's workloads give them) become seconds, and an unset target takes the engine's default (`defaults`:
    the engine's `EngineInfo.request_defaults`; None: no defaults). Raises ValueError naming a bad field."""
    d = defaults if defaults is not None else RequestDefaults()
    return EngineRequest(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                         pooling=pooling, tenant=tenant,
                         slo_ttft_s=_target_s("slo_ttft_ms", slo_ttft_ms, d.slo_ttft_ms),
                         slo_tpot_s=_target_s("slo_tpot_ms", slo_tpot_ms, d.slo_tpot_ms),
                         lora_request=lora_request, arrival_time=arrival_time, tier=tier)


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
    tier: Tier = Tier.INTERACTIVE  # batch lines take only what interactive requests leave (scheduler/core.py)

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

    @classmethod
    def from_engine_request(cls, request: EngineRequest, group_id: str, index: int, *, arrival_time: float,
                            eos_token_ids: frozenset[int] = frozenset(), fork_from: Request | None = None,
                            lora_key: str | None = None) -> Request:
        """Sequence `index` of `request` (named `group_id` by the engine): n > 1 fans out into `group_id#i`,
        each with its own sample's params (`SamplingParams.for_sample`)."""
        n = request.params.n
        return cls(sequence_ids(group_id, n)[index], list(request.prompt_token_ids),
                   request.params.for_sample(index) if n > 1 else request.params, eos_token_ids=eos_token_ids,
                   parent_id=group_id if n > 1 else None, index=index, priority=request.priority,
                   arrival_time=arrival_time, cache_salt=request.cache_salt, fork_from=fork_from,
                   pooling=request.pooling, tenant=request.tenant, slo_ttft_s=request.slo_ttft_s,
                   slo_tpot_s=request.slo_tpot_s, lora_request=request.lora_request, lora_key=lora_key,
                   tier=request.tier)

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
        return tenant_name(self.tenant)

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

