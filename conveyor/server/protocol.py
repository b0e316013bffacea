"""OpenAI-shaped request and response bodies.

Requests ignore unknown fields (as OpenAI does) but are strict about types where OpenAI is: a
string is not a number, a bool is not an integer, NaN is not a temperature. Ranges that the
engine itself guards (`SamplingParams.validate`) are not repeated here; only bounds that keep
a value from overflowing torch (seeds, top_k, token ids) are.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_serializer

# Strict scalars: ints reject "3" and True; floats accept ints but reject strings, bools and NaN/inf.
Int = StrictInt
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = StrictBool
Str = StrictStr
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class JsonSchemaFormat(_Request):
    name: Str | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow a pydantic method
    strict: Bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extra: one of a JSON schema, a regex, a choice or a Lark grammar.
    Unknown keys are refused (vLLM's whitespace_pattern, structural_tag, ... are not implemented)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Str | None = Field(None, alias="json")
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None
    json_object: Bool | None = None


class EngineFields(_Request):
    """The per-request fields every endpoint that reaches the engine takes, read in one place
    (`OpenAIServing.engine_requests`) into the request record (`conveyor.request.EngineRequest`): who it is
    for (`user`, or the server's `--tenant-key` rule), its priority, its prefix-cache salt and its latency
    targets. A new per-request field goes here, into the record, and into the code that reads it."""

    user: Str | None = None
    priority: Int64 = 0  # vLLM extra: lower is served first
    # prefix-cache isolation (vLLM): requests share cached KV blocks only with requests of the same salt
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    # latency targets in ms (vLLM-style extras; default: the server's --slo-ttft-ms / --slo-tpot-ms)
    slo_ttft_ms: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] | None = None
    slo_tpot_ms: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] | None = None


class _SamplingFields(EngineFields):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: Str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    seed: Int64 | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[Str, Float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    # vLLM extras
    ignore_eos: Bool = False
    min_tokens: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None


PromptField = Str | list[Str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: Str


class FunctionCallIn(_Request):
    name: Str
    arguments: Str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """A tool call in an earlier assistant message of the conversation."""

    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(_Request):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (checked by the grammar engine)
    strict: Bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: Str | None = None  # tool: which call this is the result of

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    add_generation_prompt: Bool = True
    # tool calling (conveyor/server/tools.py)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    tools: list[ToolDef] | None = None


class EmbeddingRequest(EngineFields):
    """OpenAI's /v1/embeddings: one or many inputs, as text or token ids."""

    model: Str | None = None
    input: PromptField
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=2**31 - 1)] | None = None


class DetokenizeRequest(_Request):
    model: Str | None = None
    tokens: list[TokenId]


# --- responses ------------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (as OpenAI and vLLM report them)


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM: {token id: {logprob, decoded_token}}
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class _DropNone(_Response):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict:
        """A delta names only what it adds (OpenAI sends no `name: null` after a call's first chunk)."""
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A piece of a streamed tool call: the first has id, type and name; the rest argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict:
        """A delta names only what it adds (OpenAI sends no `role: null`)."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class EmbeddingData(_Response):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format="base64")


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
