"""Tool calls out of model text: the `--tool-call-parser` registry, and the streamers behind it.

A model asked for tools answers in its own markup (Hermes/Qwen: `<tool_call>{"name": ..., "arguments":
...}</tool_call>`; Llama 3: a bare `{"name": ..., "parameters": ...}`). A parser turns that text into
OpenAI's `tool_calls`, both at once (a whole response) and piece by piece (a stream), and the two
agree by construction: `extract` is the streaming path fed the whole text at once.

Streaming follows OpenAI's chunk format: a call's first delta carries its index, id, type and name
(arguments ""), later ones only argument fragments, which the `openai` client's stream helpers
concatenate. Text outside tool calls is content; a suffix that may be the start of a tag is held
back until it is known not to be one.

Adding a parser is one class: subclass `ToolParser`, set `name`, implement `stream()`, and decorate
it with `@register`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One piece of one call: the first carries `id` and `name`, the rest `arguments` fragments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    """A finished call: its id, the function's name, and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass
class Events:
    """What one piece of model text added: content, and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Events) -> Events:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class CallScanner:
    """Reads one JSON object `{"name": ..., <arguments key>: ...}` as its characters arrive.

    It finds where the object ends without waiting for it (a streamed call must not swallow the
    text after it), learns the name as soon as its string closes, and hands out the arguments'
    raw JSON text as it grows once the name is known (OpenAI streams the name first). Arguments
    given as a JSON string (some models quote them) are decoded and sent whole when they close."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]) -> None:
        self.index = index
        self.arg_keys = arg_keys
        self.buf = ""
        self.done = False
        self.name: str | None = None
        self.id = new_call_id()
        self.header_sent = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._str_start = -1
        self._after_colon = False
        self._key: str | None = None
        self._val_start: int | None = None
        self._args: tuple[int, int | None] | None = None  # (start, end or None while open) in buf
        self._sent = 0  # characters of the arguments sent so far
        self.error = False

    def _end_value(self, end: int) -> None:
        start = self._val_start
        if self._key == "name":
            try:
                name = json.loads(self.buf[start:end])
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
            if self.name is None:
                self.error = True
        elif self._key in self.arg_keys:
            self._args = (start, end)
        self._val_start, self._after_colon, self._key = None, False, None

    def feed(self, text: str) -> int:
        """Consume characters of `text` up to the end of the object; return how many were used."""
        for i, c in enumerate(text):
            pos = len(self.buf)
            self.buf += c
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 1 and not self._after_colon:
                        try:
                            self._key = json.loads(self.buf[self._str_start:pos + 1])
                        except ValueError:
                            self.error = True
                    elif self._depth == 1 and self._val_start == self._str_start:
                        self._end_value(pos + 1)
                continue
            if c == '"':
                self._in_str, self._str_start = True, pos
                if self._depth == 1 and self._after_colon and self._val_start is None:
                    self._start_value(pos)
            elif c in "{[":
                if self._depth == 1 and self._after_colon and self._val_start is None:
                    self._start_value(pos)
                self._depth += 1
            elif c in "}]":
                if self._depth == 1 and self._val_start is not None:  # a scalar value ends here
                    self._end_value(pos)
                self._depth -= 1
                if self._depth == 1 and self._val_start is not None:
                    self._end_value(pos + 1)
                if self._depth == 0:
                    self.done = True
                    return i + 1
            elif self._depth == 1:
                if c == ":":
                    self._after_colon = True
                elif c == ",":
                    if self._val_start is not None:
                        self._end_value(pos)
                    self._after_colon, self._key = False, None
                elif not c.isspace() and self._after_colon and self._val_start is None:
                    self._start_value(pos)
            elif self._depth == 0 and not c.isspace():
                self.error = True  # not an object
                self.done = True
                return i + 1
        return len(text)

    def _start_value(self, pos: int) -> None:
        self._val_start = pos
        if self._key in self.arg_keys:
            self._args = (pos, None)

    def deltas(self) -> list[ToolCallDelta]:
        """What can be sent now: the header once the name is known, then new argument text."""
        out: list[ToolCallDelta] = []
        if self.name is None or self.error:
            return out
        if not self.header_sent:
            self.header_sent = True
            out.append(ToolCallDelta(self.index, "", self.id, self.name))
        if self._args is None:
            if self.done and not self._sent:  # no arguments given: an empty object
                self._sent = 1
                out.append(ToolCallDelta(self.index, "{}"))
            return out
        start, end = self._args
        quoted = self.buf[start:start + 1] == '"'
        if quoted:  # a string holding JSON: sent decoded, once complete
            if end is not None and not self._sent:
                self._sent = end - start
                try:
                    out.append(ToolCallDelta(self.index, json.loads(self.buf[start:end])))
                except ValueError:
                    self.error = True
            return out
        stop = end if end is not None else len(self.buf)
        # a scalar still open could be cut mid-token; objects and arrays may stream freely
        if end is None and self.buf[start:start + 1] not in ("{", "["):
            return out
        piece = self.buf[start + self._sent:stop]
        if piece:
            self._sent += len(piece)
            out.append(ToolCallDelta(self.index, piece))
        return out

    def result(self) -> ParsedCall | None:
        """The finished call, or None if the object was not a well-formed call."""
        if not self.done or self.error or self.name is None:
            return None
        try:
            obj = json.loads(self.buf)
        except ValueError:
            return None
        args = next((obj[k] for k in self.arg_keys if k in obj), {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return ParsedCall(self.id, self.name, json.dumps(args, ensure_ascii=False))


class ToolStream:
    """One choice's text, fed as it arrives; `feed` and `finish` return what to send."""

    def __init__(self) -> None:
        self.scanners: list[CallScanner] = []

    def feed(self, text: str) -> Events:
        raise NotImplementedError

    def finish(self) -> Events:
        return Events()

    @property
    def calls(self) -> list[ParsedCall]:
        """The calls that completed and parsed, in order."""
        return [c for c in (s.result() for s in self.scanners) if c is not None]

    @property
    def incomplete(self) -> bool:
        """A call was started but never closed or did not parse."""
        return any(s.result() is None for s in self.scanners)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ArrayCallStream(ToolStream):
    """`[{"name": ..., "parameters": ...}, ...]`: what `tool_choice="required"` constrains the output to."""

    def __init__(self, arg_keys: tuple[str, ...] = ("parameters", "arguments"), limit: int | None = None) -> None:
        super().__init__()
        self.arg_keys = arg_keys
        self.limit = limit
        self.current: CallScanner | None = None

    def feed(self, text: str) -> Events:
        ev = Events()
        while text:
            if self.current is None:
                j = text.find("{")
                if j < 0:
                    return ev
                text = text[j:]
                self.current = CallScanner(len(self.scanners), self.arg_keys)
                self.scanners.append(self.current)
            used = self.current.feed(text)
            text = text[used:]
            if self.limit is None or self.current.index < self.limit:
                ev.calls.extend(self.current.deltas())
            if self.current.done:
                self.current = None
        return ev


class ArgumentsStream(ToolStream):
    """A named `tool_choice`: the whole output is the arguments of that one function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.id = new_call_id()
        self.text = ""

    def feed(self, text: str) -> Events:
        ev = Events()
        if not self.text:
            ev.calls.append(ToolCallDelta(0, "", self.id, self.name))
        self.text += text
        if text:
            ev.calls.append(ToolCallDelta(0, text))
        return ev

    @property
    def calls(self) -> list[ParsedCall]:
        try:
            args = json.loads(self.text)
        except ValueError:
            return []
        return [ParsedCall(self.id, self.name, json.dumps(args, ensure_ascii=False))]

    @property
    def incomplete(self) -> bool:
        return not self.calls


class ToolParser:
    """Base of the `--tool-call-parser` registry: a factory of per-choice `ToolStream`s."""

    name: ClassVar[str] = ""

    def stream(self, parallel: bool = True) -> ToolStream:
        raise NotImplementedError

    def extract(self, text: str, parallel: bool = True) -> tuple[str | None, list[ParsedCall]]:
        """A whole response: (content, calls). A call that does not parse leaves the text as content
        (as vLLM does), so nothing the model said is lost."""
        s = self.stream(parallel)
        ev = s.feed(text)
        ev += s.finish()
        if s.incomplete or not s.calls:
            return text or None, []
        return ev.content or None, s.calls if parallel else s.calls[:1]


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the known ones otherwise (a startup error)."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown --tool-call-parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return cls()


class _TaggedStream(ToolStream):
    """Content, with calls between `start` and `end` tags (Hermes)."""

    def __init__(self, start: str, end: str, arg_keys: tuple[str, ...], parallel: bool) -> None:
        super().__init__()
        self.start, self.end, self.arg_keys, self.parallel = start, end, arg_keys, parallel
        self.pending = ""  # text not yet classified (a possible tag start)
        self.state = "content"  # content | call | after (waiting for the end tag)
        self.current: CallScanner | None = None

    def feed(self, text: str) -> Events:
        ev = Events()
        self.pending += text
        while self.pending:
            if self.state == "content":
                j = self.pending.find(self.start)
                if j < 0:
                    keep = _held_prefix(self.pending, self.start)
                    cut = len(self.pending) - keep
                    if not self.scanners:  # content after calls is dropped (vLLM keeps only the calls)
                        ev.content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return ev
                if not self.scanners:
                    ev.content += self.pending[:j]
                self.pending = self.pending[j + len(self.start):]
                self.state = "call"
                self.current = CallScanner(len(self.scanners), self.arg_keys)
                self.scanners.append(self.current)
            elif self.state == "call":
                if self.current.buf == "":
                    stripped = self.pending.lstrip()
                    if not stripped:
                        self.pending = ""
                        return ev
                    self.pending = stripped
                used = self.current.feed(self.pending)
                self.pending = self.pending[used:]
                if self.parallel or self.current.index == 0:
                    ev.calls.extend(self.current.deltas())
                if self.current.done:
                    self.state = "after"
            else:
                j = self.pending.find(self.end)
                if j < 0:
                    keep = _held_prefix(self.pending, self.end)
                    self.pending = self.pending[len(self.pending) - keep:]
                    return ev
                self.pending = self.pending[j + len(self.end):]
                self.state = "content"
        return ev

    def finish(self) -> Events:
        ev = Events()
        if self.state == "content" and not self.scanners:
            ev.content, self.pending = self.pending, ""
        return ev


@register
class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

    name = "hermes"

    def stream(self, parallel: bool = True) -> ToolStream:
        return _TaggedStream("<tool_call>", "</tool_call>", ("arguments", "parameters"), parallel)


class _Llama3Stream(ToolStream):
    """Llama 3.x JSON tool calls: the output *is* the call(s) when it starts with `{` (or the
    `<|python_tag|>` marker), several separated by `;`; otherwise it is all content."""

    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel
        self.mode: str | None = None  # None until the first visible character decides; "content" | "calls"
        self.head = ""
        self.array = ArrayCallStream(("parameters", "arguments"), None if parallel else 1)
        self.scanners = self.array.scanners

    def feed(self, text: str) -> Events:
        if self.mode is None:
            self.head += text
            s = self.head.lstrip()
            if not s or (self.TAG.startswith(s) and s != self.TAG):
                return Events()
            if s.startswith(self.TAG):
                s = s[len(self.TAG):].lstrip()
                if not s:
                    return Events()
            self.mode = "calls" if s.startswith("{") else "content"
            text, self.head = (s if self.mode == "calls" else self.head), ""
        if self.mode == "content":
            return Events(content=text)
        return self.array.feed(text)

    def finish(self) -> Events:
        if self.mode is None and self.head:
            self.mode = "content"
            return Events(content=self.head)
        return Events()


@register
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: `{"name": ..., "parameters": {...}}` (`; `-separated)."""

    name = "llama3_json"

    def stream(self, parallel: bool = True) -> ToolStream:
        return _Llama3Stream(parallel)
