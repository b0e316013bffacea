"""Tool calling on /v1/chat/completions, as vLLM serves it: request checks, grammars, templates.

`tool_choice` decides how the output becomes `tool_calls`:
- "none": plain chat (the tools are still shown to the template, as vLLM does);
- "auto": the model decides; its text goes through the `--tool-call-parser` (`tool_parsers.py`),
  which needs `--enable-auto-tool-choice`;
- "required": the output is *constrained* by the grammar engine to a JSON array of one or more
  `{"name": <one of the tools>, "parameters": <that tool's schema>}` objects, so every call
  parses and its arguments validate, whatever the model;
- a named function: the output is constrained to that function's parameter schema and is its
  arguments.

Each tool's `parameters` is compiled by llguidance when the request arrives (a schema it cannot
compile is a 400 naming `tools[i].function.parameters`); compiled checks are cached by schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from conveyor.sampling_params import StructuredOutputsParams
from conveyor.server import protocol as P
from conveyor.server.tool_parsers import (
    ArgumentsStream,
    ArrayCallStream,
    ParsedCall,
    ToolParser,
    ToolStream,
    get_tool_parser,
)

# A function that takes no parameters: exactly `{}` (an open object would let a model ramble on)
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_checked: OrderedDict[str, str | None] = OrderedDict()  # schema JSON -> error (None: valid), LRU
_checked_lock = threading.Lock()  # requests check their tools in worker threads


class ToolError(ValueError):
    """A bad tool request: becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def builtin_templates() -> list[str]:
    return sorted(p.name.removesuffix(".jinja") for p in resources.files("conveyor.server").joinpath(
        "templates").iterdir() if p.name.endswith(".jinja"))


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file, the name of a template shipped in conveyor/server/templates
    (e.g. `smollm2-tools`), or the Jinja text itself. ValueError (a startup error) otherwise."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    shipped = resources.files("conveyor.server").joinpath("templates", f"{value}.jinja")
    if shipped.is_file():
        return shipped.read_text()
    raise ValueError(f"--chat-template {value!r} is neither a file, a shipped template "
                     f"({', '.join(builtin_templates())}) nor Jinja text")


def check_tool_args(enable_auto: bool, parser: str | None) -> ToolParser | None:
    """Startup check of `--enable-auto-tool-choice` / `--tool-call-parser` (ValueError when wrong)."""
    if parser is None:
        if enable_auto:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        return None
    tp = get_tool_parser(parser)
    if not enable_auto:
        raise ValueError("--tool-call-parser is used by tool_choice=\"auto\": add --enable-auto-tool-choice")
    return tp


def _check_schema(schema: dict, param: str) -> None:
    key = json.dumps(schema, sort_keys=True)
    with _checked_lock:
        known = key in _checked
        if known:
            _checked.move_to_end(key)
            error = _checked[key]
    if not known:
        try:
            StructuredOutputsParams(json=schema)
            error = None
        except ValueError as e:
            error = str(e).removeprefix("structured_outputs: ")
        with _checked_lock:
            _checked[key] = error
            if len(_checked) > 512:
                _checked.popitem(last=False)
    if error is not None:
        raise ToolError(f"{param} is not a valid JSON Schema: {error}", param)


def _parameters(tool: P.ToolDef) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


@dataclass
class ToolPlan:
    """How one request's output turns into tool calls (`mode` none | auto | required | named)."""

    mode: str
    tools: list[P.ToolDef]
    parallel: bool = True
    parser: ToolParser | None = None
    named: str | None = None
    structured: StructuredOutputsParams | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them (transformers' `tools=`)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def stream(self) -> ToolStream | None:
        """A fresh per-choice stream of tool-call events, or None for plain chat."""
        if self.mode == "named":
            return ArgumentsStream(self.named)
        if self.mode == "required":
            return ArrayCallStream(("parameters",), None if self.parallel else 1)
        if self.mode == "auto":
            return self.parser.stream(self.parallel)
        return None

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole response: (content, calls)."""
        if self.mode == "auto":
            return self.parser.extract(text, self.parallel)
        s = self.stream()
        s.feed(text)
        s.finish()
        calls = s.calls if self.parallel else s.calls[:1]
        return (None, calls) if calls else (text or None, [])


def plan_tools(req: P.ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """Check the request's tools and tool_choice and decide how its output is made and read.
    Slow for many large schemas (each is compiled once): run it off the event loop."""
    tools = req.tools or []
    choice = req.tool_choice
    names: set[str] = set()
    for i, t in enumerate(tools):
        param = f"tools[{i}].function.parameters"
        if t.function.parameters is not None:
            _check_schema(t.function.parameters, param)
        if t.function.name in names:
            raise ToolError(f"tools[{i}].function.name {t.function.name!r} is given twice", f"tools[{i}].function.name")
        names.add(t.function.name)
    if choice is None:
        choice = "auto" if tools and auto_parser is not None else "none"
    if choice != "none" and not tools:
        raise ToolError("tool_choice needs tools", "tool_choice")
    if choice == "none":
        return ToolPlan("none", tools, req.parallel_tool_calls)
    if choice == "auto":
        if auto_parser is None:
            raise ToolError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                            "--tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools, req.parallel_tool_calls, parser=auto_parser)
    if choice == "required":
        branches = [{"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                                      "parameters": _parameters(t)},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "items": {"anyOf": branches} if len(branches) > 1 else branches[0],
                  "minItems": 1}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, req.parallel_tool_calls, structured=_structured(schema))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                        f"({', '.join(sorted(names))})", "tool_choice")
    return ToolPlan("named", tools, req.parallel_tool_calls, named=name, structured=_structured(_parameters(tool)))


def _structured(schema: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise ToolError(f"the tools' schemas could not be combined: {e}", "tools") from None


def template_messages(messages: list[P.ChatMessage]) -> list[dict]:
    """The conversation as chat templates read it (transformers' convention, as vLLM passes it):
    an assistant's `tool_calls` with `arguments` parsed into an object, a tool result with its
    `tool_call_id`."""
    conv = []
    for i, m in enumerate(messages):
        d: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolError(f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
                except ValueError:
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ToolError(f"{param} is not valid JSON", param) from None
                call = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
                if c.id is not None:
                    call["id"] = c.id
                calls.append(call)
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        conv.append(d)
    return conv


def response_calls(calls: list[ParsedCall]) -> list[P.ToolCall] | None:
    return [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None
