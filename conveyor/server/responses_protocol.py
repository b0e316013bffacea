"""OpenAI's Responses API bodies: the request `POST /v1/responses` takes, the items it reads and writes,
and the `response` object it answers with (in one piece, or as the stream's events).

Requests are checked in two passes. `unsupported` walks the raw body first and names the first thing
conveyor does not serve (a built-in tool such as `web_search`, an item type such as `computer_call`, an
image or a file in a message, a background run): a 400 that says what it is, rather than pydantic's
"no union member matched". Then `ResponsesRequest` checks the shapes and types, as the chat models in
`protocol.py` do (strict scalars, unknown fields ignored). What the request means for generation is the
chat endpoint's business: `responses.py` turns it into a `ChatCompletionRequest`.

Output items are plain dicts in OpenAI's shape (`message_item`, `function_call_item`): the same dicts go
into the stream's events, the final `response` object and the store, and come back out of it.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from conveyor.server.protocol import Bool, EngineFields, Float, Int64, MaxTokens, Str, _Request

# What conveyor serves; everything else OpenAI defines gets a 400 naming it.
ITEM_TYPES = ("message", "function_call", "function_call_output")
CONTENT_TYPES = ("input_text", "output_text", "refusal", "text")
TOOL_TYPES = ("function",)
TOOL_CHOICE_TYPES = ("function",)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def unsupported(data: dict) -> tuple[str, str] | None:
    """(message, param) for the first part of a raw request body that this server does not serve, or None."""
    if data.get("background"):
        return "background responses are not supported by this server (stream, or wait for the answer)", "background"
    if data.get("conversation") not in (None, ""):
        return "'conversation' is not supported by this server: continue with previous_response_id", "conversation"
    if data.get("prompt") not in (None, {}):
        return "prompt templates ('prompt') are not supported by this server", "prompt"
    for i, tool in enumerate(data.get("tools") or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind not in TOOL_TYPES:
            return (f"tools[{i}]: the built-in tool type {kind!r} is not supported by this server; it serves "
                    "function tools ({\"type\": \"function\", \"name\": ..., \"parameters\": ...})"), f"tools[{i}].type"
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] not in TOOL_CHOICE_TYPES:
        return (f"tool_choice of type {choice['type']!r} is not supported by this server: use \"none\", \"auto\", "
                "\"required\" or {\"type\": \"function\", \"name\": ...}"), "tool_choice"
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message" if "role" in item else None)
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            return (f"input[{i}]: items of type {kind!r} are not supported by this server; it serves "
                    f"{', '.join(ITEM_TYPES)}"), f"input[{i}].type"
        parts = item.get("content") if kind == "message" else item.get("output") if kind == "function_call_output" \
            else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            ptype = part.get("type") if isinstance(part, dict) else None
            if isinstance(ptype, str) and ptype not in CONTENT_TYPES:
                field = "content" if kind == "message" else "output"
                return (f"input[{i}].{field}[{j}]: content of type {ptype!r} is not supported by this server "
                        "(text only)"), f"input[{i}].{field}[{j}].type"
    return None


# --- the request ----------------------------------------------------------------------------------
class ContentPart(_Request):
    """Text in a message: `input_text` (what users and systems say), `output_text` (an assistant's earlier
    answer sent back), `refusal`."""

    type: Literal["input_text", "output_text", "refusal", "text"]
    text: Str | None = None
    refusal: Str | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(_Request):
    type: Literal["message"] = "message"
    id: Str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Str | list[ContentPart]
    status: Str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.value() for p in self.content)


class FunctionCallItem(_Request):
    """A call the model made earlier, sent back with its result."""

    type: Literal["function_call"]
    id: Str | None = None
    call_id: Str
    name: Str
    arguments: Str  # JSON text, as the model wrote it
    status: Str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    id: Str | None = None
    call_id: Str
    output: Str | list[ContentPart]
    status: Str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.value() for p in self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class FunctionTool(_Request):
    """A function tool in the Responses shape: name and schema at the top, not under `function`."""

    type: Literal["function"]
    name: Annotated[Str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: Str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Str | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


def _input_items(value: Any) -> Any:
    """A string is one user message; an item with a `role` and no `type` is a message (OpenAI's easy form)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return [{"type": "message", **v} if isinstance(v, dict) and "type" not in v and "role" in v else v
                for v in value]
    return value


MetadataKey = Annotated[Str, Field(max_length=64)]
MetadataValue = Annotated[Str, Field(max_length=512)]


class ResponsesRequest(EngineFields):
    """`POST /v1/responses` (OpenAI's fields; `user`, `priority`, `cache_salt` and the latency targets as on
    every endpoint that reaches the engine; a few of vLLM's sampling extras pass through to the chat path)."""

    model: Str | None = None
    input: Annotated[list[InputItem], BeforeValidator(_input_items)]
    instructions: Str | None = None
    previous_response_id: Str | None = None
    store: Bool = True
    stream: Bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Str] | None = None  # extra output conveyor does not produce (logprobs, reasoning): ignored
    # vLLM's sampling extras, passed through to the chat path
    seed: Int64 | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, le=2**31 - 1)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0


# --- the answer -----------------------------------------------------------------------------------
def output_text_part(text: str = "") -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None = None, status: str = "completed") -> dict:
    """An assistant message (`text` None: no content part yet, as in `response.output_item.added`)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text_part(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str = "",
                       status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def response_object(response_id: str, req: ResponsesRequest, model: str, created_at: int, status: str,
                    output: list[dict], usage_: dict | None = None, error: dict | None = None) -> dict:
    """The `response` object: what the request asked for, echoed as OpenAI echoes it, with its outcome."""
    tool_choice = req.tool_choice
    if isinstance(tool_choice, NamedFunctionChoice):
        tool_choice = tool_choice.model_dump()
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
        else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "model": model, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": tool_choice or ("auto" if req.tools else "none"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "text": {"format": text_format}, "truncation": req.truncation or "disabled", "store": req.store,
        "user": req.user, "background": False, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "usage": usage_,
    }
