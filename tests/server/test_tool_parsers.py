"""The `--tool-call-parser`s on model text: whole responses, and the same text streamed in pieces."""

from __future__ import annotations

import json
import random

import pytest

from conveyor.server.tool_parsers import TOOL_PARSERS, ArrayCallStream, get_tool_parser


def _streamed(parser, text: str, pieces: list[int], parallel: bool = True):
    """Feed `text` cut at `pieces`; return (content, [(id, name, arguments)]) reassembled as a client does."""
    s = parser.stream(parallel)
    content, calls = "", {}
    cuts = [0, *sorted(pieces), len(text)]
    events = [s.feed(text[a:b]) for a, b in zip(cuts, cuts[1:])] + [s.finish()]
    for ev in events:
        content += ev.content
        for d in ev.calls:
            if d.index not in calls:
                assert d.id and d.name and d.arguments == "", d  # the header comes first, alone
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None
                calls[d.index][2] += d.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


HERMES = [
    ("Hello, how can I help?", "Hello, how can I help?", []),
    ("a < b and <tool but no call", "a < b and <tool but no call", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    ('Checking. <tool_call>{"name": "a", "arguments": {"s": "}{\\"<tool_call>"}}</tool_call>\n'
     '<tool_call>{"arguments": {}, "name": "b"}</tool_call>', "Checking. ",
     [("a", {"s": '}{"<tool_call>'}), ("b", {})]),
    ('<tool_call>{"name": "q", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("q", {"x": 1})]),
    ('<tool_call>{"name": "n", "arguments": 5}</tool_call>', None, [("n", 5)]),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_whole_and_streamed(text, content, calls):
    p = get_tool_parser("hermes")
    got_content, got_calls = p.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    rng = random.Random(0)
    for trial in range(20):  # any cut of the text into pieces gives the same result
        cuts = [] if trial == 0 else rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))
        if trial == 1:
            cuts = list(range(1, len(text)))  # one character at a time
        s_content, s_calls = _streamed(p, text, cuts)
        assert s_content == (content or "")
        assert [(name, json.loads(args)) for _, name, args in s_calls] == calls


def test_hermes_malformed_call_is_content_and_parallel_off_keeps_one():
    p = get_tool_parser("hermes")
    bad = '<tool_call>{"name": "a", "arguments": {"x": </tool_call>'
    assert p.extract(bad) == (bad, [])
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls = p.extract(two, parallel=False)
    assert [c.name for c in calls] == ["a"]
    assert [c[1] for c in _streamed(p, two, [7, 30], parallel=False)[1]] == ["a"]


LLAMA = [
    ("The answer is 4.", "The answer is 4.", []),
    ('{"name": "sum", "parameters": {"a": 1, "b": [2, {"c": 3}]}}', None, [("sum", {"a": 1, "b": [2, {"c": 3}]})]),
    ('<|python_tag|>{"name": "f", "arguments": {"q": "x;y"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"q": "x;y"}), ("g", {})]),
    ('  {"name": "h", "parameters": {"s": "a\\"b"}}', None, [("h", {"s": 'a"b'})]),
]


@pytest.mark.parametrize("text,content,calls", LLAMA)
def test_llama3_json_whole_and_streamed(text, content, calls):
    p = get_tool_parser("llama3_json")
    got_content, got_calls = p.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for cuts in ([], list(range(1, len(text))), [3, 9, 17]):
        s_content, s_calls = _streamed(p, text, [c for c in cuts if c < len(text)])
        assert s_content == (content or "")
        assert [(name, json.loads(args)) for _, name, args in s_calls] == calls


def test_llama3_json_incomplete_call_is_content():
    text = '{"name": "f", "parameters": {"a": 1'
    assert get_tool_parser("llama3_json").extract(text) == (text, [])


def test_arguments_stream_incrementally():
    """Arguments go out as they arrive (not at the end), so a client sees a long call grow."""
    s = ArrayCallStream(("parameters",))
    ev = s.feed('[{"name": "f", "parameters": {"text": "hel')
    assert [(d.name, d.arguments) for d in ev.calls] == [("f", ""), (None, '{"text": "hel')]
    ev = s.feed('lo"}}, {"name": "g", "parameters": {}}]')
    assert [(d.index, d.name, d.arguments) for d in ev.calls] == [(0, None, 'lo"}'), (1, "g", ""), (1, None, "{}")]
    assert [(c.name, c.arguments) for c in s.calls] == [("f", '{"text": "hello"}'), ("g", "{}")]


def test_registry_names_and_unknown_parser():
    assert {"hermes", "llama3_json"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown --tool-call-parser 'nope'; known: hermes, llama3_json"):
        get_tool_parser("nope")
