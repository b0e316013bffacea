"""/v1/completions: OpenAI's text completions (with vLLM's extras) on the shared serving base."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import Response

from conveyor.outputs import StepDelta
from conveyor.server import protocol as P
from conveyor.server.async_engine import Submission
from conveyor.server.http import bad_request
from conveyor.server.serving import OpenAIServing, finite, parse_model, refuse_unsupported, usage_info
from conveyor.server.streaming import SSEResponse, StreamCounts, StreamFormat, sse_event, stream_events


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, data: dict, request: Request) -> Response:
        req = parse_model(P.CompletionRequest, data)
        refuse_unsupported(data)
        self.check_model(req.model)
        prompts = await self._prompts(req.prompt)
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
        inputs = self.engine_requests(api_id, [ids for _, ids in prompts], params, req, request.headers,
                                      lora=self.lora_for(req.model))
        sub = self.submit(api_id, inputs)
        model = req.model or self.model_names[0]
        echo = [(text if text is not None else self.tokenizer.decode(ids)) if req.echo else None
                for text, ids in prompts]
        if req.stream:
            fmt = CompletionStream(self, sub, req, model, prompts, echo)
            return SSEResponse(stream_events(sub, self.deltas(sub), fmt, lambda: self.timeout_error().body()),
                               sub.close)
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
                    lp = self.logprobs(ids if req.echo else [], c.token_ids, c.logprobs,
                                       len(echo[i]) if req.echo else 0, out[i].prompt_logprobs)
                choices.append(P.CompletionChoice(
                    index=i * req.n + j, text=(echo[i] or "") + text, logprobs=lp, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self.vllm_prompt_logprobs(out[i].prompt_logprobs)
                    if req.prompt_logprobs is not None else None))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        usage = usage_info(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in out))
        body = P.CompletionResponse(id=api_id, model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
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

    def vllm_prompt_logprobs(self, entries: list | None) -> list | None:
        if entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": finite(v), "decoded_token": self.token_str(t)}
                                        for t, v in e.items()} for e in entries]

    def logprobs(self, prompt_ids: list[int], token_ids: list[int], entries: list[dict[int, float]],
                 offset0: int, prompt_entries: list | None = None) -> P.CompletionLogprobs:
        lp = P.CompletionLogprobs()
        offset = 0
        for i, t in enumerate(prompt_ids):  # echoed prompt: the first token has no logprob
            s = self.token_str(t)
            e = prompt_entries[i] if prompt_entries is not None and i < len(prompt_entries) else None
            lp.tokens.append(s)
            lp.token_logprobs.append(None if e is None else finite(e.get(t, -math.inf)))
            lp.top_logprobs.append(None if e is None else {self.token_str(k): finite(v) for k, v in e.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        offset = offset0
        for t, e in zip(token_ids, entries):
            s = self.token_str(t)
            lp.tokens.append(s)
            lp.token_logprobs.append(finite(e.get(t, -math.inf)))
            lp.top_logprobs.append({self.token_str(k): finite(v) for k, v in e.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp


class CompletionStream(StreamFormat):
    """A completion's chunks: the echoed prompts first, then a chunk per delta that has something to say."""

    def __init__(self, serving: OpenAIServingCompletion, sub: Submission, req: P.CompletionRequest, model: str,
                 prompts: list[tuple[str | None, list[int]]], echo: list[str | None]) -> None:
        self.serving, self.sub, self.req, self.model, self.prompts, self.echo = serving, sub, req, model, prompts, echo
        self.created = int(time.time())
        self.index_of = {inp.request_id: i for i, inp in enumerate(sub.inputs)}
        self.offsets: dict[str, int] = {}

    def _chunk(self, choice: P.CompletionChoice) -> str:
        return sse_event(P.CompletionChunk(id=self.sub.api_id, created=self.created, model=self.model,
                                           choices=[choice]))

    def start(self) -> Iterable[str]:
        req = self.req
        if req.echo:
            for i in range(len(self.prompts)):
                for j in range(req.n):
                    yield self._chunk(P.CompletionChoice(index=i * req.n + j, text=self.echo[i]))

    def delta(self, d: StepDelta) -> Iterable[str]:
        req = self.req
        prompt_lps = d.prompt_logprobs  # with each sequence's first token (vLLM)
        if not d.new_text and not d.finished and req.logprobs is None and prompt_lps is None:
            return
        lp = None
        if req.logprobs is not None and d.new_logprobs:
            off = self.offsets.get(d.request_id, len(self.echo[self.index_of[d.group_id]] or ""))
            lp = self.serving.logprobs([], d.new_token_ids, d.new_logprobs, off)
            self.offsets[d.request_id] = off + sum(len(s) for s in lp.tokens)
        index = self.index_of[d.group_id] * req.n + d.index
        yield self._chunk(P.CompletionChoice(index=index, text=d.new_text, logprobs=lp, finish_reason=d.finish_reason,
                                             stop_reason=d.stop_reason,
                                             prompt_logprobs=self.serving.vllm_prompt_logprobs(prompt_lps)))

    def finish(self, counts: StreamCounts) -> Iterable[str]:
        if self.req.stream_options and self.req.stream_options.include_usage:
            usage = usage_info(sum(len(ids) for _, ids in self.prompts), counts.completion_tokens,
                               counts.cached_tokens)
            yield sse_event(P.CompletionChunk(id=self.sub.api_id, created=self.created, model=self.model, choices=[],
                                              usage=usage))
