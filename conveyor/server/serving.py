"""The shared base of the OpenAI endpoints: what every endpoint does between the HTTP body and the engine.

Each endpoint lives in its own module over `OpenAIServing` (`completions.py`, `chat.py`, `embeddings.py`,
`tokenization.py`); a streaming one writes its events with `streaming.py`. The base parses and checks
(`parse_model`, `check_model`, `tokenize`, `sampling_params`, `structured_outputs`, `check_prompt`),
builds the engine's request records (`engine_requests`: the one place an API request's per-request
fields become an `EngineRequest`), submits them, and either collects the outputs (`collect`) or hands
their deltas out until the request's deadline (`deltas`). What the endpoints share at runtime (the
engine, the names and adapters served, the options, a private tokenizer) is one `ServingContext`.

Everything here runs on the event loop and is cheap per token; the only heavy parts (tokenizing a long
prompt, checking a grammar) go to a worker thread. All validation happens before `submit`, so an input
either gets a 4xx here or is known-good for the engine.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from conveyor.engine.clients import EngineDeadError
from conveyor.engine.llm_engine import validate_prompt
from conveyor.engine.output_processor import RequestOutputBuilder
from conveyor.lora.request import LoRARequest
from conveyor.outputs import FinishReason, RequestOutput
from conveyor.pooling import PoolingParams
from conveyor.request import EngineRequest, make_request
from conveyor.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from conveyor.server import protocol as P
from conveyor.server import tools as T
from conveyor.server.async_engine import AsyncEngine, QueueFullError, Submission
from conveyor.server.http import ApiError, bad_request, engine_error, wait_disconnect
from conveyor.server.tenancy import TenantRule

_TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "tagged-union"}

# Fields OpenAI or vLLM define that this server does not implement yet: refused with a 400 naming the
# field rather than silently ignored (a client relying on them would get output that ignores them).
_UNSUPPORTED = ("functions", "suffix")
_CHAT_ONLY = ("tools", "tool_choice")  # served by /v1/chat/completions (conveyor/server/tools.py)


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached_tokens))


def refuse_unsupported(data: dict, chat: bool = False) -> None:
    for name in _UNSUPPORTED + (() if chat else _CHAT_ONLY):
        value = data.get(name)
        if value in (None, [], "", {}) or (name == "tool_choice" and value == "none"):
            continue
        raise bad_request(f"'{name}' is not supported by this server yet", name)
    for name in ("function_call",):
        if data.get(name) not in (None, "none"):
            raise bad_request(f"'{name}' is not supported by this server yet (no tools)", name)
    best_of = data.get("best_of")
    if best_of is not None and best_of != data.get("n", 1):
        raise bad_request("best_of other than n is not supported (each of the n samples is returned)", "best_of")


def parse_model(cls: type[BaseModel], data: dict) -> BaseModel:
    """Validate a JSON object into `cls`; the first problem becomes a 400 naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))]
        param = ".".join(parts) or None
        raise bad_request(f"{param or 'body'}: {err['msg']}", param) from None


def finite(x: float) -> float:
    """JSON has no -inf: report impossible tokens as -9999 (as vLLM does)."""
    return x if math.isfinite(x) else -9999.0


@dataclass
class ServingOptions:
    """The server's settings every endpoint reads (`build_app` sets them from `ServerArgs`)."""

    request_timeout: float | None = None  # seconds from arrival; then the request is aborted (408)
    chat_template: str | None = None  # --chat-template (None: the tokenizer's own)
    tool_parser: Any = None  # --tool-call-parser, for tool_choice="auto" (conveyor/server/tool_parsers.py)
    pooling: str | None = None  # /v1/embeddings pooling (--pooling; None: last token)
    tenant_rule: TenantRule = field(default_factory=TenantRule)  # --tenant-key


