"""/v1/responses: OpenAI's Responses API on the chat path, with conversations kept in a store.

A Responses request is a chat request in another shape, and is served as one: its items (messages,
earlier function calls and their outputs), `instructions`, function tools, `tool_choice` and
`text.format` become a `ChatCompletionRequest`, which the chat endpoint prepares as it prepares its own
(`OpenAIServingChat.prepare`: the chat template, the tools and their grammar constraints, structured
outputs, sampling, the prompt checks). What differs is around it:
- **items out**: the model's text becomes output items (`OutputBuilder`: a `message` with `output_text`,
  a `function_call` per call, read by the same tool-call streams as chat's), whole or as the stream's
  events (`ResponsesStream`, on the shared streaming skeleton, each event with its `sequence_number`);
- **state**: with `store` (the default, as OpenAI's) the answer is kept (`responses_store.py`) with the
  conversation that led to it, so `previous_response_id` continues it without resending it. The
  continuation reuses the previous turn's prompt and answer *tokens* when its rendered prompt starts with
  their text, so its prompt begins with exactly the tokens the prefix cache holds;
- **errors** name the Responses fields (`input`, `max_output_tokens`, `tools[i].parameters`), and what
  conveyor does not serve (built-in tools, other item types, images) is a 400 naming it.

The terminal stream event is `response.completed` also for an answer cut by `max_output_tokens` (its
`status` is then `incomplete`, with `incomplete_details.reason`), as vLLM sends it: the `openai` SDK's
`client.responses.stream(...)` helper only returns a final response after `response.completed`.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.outputs import StepDelta
from conveyor.sampling_params import SamplingParams
from conveyor.server import protocol as P
from conveyor.server import responses_protocol as R
from conveyor.server import tools as T
from conveyor.server.async_engine import Submission
from conveyor.server.chat import OpenAIServingChat
from conveyor.server.http import ApiError, bad_request, bearer_token
from conveyor.server.responses_store import ResponseStore, StoredResponse, owner_key
from conveyor.server.serving import OpenAIServing, parse_model
from conveyor.server.streaming import SSEResponse, StreamCounts, StreamFormat, sse_event, stream_events

# chat's names for what the Responses API calls otherwise (in a 400's `param` and message)
_PARAM_NAMES = [(re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."), (re.compile(r"\bmessages\b"), "input"),
                (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
                (re.compile(r"\bresponse_format\b"), "text.format")]
_ITEM_PATH = re.compile(r"\.(\d+)(?:\.(?:message|function_call|function_call_output)\b)?")
_PASSED_THROUGH = ("user", "priority", "cache_salt", "slo_ttft_ms", "slo_tpot_ms", "temperature", "top_p", "seed",
                   "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "parallel_tool_calls")


def _responses_names(text: str | None) -> str | None:
    if text is None:
        return None
    for pattern, repl in _PARAM_NAMES:
        text = pattern.sub(repl, text)
    return text


def _renamed(e: ApiError) -> ApiError:
    """A chat-path error, in the Responses API's field names."""
    e.message, e.param = _responses_names(e.message), _responses_names(e.param)
    e.args = (e.message,)
    return e


