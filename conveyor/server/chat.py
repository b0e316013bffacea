"""/v1/chat/completions: OpenAI's chat (tools, structured outputs, vLLM's extras) on the shared serving base."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import Response

from conveyor.outputs import StepDelta
from conveyor.server import protocol as P
from conveyor.server import tools as T
from conveyor.server.async_engine import Submission
from conveyor.server.http import bad_request
from conveyor.server.serving import OpenAIServing, finite, parse_model, refuse_unsupported, usage_info
from conveyor.server.streaming import SSEResponse, StreamCounts, StreamFormat, sse_event, stream_events


class OpenAIServingChat(OpenAIServing):
    async def create(self, data: dict, request: Request) -> Response:
        req = parse_model(P.ChatCompletionRequest, data)
        refuse_unsupported(data, chat=True)
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        plan = await self._tool_plan(req)
        ids = await self.render_chat(req, plan.template_tools())
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
        sub = self.submit(api_id, self.engine_requests(api_id, [ids], params, req, request.headers,
                                                       lora=self.lora_for(req.model)))
        model = req.model or self.model_names[0]
        if req.stream:
            fmt = ChatStream(self, sub, req, model, len(ids), plan)
            return SSEResponse(stream_events(sub, self.deltas(sub), fmt, lambda: self.timeout_error().body()),
                               sub.close)
        out = await self.collect(sub, request)
        if out is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for j, c in enumerate(out[0].outputs):
            completion_tokens += len(c.token_ids)
            lp = self.logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            message, reason = P.ChatResponseMessage(content=c.text), c.finish_reason
            if plan.active:
                content, calls = plan.extract(c.text)
                message = P.ChatResponseMessage(content=content, tool_calls=T.response_calls(calls))
                reason = self.tool_finish(plan, reason, len(calls))
            choices.append(P.ChatChoice(index=j, message=message, logprobs=lp,
                                        finish_reason=reason, stop_reason=c.stop_reason))
        usage = usage_info(len(ids), completion_tokens, out[0].num_cached_tokens)
        body = P.ChatCompletionResponse(id=api_id, model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _tool_plan(self, req: P.ChatCompletionRequest) -> T.ToolPlan:
        """How tools shape this request (checks its schemas off the event loop: milliseconds each)."""
        parser = self.options.tool_parser
        try:
            if not req.tools:
                return T.plan_tools(req, parser)
            return await asyncio.to_thread(T.plan_tools, req, parser)
        except T.ToolError as e:
            raise bad_request(str(e), e.param) from None

    def tool_finish(self, plan: T.ToolPlan, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's "tool_calls" for a choice that ended by itself with calls (counted in /metrics)."""
        if not num_calls:
            return reason
        metrics = self.aengine.metrics
        if metrics is not None:
            metrics.observe_tool_calls(plan.mode, num_calls)
        return "tool_calls" if reason == "stop" else reason

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top: int) -> P.ChatLogprobs:
        content = []
        for t, e in zip(token_ids, entries):
            s = self.token_str(t)
            best = sorted(e.items(), key=lambda kv: -kv[1])[:top]
            content.append(P.ChatTokenLogprob(
                token=s, logprob=finite(e.get(t, -math.inf)), bytes=list(s.encode()),
                top_logprobs=[P.TopLogprob(token=self.token_str(k), logprob=finite(v),
                                           bytes=list(self.token_str(k).encode())) for k, v in best]))
        return P.ChatLogprobs(content=content)


class ChatStream(StreamFormat):
    """A chat's chunks: each choice's role first, then content deltas (or tool-call deltas, when the
    request's tools are parsed from the text as it comes)."""

    def __init__(self, serving: OpenAIServingChat, sub: Submission, req: P.ChatCompletionRequest, model: str,
                 num_prompt: int, plan: T.ToolPlan) -> None:
        self.serving, self.sub, self.req, self.model, self.num_prompt, self.plan = \
            serving, sub, req, model, num_prompt, plan
        self.created = int(time.time())
        self.tool_streams = {j: plan.stream() for j in range(req.n)} if plan.active else {}

    def _chunk(self, choice: P.ChatStreamChoice) -> str:
        return sse_event(P.ChatCompletionChunk(id=self.sub.api_id, created=self.created, model=self.model,
                                               choices=[choice]))

    def start(self) -> Iterable[str]:
        for j in range(self.req.n):
            yield self._chunk(P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role="assistant", content="")))

    def delta(self, d: StepDelta) -> Iterable[str]:
        req = self.req
        if not d.new_text and not d.finished and not req.logprobs:
            return
        lp = None
        if req.logprobs and d.new_logprobs:
            lp = self.serving.logprobs(d.new_token_ids, d.new_logprobs, req.top_logprobs or 0)
        delta = P.DeltaMessage(content=d.new_text) if d.new_text or not d.finished else P.DeltaMessage()
        reason = d.finish_reason
        ts = self.tool_streams.get(d.index)
        if ts is not None:  # tool calls: the parser decides what is content and what is a call
            ev = ts.feed(d.new_text)
            if d.finished:
                ev += ts.finish()
                reason = self.serving.tool_finish(self.plan, reason, len(ts.calls))
            if not ev.content and not ev.calls and not d.finished and lp is None:
                return
            delta = P.DeltaMessage(content=ev.content or None, tool_calls=[
                P.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                for c in ev.calls] or None)
        yield self._chunk(P.ChatStreamChoice(index=d.index, delta=delta, logprobs=lp, finish_reason=reason,
                                             stop_reason=d.stop_reason))

    def finish(self, counts: StreamCounts) -> Iterable[str]:
        if self.req.stream_options and self.req.stream_options.include_usage:
            usage = usage_info(self.num_prompt, counts.completion_tokens, counts.cached_tokens)
            yield sse_event(P.ChatCompletionChunk(id=self.sub.api_id, created=self.created, model=self.model,
                                                  choices=[], usage=usage))