class ServingContext:
    """What every endpoint of one server shares: the engine, the names it answers to and the adapters it
    serves (`loras`, filled by `conveyor/server/lora.py`, also at runtime), the options, and a private
    tokenizer with what is derived from it."""

    def __init__(self, aengine: AsyncEngine, model_names: list[str], options: ServingOptions | None = None) -> None:
        self.aengine = aengine
        self.info = aengine.info
        self.model_names = model_names
        self.loras: dict[str, LoRARequest] = {}  # adapter name -> adapter
        self.options = options if options is not None else ServingOptions()
        # A private tokenizer: HF fast tokenizers may refuse concurrent use ("Already borrowed") and the
        # engine thread decodes with the engine's copy.
        try:
            self.tokenizer = copy.deepcopy(aengine.tokenizer)
        except Exception:
            self.tokenizer = aengine.tokenizer
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=16)
        # No prompt longer than this many characters can fit in max_model_len tokens: reject without tokenizing.
        self.max_prompt_chars = self.max_model_len * max(longest, 16) + 1024
        self.token_strs: dict[int, str] = {}


class OpenAIServing:
    """The base of every endpoint: the steps they share, over one `ServingContext`."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.aengine = ctx.aengine
        self.info = ctx.info
        self.options = ctx.options
        self.tokenizer = ctx.tokenizer
        self.max_model_len = ctx.max_model_len
        self.vocab_size = ctx.vocab_size

    @property
    def model_names(self) -> list[str]:
        return self.ctx.model_names

    # --- shared validation ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.ctx.model_names and name not in self.ctx.loras:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), counted per adapter in /metrics."""
        lora = self.ctx.loras.get(name) if name is not None and name not in self.ctx.model_names else None
        if lora is not None and self.aengine.metrics is not None:
            self.aengine.metrics.lora_requests.labels(self.ctx.model_names[0], lora.lora_name).inc()
        return lora

    async def tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if len(text) > self.ctx.max_prompt_chars:
            raise bad_request(f"{param} is {len(text)} characters long, more than can fit in this model's maximum "
                              f"context length of {self.max_model_len} tokens", param)

        def enc() -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        return await asyncio.to_thread(enc) if len(text) > _TOKENIZE_IN_THREAD_CHARS else enc()

    def sampling_params(self, req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's `SamplingParams`; what it leaves unset takes the model's recommendation
        (`RequestDefaults.sampling_params`)."""
        ids = req.stop_token_ids or []
        if any(t >= self.vocab_size for t in ids):
            raise bad_request(f"stop_token_ids must be below the vocabulary size ({self.vocab_size})",
                              "stop_token_ids")
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        try:
            params = self.info.request_defaults.sampling_params(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias=bias, prompt_logprobs=prompt_logprobs, structured_outputs=structured)
            params.check_vocab(self.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), e.param if isinstance(e, ParamError) else None) from None
        return params

    async def structured_outputs(self, req: P.CompletionRequest | P.ChatCompletionRequest
                                 ) -> StructuredOutputsParams | None:
        """The request's output grammar, from whichever of OpenAI's `response_format`, vLLM's
        `structured_outputs` or its `guided_*` fields names one (more than one is a 400). Checked
        off the event loop: a large schema takes milliseconds to validate."""
        given: list[tuple[str, dict]] = []
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  "response_format.json_schema")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        so = req.structured_outputs
        if so is not None:
            fields = so.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(req, name) is not None:
                given.append((name, {key: getattr(req, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise bad_request(f"give one output constraint, not {len(given)} ({', '.join(n for n, _ in given)})",
                              given[1][0])
        name, fields = given[0]
        try:
            return await asyncio.to_thread(StructuredOutputsParams, **fields)
        except ValueError as e:
            raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {param} has "
                              f"{n} tokens, which leaves no room to generate. Please reduce the length of the "
                              f"{param}.", param)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n + params.max_tokens} tokens ({n} in the {param}, {params.max_tokens} in the "
                              f"completion). Please reduce the length of the {param} or of max_tokens.", "max_tokens")
        try:
            validate_prompt(ids, self.info)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    async def render_chat(self, req: P.ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """A conversation's token ids through the chat template (`--chat-template`, else the tokenizer's)."""
        chat_template = self.options.chat_template
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            conv = T.template_messages(req.messages)
        except T.ToolError as e:
            raise bad_request(str(e), e.param) from None
        total = sum(len(m["content"]) for m in conv)
        if total > self.ctx.max_prompt_chars:
            raise bad_request(f"messages hold {total} characters, more than can fit in this model's maximum "
                              f"context length of {self.max_model_len} tokens", "messages")
        kw = {"chat_template": chat_template} if chat_template is not None else {}
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, tools=tools,
                                                      add_generation_prompt=req.add_generation_prompt, **kw)
        except Exception as e:  # the template may reject a role order or a role it does not know
            raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        return await self.tokenize(text, False, "messages")

    # --- to the engine and back -----------------------------------------------------------------------
    def engine_requests(self, api_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                        req: P.EngineFields, headers: Mapping[str, str], *, pooling: PoolingParams | None = None,
                        lora: LoRARequest | None = None) -> list[EngineRequest]:
        """One engine request record per prompt (`{api_id}-{i}`), the one place an endpoint's per-request
        fields (`P.EngineFields`) become the record: the tenant by the server's rule (`--tenant-key`, read from
        `req.user` or the `headers` the request came with), the priority, the cache salt and the latency
        targets, the engine's defaults for what is unset (`conveyor.request.make_request`). `lora`: the adapter
        to run under (`lora_for(req.model)`). A path without a live request (a batch's lines) passes the headers
        of the call that created it."""
        tenant = self.options.tenant_rule.resolve(req.user, headers)
        defaults = self.info.request_defaults
        try:
            return [make_request(ids, params, defaults=defaults, request_id=f"{api_id}-{i}", priority=req.priority,
                                 cache_salt=req.cache_salt, pooling=pooling, tenant=tenant,
                                 slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms, lora_request=lora)
                    for i, ids in enumerate(prompts)]
        except ValueError as e:
            raise bad_request(str(e)) from None

    def submit(self, api_id: str, inputs: list[EngineRequest]) -> Submission:
        try:
            return self.aengine.submit(api_id, inputs)
        except QueueFullError as e:  # Retry-After: about when a queue of this length has moved on
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise engine_error(e) from None

    def token_str(self, token_id: int) -> str:
        strs = self.ctx.token_strs
        s = strs.get(token_id)
        if s is None:
            s = strs[token_id] = self.tokenizer.decode([token_id])
        return s

    async def collect(self, sub: Submission, request: Request) -> list[RequestOutput] | None:
        """Run `sub` to the end: one `RequestOutput` per input, in order (built from the deltas by the
        same `RequestOutputBuilder` that `LLM.generate` uses); None if the client left first (then it
        is aborted). A sequence the engine never finished comes back with finish_reason "abort"."""

        errors: list[str] = []

        async def run() -> list[RequestOutput]:
            builders = {inp.request_id: RequestOutputBuilder(inp.request_id, inp.params.n, None,
                                                             inp.prompt_token_ids, logprobs=True)
                        for inp in sub.inputs}
            async for d in sub:
                if d.error:
                    errors.append(d.error)
                builders[d.group_id].add(d)
            outs = [b.build() for b in builders.values()]
            for o, b in zip(outs, builders.values()):
                o.num_cached_tokens = b.num_cached_tokens
                for c in o.outputs:
                    c.finish_reason = c.finish_reason or FinishReason.ABORT
            return outs

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=self._time_left(sub))
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            sub.close()  # aborts whatever is unfinished: its blocks are freed
        if not done:
            raise self.timeout_error()
        if work not in done:
            return None
        try:
            outs = work.result()
        except EngineDeadError as e:
            raise engine_error(e) from None
        if errors:  # a failure tied to this request alone (the engine goes on): OpenAI's 500
            raise ApiError(500, f"the request failed in the engine: {errors[0]}", "internal_error",
                           code="request_failed")
        return outs

    def _time_left(self, sub: Submission) -> float | None:
        timeout = self.options.request_timeout
        if timeout is None:
            return None
        return max(timeout - (time.monotonic() - sub.arrival), 0.0)

    def timeout_error(self) -> ApiError:
        return ApiError(408, f"the request did not finish within --request-timeout "
                             f"({self.options.request_timeout:g} s); it was aborted", "timeout_error",
                        code="request_timeout")

    async def deltas(self, sub: Submission) -> AsyncIterator:
        """`sub`'s deltas, until the request's deadline (--request-timeout): then TimeoutError."""
        it = sub.__aiter__()
        while True:
            try:
                yield await asyncio.wait_for(it.__anext__(), self._time_left(sub))
            except StopAsyncIteration:
                return