# --- items in ---------------------------------------------------------------------------------------
def stored_items(req: R.ResponsesRequest) -> list[dict]:
    """The request's input as items in OpenAI's stored shape (each with an id), as `input_items` lists them."""
    out = []
    for item in req.input:
        if isinstance(item, R.MessageItem):
            part = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": part, "text": item.text()}]
            if item.role == "assistant":
                content[0]["annotations"] = []
            out.append({"id": item.id or R.new_id("msg"), "type": "message", "role": item.role,
                        "status": "completed", "content": content})
        elif isinstance(item, R.FunctionCallItem):
            out.append(R.function_call_item(item.id or R.new_id("fc"), item.call_id, item.name, item.arguments))
        else:
            out.append({"id": item.id or R.new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
    return out


def _item_text(item: dict) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in item.get("content") or [])


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """A conversation of stored items as chat messages: an assistant's function calls join its message (or
    make one), a call's output is a `tool` message with the call's id; developer messages are system
    messages (chat templates know that role)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _item_text(item)})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(req: R.ResponsesRequest, messages: list[dict]) -> dict:
    """The chat request a Responses request amounts to (a dict, checked by `ChatCompletionRequest`)."""
    chat: dict = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens}
    chat.update({k: getattr(req, k) for k in _PASSED_THROUGH})
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
        if req.tool_choice is not None:
            choice = req.tool_choice
            chat["tool_choice"] = choice if isinstance(choice, str) else \
                {"type": "function", "function": {"name": choice.name}}
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    fmt = req.text.format if req.text else None
    if req.tools and req.tool_choice not in (None, "none", "auto"):
        fmt = None  # the answer is a forced call, with no text for text.format to shape (as OpenAI does)
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    return {k: v for k, v in chat.items() if v is not None}


# --- items out --------------------------------------------------------------------------------------
Event = tuple[str, dict]  # (event type, its fields but type and sequence_number)


class OutputBuilder:
    """The model's text as output items, and the stream events that build them: text goes into a `message`
    with one `output_text` part, each tool call (read by the plan's tool-call stream, as on chat) into a
    `function_call` item. The whole answer at once is this fed one piece (so streamed and whole answers
    agree by construction). An item cut by max_output_tokens, or a call whose arguments do not parse,
    ends with status `incomplete`."""

    def __init__(self, plan: T.ToolPlan) -> None:
        self.plan = plan
        self.tools = plan.stream() if plan.active else None
        self.items: list[dict] = []
        self.open: dict | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        if self.tools is None:
            return self._text(text) if text else []
        return self._events(self.tools.feed(text))

    def finish(self, reason: str | None) -> list[Event]:
        """The answer ended (`reason`: the engine's finish reason): close what is open."""
        events = self._events(self.tools.finish()) if self.tools is not None else []
        if not self.items:  # an empty answer is still a message
            events += self._text("")
        events += self._close(cut=reason != "stop")
        return events

    def _events(self, ev) -> list[Event]:
        out = self._text(ev.content) if ev.content else []
        for c in ev.calls:
            if c.id is not None:  # a new call: its id and name first
                out += self._close()
                item = R.function_call_item(R.new_id("fc"), c.id, c.name, "", "in_progress")
                out += self._add(item)
                self.num_calls += 1
            if c.arguments and self.open is not None:
                self.open["arguments"] += c.arguments
                out.append(("response.function_call_arguments.delta", {**self._where(), "delta": c.arguments}))
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict) -> list[Event]:
        self.items.append(item)
        self.open = item
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _text(self, text: str) -> list[Event]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            out += self._add(R.message_item(R.new_id("msg"), None, "in_progress"))
            self.open["content"].append(R.output_text_part())
            out.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                        "part": R.output_text_part()}))
        self.open["content"][0]["text"] += text
        if text:
            out.append(("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                       "logprobs": []}))
        return out

    def _close(self, cut: bool = False) -> list[Event]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        self.open = None
        if item["type"] == "message":
            item["status"] = "incomplete" if cut else "completed"
            part = item["content"][0]
            return [("response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                    ("response.content_part.done", {**where, "content_index": 0, "part": copy.deepcopy(part)}),
                    ("response.output_item.done", {"output_index": where["output_index"],
                                                   "item": copy.deepcopy(item)})]
        try:
            json.loads(item["arguments"])
            whole = True
        except ValueError:
            whole = False
        item["status"] = "completed" if whole and not cut else "incomplete"
        return [("response.function_call_arguments.done", {**where, "arguments": item["arguments"],
                                                           "name": item["name"]}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": copy.deepcopy(item)})]


# --- the endpoint -----------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request on its way: what it asked, the conversation it continues, and its prompt."""

    id: str
    req: R.ResponsesRequest
    model: str
    owner: str
    created_at: int
    items: list[dict]  # the conversation before the answer (stored items, earlier turns included)
    plan: T.ToolPlan
    params: SamplingParams
    prompt_text: str
    prompt_ids: list[int]


class OpenAIServingResponses(OpenAIServing):
    """`/v1/responses` and its stored responses, over the chat endpoint's preparation."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore, keyed: bool) -> None:
        super().__init__(chat.ctx)
        self.chat = chat
        self.store = store
        self.keyed = keyed  # the server checks API keys: a stored response belongs to the key that made it

    def owner(self, headers, user: str | None) -> str:
        return owner_key(bearer_token(headers) if self.keyed else None, self.options.tenant_rule.resolve(user, headers))

    def not_found(self, response_id: str, param: str | None = None) -> ApiError:
        return ApiError(404, f"No response found with id '{response_id}'.", param=param,
                        code="previous_response_not_found" if param else "not_found")

    async def create(self, data: dict, request: Request) -> Response:
        try:
            return await self._create(data, request)
        except ApiError as e:
            raise (_renamed(e) if e.status == 400 else e) from None

    async def _create(self, data: dict, request: Request) -> Response:
        refused = R.unsupported(data)
        if refused is not None:
            raise bad_request(*refused)
        try:
            req = parse_model(R.ResponsesRequest, data)
        except ApiError as e:  # input.0.message.role -> input[0].role
            e.param = _ITEM_PATH.sub(r"[\1]", e.param or "") or None
            e.message = _ITEM_PATH.sub(r"[\1]", e.message)
            raise
        self.check_model(req.model)
        turn = await self._turn(req, request.headers)
        sub = self.submit(turn.id, self.engine_requests(turn.id, [turn.prompt_ids], turn.params, req,
                                                        request.headers, lora=self.lora_for(req.model)))
        if req.stream:
            fmt = ResponsesStream(self, sub, turn)
            return SSEResponse(stream_events(sub, self.deltas(sub), fmt, lambda: self.timeout_error().body()),
                               sub.close)
        out = await self.collect(sub, request)
        if out is None:
            return Response(status_code=499)
        c = out[0].outputs[0]
        builder = OutputBuilder(turn.plan)
        builder.feed(c.text)
        builder.finish(c.finish_reason)
        body = await self.conclude(turn, builder, c.finish_reason, list(c.token_ids),
                                   R.usage(len(turn.prompt_ids), len(c.token_ids), out[0].num_cached_tokens))
        return JSONResponse(body)

    async def _turn(self, req: R.ResponsesRequest, headers) -> Turn:
        """Everything before the engine: the stored conversation this continues, the new items, the chat
        request they make, its prompt and its sampling."""
        owner = self.owner(headers, req.user)
        prev = None
        if req.previous_response_id is not None:
            prev = await self.store.get(owner, req.previous_response_id)
            if prev is None:
                raise self.not_found(req.previous_response_id, "previous_response_id")
        items = (prev.input_items + prev.output_items if prev else []) + stored_items(req)
        if not items:
            raise bad_request("input must not be empty", "input")
        chat = parse_model(P.ChatCompletionRequest, chat_request(req, chat_messages(req.instructions, items)))
        rendered: list[str] = []

        async def render(chat_req: P.ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
            text = self.chat_text(chat_req, tools)
            rendered.append(text)
            return await self.continued(prev, text)

        prep = await self.chat.prepare(chat, render)
        return Turn(R.new_id("resp"), req, req.model or self.model_names[0], owner, int(time.time()), items,
                    prep.plan, prep.params, rendered[0], prep.ids)

    async def continued(self, prev: StoredResponse | None, text: str) -> list[int]:
        """`text`'s token ids, reusing the previous turn's: its prompt and answer tokens when `text` starts
        with their text (the prefix cache then serves them all), its prompt tokens when it starts with that
        only, else the text tokenized afresh."""
        if prev is not None:
            answer = prev.prompt_text + self.tokenizer.decode(prev.output_ids, skip_special_tokens=False)
            for head, ids in ((answer, prev.prompt_ids + prev.output_ids), (prev.prompt_text, prev.prompt_ids)):
                if text.startswith(head):
                    rest = text[len(head):]
                    return ids + (await self.tokenize(rest, False, "input") if rest else [])
        return await self.tokenize(text, False, "input")

    async def conclude(self, turn: Turn, builder: OutputBuilder, reason: str | None, output_ids: list[int],
                       usage: dict) -> dict:
        """The final `response` object, stored when the request asked for it (a failed write is logged and
        the answer still returned), and the tool calls counted in /metrics."""
        self.chat.tool_finish(turn.plan, reason, builder.num_calls)
        status = "completed" if reason == "stop" else "incomplete"
        body = R.response_object(turn.id, turn.req, turn.model, turn.created_at, status, builder.items, usage)
        if turn.req.store:
            await self.store.put(turn.owner, StoredResponse(turn.id, body, turn.items, turn.prompt_text,
                                                            turn.prompt_ids, output_ids))
        return body

    # --- the stored responses -----------------------------------------------------------------------
    async def _stored(self, response_id: str, request: Request) -> StoredResponse:
        row = await self.store.get(self.owner(request.headers, request.query_params.get("user")), response_id)
        if row is None:
            raise self.not_found(response_id)
        return row

    async def retrieve(self, response_id: str, request: Request) -> Response:
        return JSONResponse((await self._stored(response_id, request)).response)

    async def delete(self, response_id: str, request: Request) -> Response:
        owner = self.owner(request.headers, request.query_params.get("user"))
        if not await self.store.delete(owner, response_id):
            raise self.not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, response_id: str, request: Request) -> Response:
        """The conversation before the response, earlier turns included, a page at a time (OpenAI's list)."""
        q = request.query_params
        try:
            limit = int(q.get("limit", 20))
        except ValueError:
            raise bad_request("limit must be an integer from 1 to 100", "limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("limit must be an integer from 1 to 100", "limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        items = list((await self._stored(response_id, request)).input_items)
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise bad_request(f"no item with id '{after}' in this response's input", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


class ResponsesStream(StreamFormat):
    """The Responses API's named events, each with its `sequence_number`: `response.created` and
    `response.in_progress`, then the items as `OutputBuilder` makes them, then `response.completed` (after
    the answer is stored). A failure is an `error` event and `response.failed`; there is no `[DONE]`."""

    def __init__(self, serving: OpenAIServingResponses, sub: Submission, turn: Turn) -> None:
        self.serving, self.sub, self.turn = serving, sub, turn
        self.builder = OutputBuilder(turn.plan)
        self.seq = 0
        self.output_ids: list[int] = []
        self.reason: str | None = None
        self.final: dict | None = None

    def _event(self, type_: str, fields: dict) -> str:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(body, event=type_)

    def _response(self, status: str, **kw) -> dict:
        t = self.turn
        return R.response_object(t.id, t.req, t.model, t.created_at, status, kw.pop("output", []), **kw)

    def start(self) -> Iterable[str]:
        for kind in ("response.created", "response.in_progress"):
            yield self._event(kind, {"response": self._response("in_progress")})

    def delta(self, d: StepDelta) -> Iterable[str]:
        self.output_ids += d.new_token_ids
        events = self.builder.feed(d.new_text)
        if d.finished:
            self.reason = d.finish_reason
            events += self.builder.finish(d.finish_reason)
        for kind, fields in events:
            yield self._event(kind, fields)

    async def complete(self, counts: StreamCounts) -> None:
        usage = R.usage(len(self.turn.prompt_ids), counts.completion_tokens, counts.cached_tokens)
        self.final = await self.serving.conclude(self.turn, self.builder, self.reason, self.output_ids, usage)

    def finish(self, counts: StreamCounts) -> Iterable[str]:
        if self.final is not None:
            yield self._event("response.completed", {"response": self.final})

    def error(self, body: dict) -> str:
        err = body["error"]
        return (self._event("error", {"code": err.get("code"), "message": err["message"], "param": err.get("param")})
                + self._event("response.failed", {"response": self._response(
                    "failed", output=self.builder.items,
                    error={"code": err.get("code") or "server_error", "message": err["message"]})}))

    def end(self) -> Iterable[str]:
        return ()


def install_responses_routes(router: APIRouter, responses: OpenAIServingResponses,
                             read_json: Callable[[Request], Awaitable[dict]]) -> None:
    """The routes of `/v1/responses` on `router` (which checks the API key; `read_json`: the body reader)."""

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(await read_json(request), request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        return await responses.retrieve(response_id, request)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        return await responses.delete(response_id, request)

    @router.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        return await responses.input_items(response_id, request)
