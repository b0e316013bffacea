"""OpenAI completions and chat on top of `AsyncEngine`: request -> engine inputs -> response or SSE.

Everything here runs on the event loop and is cheap per token; the only heavy parts (tokenizing
a long prompt) go to a worker thread. All validation happens before `submit`, so an input either
gets a 4xx here or is known-good for the engine.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.engine.llm_engine import validate_prompt
from conveyor.engine.output_processor import RequestOutputBuilder
from conveyor.lora.request import LoRARequest
from conveyor.outputs import FinishReason, RequestOutput
from conveyor.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from conveyor.server import protocol as P
from conveyor.server import tools as T
from conveyor.server.async_engine import (
    AddRequest,
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    Submission,
    engine_answer,
)
from conveyor.server.tenancy import TenantRule, slo_seconds

_TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "tagged-union"}


class ApiError(Exception):
    """An error that becomes OpenAI's {"error": {...}} body with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return P.error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_error(e: EngineDeadError) -> ApiError:
    """The answer to a call the engine cannot serve: 503 engine_dead, 503 loading or draining (with
    Retry-After) while it restarts or the server drains, 500 engine_restarted if it died under the call."""
    status, type_, code, headers = engine_answer(e)
    return ApiError(status, str(e), type_, code=code, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# Fields OpenAI or vLLM define that this server does not implement yet: refused with a 400 naming the
# field rather than silently ignored (a client relying on them would get output that ignores them).
_UNSUPPORTED = ("functions", "suffix")
_CHAT_ONLY = ("tools", "tool_choice")  # served by /v1/chat/completions (conveyor/server/tools.py)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> P.UsageInfo:
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


def _finite(x: float) -> float:
    """JSON has no -inf: report impossible tokens as -9999 (as vLLM does)."""
    return x if math.isfinite(x) else -9999.0


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client leaving, and always runs `on_close`.

    Starlette only listens for disconnects on ASGI < 2.4; this does it on every server, and runs
    `on_close` even if the body iterator was cancelled before it started, so no request is leaked.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


# SSE breaks lines only at CR and LF, but many clients split a stream with str.splitlines() (httpx's
# aiter_lines among them), which also breaks at U+0085, U+2028 and U+2029: a token holding one of them
# cut its chunk in two. JSON may escape any character, so these three are always sent escaped.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(obj: BaseModel | dict) -> str:
    body = obj.model_dump_json(exclude_unset=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {body.translate(_UNICODE_LINE_BREAKS)}\n\n"


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, model_names: list[str], request_timeout: float | None = None) -> None:
        self.aengine = aengine
        self.request_timeout = request_timeout  # seconds from arrival; then the request is aborted (408)
        self.info = aengine.info
        self.model_names = model_names
        self.loras: dict[str, LoRARequest] = {}  # adapter name -> adapter (conveyor/server/lora.py fills it)
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
        self._token_strs: dict[int, str] = {}
        self.chat_template: str | None = None  # --chat-template (None: the tokenizer's own)
        self.tool_parser = None  # --tool-call-parser, for tool_choice="auto" (conveyor/server/tool_parsers.py)
        self.pooling: str | None = None  # /v1/embeddings pooling (--pooling; None: last token)
        self.tenant_rule = TenantRule()  # --tenant-key

    def request_fields(self, req: P.CompletionRequest | P.ChatCompletionRequest, request: Request) -> dict:
        """The strategy-neutral fields of an engine request that come from the HTTP request: its tenant
        (see `tenancy.py`) and its latency targets."""
        return dict(tenant=self.tenant_rule.resolve(req.user, request.headers),
                    slo_ttft_s=slo_seconds(req.slo_ttft_ms), slo_tpot_s=slo_seconds(req.slo_tpot_ms))

    # --- shared validation ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and name not in self.loras:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), counted per adapter in /metrics."""
        lora = self.loras.get(name) if name is not None and name not in self.model_names else None
        if lora is not None and self.aengine.metrics is not None:
            self.aengine.metrics.lora_requests.labels(self.model_names[0], lora.lora_name).inc()
        return lora

    async def tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"{param} is {len(text)} characters long, more than can fit in this model's maximum "
                              f"context length of {self.max_model_len} tokens", param)

        def enc() -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        return await asyncio.to_thread(enc) if len(text) > _TOKENIZE_IN_THREAD_CHARS else enc()

    def sampling_params(self, req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        ids = req.stop_token_ids or []
        if any(t >= self.vocab_size for t in ids):
            raise bad_request(f"stop_token_ids must be below the vocabulary size ({self.vocab_size})",
                              "stop_token_ids")
        defaults = self.info.default_sampling  # the model's recommendation where the request is silent

        def pick(value, name: str, fallback):
            return value if value is not None else defaults.get(name, fallback)

        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        try:
            params = SamplingParams(
                n=req.n, temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0), top_k=pick(req.top_k, "top_k", 0) or 0,
                min_p=pick(req.min_p, "min_p", 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
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

    def submit(self, api_id: str, inputs: list[AddRequest]) -> Submission:
        try:
            return self.aengine.submit(api_id, inputs)
        except QueueFullError as e:  # Retry-After: about when a queue of this length has moved on
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise engine_error(e) from None

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id])
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
        if self.request_timeout is None:
            return None
        return max(self.request_timeout - (time.monotonic() - sub.arrival), 0.0)

    def timeout_error(self) -> ApiError:
        return ApiError(408, f"the request did not finish within --request-timeout ({self.request_timeout:g} s); "
                             "it was aborted", "timeout_error", code="request_timeout")

    async def deltas(self, sub: Submission) -> AsyncIterator:
        """`sub`'s deltas, until the request's deadline (--request-timeout): then TimeoutError."""
        it = sub.__aiter__()
        while True:
            try:
                yield await asyncio.wait_for(it.__anext__(), self._time_left(sub))
            except StopAsyncIteration:
                return

    @staticmethod
    def _request_error_event(message: str) -> str:
        body = P.error_body(f"the request failed in the engine: {message}", "internal_error", code="request_failed")
        return f"data: {json.dumps(body)}\n\n"

    @staticmethod
    def _error_event(e: BaseException) -> str:
        if isinstance(e, EngineDeadError):
            body = engine_error(e).body()
        else:
            body = P.error_body(f"internal error: {e!r}", "internal_error", code="internal_error")
        return f"data: {json.dumps(body)}\n\n"

    # --- /v1/completions ------------------------------------------------------------------------------
    async def completions(self, data: dict, request: Request) -> Response:
        req = parse_model(P.CompletionRequest, data)
        refuse_unsupported(data)
        self.check_model(req.model)
        prompts = await self._completion_prompts(req.prompt)
        if "max_tokens" in req.model_fields_set:
            max_tokens = req.max_tokens
        else:
            max_tokens = 16
        # prompt logprobs: asked for (vLLM's prompt_logprobs), or what `echo` with `logprobs` shows (non-streaming)
        plp = req.prompt_logprobs
        if plp is None and req.echo and req.logprobs is not None and not req.stream:
            plp = req.logprobs
        params = self.sampling_params(req, max_tokens, req.logprobs, plp, await self.structured_outputs(req))
        for _, ids in prompts:
            self.check_prompt(ids, params, "prompt")
        api_id = f"cmpl-{uuid.uuid4().hex}"
        extra = self.request_fields(req, request)
        lora = self.lora_for(req.model)
        inputs = [AddRequest(f"{api_id}-{i}", ids, params, req.priority, req.cache_salt, lora_request=lora, **extra)
                  for i, (_, ids) in enumerate(prompts)]
        sub = self.submit(api_id, inputs)
        model = req.model or self.model_names[0]
        echo = [(text if text is not None else self.tokenizer.decode(ids)) if req.echo else None
                for text, ids in prompts]
        if req.stream:
            gen = self._completion_stream(sub, req, model, prompts, echo)
            return SSEResponse(gen, sub.close)
        out = await self.collect(sub, request)
        if out is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for i, (_, ids) in enumerate(prompts):
            for j, c in enumerate(out[i].outputs):
                completion_tokens += len(c.token_ids)
                text = c.text
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(ids if req.echo else [], c.token_ids, c.logprobs,
                                                   len(echo[i]) if req.echo else 0, out[i].prompt_logprobs)
                choices.append(P.CompletionChoice(
                    index=i * req.n + j, text=(echo[i] or "") + text, logprobs=lp, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(out[i].prompt_logprobs)
                    if req.prompt_logprobs is not None else None))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        usage = _usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in out))
        body = P.CompletionResponse(id=api_id, model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if len(prompt) > 256:
            raise bad_request("prompt may hold at most 256 prompts", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty", "prompt")
                out.append((p, await self.tokenize(p, True, "prompt")))
            else:
                out.append((None, list(p)))
        return out

    def _vllm_prompt_logprobs(self, entries: list | None) -> list | None:
        if entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": _finite(v), "decoded_token": self.token_str(t)}
                                        for t, v in e.items()} for e in entries]

    def _completion_logprobs(self, prompt_ids: list[int], token_ids: list[int], entries: list[dict[int, float]],
                             offset0: int, prompt_entries: list | None = None) -> P.CompletionLogprobs:
        lp = P.CompletionLogprobs()
        offset = 0
        for i, t in enumerate(prompt_ids):  # echoed prompt: the first token has no logprob
            s = self.token_str(t)
            e = prompt_entries[i] if prompt_entries is not None and i < len(prompt_entries) else None
            lp.tokens.append(s)
            lp.token_logprobs.append(None if e is None else _finite(e.get(t, -math.inf)))
            lp.top_logprobs.append(None if e is None else {self.token_str(k): _finite(v) for k, v in e.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        offset = offset0
        for t, e in zip(token_ids, entries):
            s = self.token_str(t)
            lp.tokens.append(s)
            lp.token_logprobs.append(_finite(e.get(t, -math.inf)))
            lp.top_logprobs.append({self.token_str(k): _finite(v) for k, v in e.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    async def _completion_stream(self, sub: Submission, req: P.CompletionRequest, model: str,
                                 prompts: list[tuple[str | None, list[int]]], echo: list[str | None]
                                 ) -> AsyncIterator[str]:
        created = int(time.time())
        index_of = {inp.request_id: i for i, inp in enumerate(sub.inputs)}
        offsets: dict[str, int] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = cached = 0

        def chunk(choice: P.CompletionChoice) -> str:
            c = P.CompletionChunk(id=sub.api_id, created=created, model=model, choices=[choice])
            return sse_event(c)

        try:
            if req.echo:
                for i in range(len(prompts)):
                    for j in range(req.n):
                        yield chunk(P.CompletionChoice(index=i * req.n + j, text=echo[i]))
            async for d in self.deltas(sub):
                if d.error:  # this request failed alone: say so in-band and end the stream
                    yield self._request_error_event(d.error)
                    break
                completion_tokens += len(d.new_token_ids)
                if d.finished and d.index == 0:
                    cached += d.num_cached_tokens
                prompt_lps = d.prompt_logprobs  # with each sequence's first token (vLLM)
                if not d.new_text and not d.finished and req.logprobs is None and prompt_lps is None:
                    continue
                lp = None
                if req.logprobs is not None and d.new_logprobs:
                    off = offsets.get(d.request_id, len(echo[index_of[d.group_id]] or ""))
                    lp = self._completion_logprobs([], d.new_token_ids, d.new_logprobs, off)
                    offsets[d.request_id] = off + sum(len(s) for s in lp.tokens)
                index = index_of[d.group_id] * req.n + d.index
                yield chunk(P.CompletionChoice(index=index, text=d.new_text, logprobs=lp,
                                               finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                               prompt_logprobs=self._vllm_prompt_logprobs(prompt_lps)))
            if include_usage:
                usage = _usage(sum(len(ids) for _, ids in prompts), completion_tokens, cached)
                yield sse_event(P.CompletionChunk(id=sub.api_id, created=created, model=model, choices=[], usage=usage))
        except (TimeoutError, asyncio.TimeoutError):  # --request-timeout: abort (finally) and say so in-band
            yield f"data: {json.dumps(self.timeout_error().body())}\n\n"
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield self._error_event(e)
        finally:
            sub.close()
        yield "data: [DONE]\n\n"

    # --- /v1/chat/completions -------------------------------------------------------------------------
    async def chat(self, data: dict, request: Request) -> Response:
        req = parse_model(P.ChatCompletionRequest, data)
        refuse_unsupported(data, chat=True)
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        plan = await self._tool_plan(req)
        ids = await self._render_chat(req, plan.template_tools())
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(ids), 1)
        structured = await self.structured_outputs(req)
        if plan.structured is not None:
            if structured is not None:
                raise bad_request(f"tool_choice {plan.mode} constrains the output itself: drop the other output "
                                  "constraint", "tool_choice")
            structured = plan.structured
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      structured=structured)
        self.check_prompt(ids, params, "messages")
        api_id = f"chatcmpl-{uuid.uuid4().hex}"
        sub = self.submit(api_id, [AddRequest(f"{api_id}-0", ids, params, req.priority, req.cache_salt,
                                               lora_request=self.lora_for(req.model),
                                               **self.request_fields(req, request))])
        model = req.model or self.model_names[0]
        if req.stream:
            return SSEResponse(self._chat_stream(sub, req, model, len(ids), plan), sub.close)
        out = await self.collect(sub, request)
        if out is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for j, c in enumerate(out[0].outputs):
            completion_tokens += len(c.token_ids)
            lp = self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            message, reason = P.ChatResponseMessage(content=c.text), c.finish_reason
            if plan.active:
                content, calls = plan.extract(c.text)
                message = P.ChatResponseMessage(content=content, tool_calls=T.response_calls(calls))
                reason = self._tool_finish(plan, reason, len(calls))
            choices.append(P.ChatChoice(index=j, message=message, logprobs=lp,
                                        finish_reason=reason, stop_reason=c.stop_reason))
        usage = _usage(len(ids), completion_tokens, out[0].num_cached_tokens)
        body = P.ChatCompletionResponse(id=api_id, model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def embeddings(self, data: dict, request: Request) -> Response:
        """/v1/embeddings (conveyor/server/embeddings.py)."""
        from conveyor.server.embeddings import create_embeddings

        return await create_embeddings(self, data, request)

    async def tokenize_endpoint(self, data: dict) -> Response:
        """vLLM's POST /tokenize: {"count", "max_model_len", "tokens"}."""
        req = parse_model(P.TokenizeRequest, data)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            chat = P.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools)
            ids = await self._render_chat(chat, T.ToolPlan("none", req.tools or []).template_tools())
        else:
            if len(req.prompt) > self.max_prompt_chars:
                raise bad_request("prompt is longer than this model's context could hold", "prompt")
            ids = await self.tokenize(req.prompt, req.add_special_tokens, "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize_endpoint(self, data: dict) -> Response:
        """vLLM's POST /detokenize: {"prompt": text}."""
        req = parse_model(P.DetokenizeRequest, data)
        self.check_model(req.model)
        if any(t >= self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be below the vocabulary size ({self.vocab_size})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    async def _tool_plan(self, req: P.ChatCompletionRequest) -> T.ToolPlan:
        """How tools shape this request (checks its schemas off the event loop: milliseconds each)."""
        try:
            if not req.tools:
                return T.plan_tools(req, self.tool_parser)
            return await asyncio.to_thread(T.plan_tools, req, self.tool_parser)
        except T.ToolError as e:
            raise bad_request(str(e), e.param) from None

    def _tool_finish(self, plan: T.ToolPlan, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's "tool_calls" for a choice that ended by itself with calls (counted in /metrics)."""
        if not num_calls:
            return reason
        metrics = self.aengine.metrics
        if metrics is not None:
            metrics.observe_tool_calls(plan.mode, num_calls)
        return "tool_calls" if reason == "stop" else reason

    async def _render_chat(self, req: P.ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            conv = T.template_messages(req.messages)
        except T.ToolError as e:
            raise bad_request(str(e), e.param) from None
        total = sum(len(m["content"]) for m in conv)
        if total > self.max_prompt_chars:
            raise bad_request(f"messages hold {total} characters, more than can fit in this model's maximum "
                              f"context length of {self.max_model_len} tokens", "messages")
        kw = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, tools=tools,
                                                      add_generation_prompt=req.add_generation_prompt, **kw)
        except Exception as e:  # the template may reject a role order or a role it does not know
            raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        return await self.tokenize(text, False, "messages")

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top: int) -> P.ChatLogprobs:
        content = []
        for t, e in zip(token_ids, entries):
            s = self.token_str(t)
            best = sorted(e.items(), key=lambda kv: -kv[1])[:top]
            content.append(P.ChatTokenLogprob(
                token=s, logprob=_finite(e.get(t, -math.inf)), bytes=list(s.encode()),
                top_logprobs=[P.TopLogprob(token=self.token_str(k), logprob=_finite(v),
                                           bytes=list(self.token_str(k).encode())) for k, v in best]))
        return P.ChatLogprobs(content=content)

    async def _chat_stream(self, sub: Submission, req: P.ChatCompletionRequest, model: str,
                           num_prompt: int, plan: T.ToolPlan | None = None) -> AsyncIterator[str]:
        created = int(time.time())
        tool_streams = {j: plan.stream() for j in range(req.n)} if plan is not None and plan.active else {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = cached = 0

        def chunk(choice: P.ChatStreamChoice) -> str:
            return sse_event(P.ChatCompletionChunk(id=sub.api_id, created=created, model=model, choices=[choice]))

        try:
            for j in range(req.n):
                yield chunk(P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role="assistant", content="")))
            async for d in self.deltas(sub):
                if d.error:  # this request failed alone: say so in-band and end the stream
                    yield self._request_error_event(d.error)
                    break
                completion_tokens += len(d.new_token_ids)
                if d.finished and d.index == 0:
                    cached += d.num_cached_tokens
                if not d.new_text and not d.finished and not req.logprobs:
                    continue
                lp = None
                if req.logprobs and d.new_logprobs:
                    lp = self._chat_logprobs(d.new_token_ids, d.new_logprobs, req.top_logprobs or 0)
                delta = P.DeltaMessage(content=d.new_text) if d.new_text or not d.finished else P.DeltaMessage()
                reason = d.finish_reason
                ts = tool_streams.get(d.index)
                if ts is not None:  # tool calls: the parser decides what is content and what is a call
                    ev = ts.feed(d.new_text)
                    if d.finished:
                        ev += ts.finish()
                        reason = self._tool_finish(plan, reason, len(ts.calls))
                    if not ev.content and not ev.calls and not d.finished and lp is None:
                        continue
                    delta = P.DeltaMessage(content=ev.content or None, tool_calls=[
                        P.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                        function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                        for c in ev.calls] or None)
                yield chunk(P.ChatStreamChoice(index=d.index, delta=delta, logprobs=lp,
                                               finish_reason=reason, stop_reason=d.stop_reason))
            if include_usage:
                usage = _usage(num_prompt, completion_tokens, cached)
                yield sse_event(P.ChatCompletionChunk(id=sub.api_id, created=created, model=model, choices=[],
                                                 usage=usage))
        except (TimeoutError, asyncio.TimeoutError):
            yield f"data: {json.dumps(self.timeout_error().body())}\n\n"
        except Exception as e:
            yield self._error_event(e)
        finally:
            sub.close()
        yield "data: [DONE]\n\n"
