"""Tool calling over HTTP with the official client, against one real server on the tiny random model.

The tiny model knows nothing about tools: every well-formed call under tool_choice "required" or a named
function is the grammar's doing, and the `auto` path is driven end to end by forcing the model's output
with a guided regex in the request (real engine, real grammar, real parser). The server runs the shipped
SmolLM2 tool template (`--chat-template smollm2-tools`) and the hermes parser.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from conveyor.server.api_server import ServerArgs
from conveyor.server.tools import load_chat_template

from .conftest import API_KEY, MODEL, run_server, tiny_config

S = {"type": "string", "maxLength": 8}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


PARAMS: list[dict] = [
    _obj({"city": S, "unit": {"enum": ["c", "f"]}}),
    _obj({"a": {"type": "integer", "minimum": -50, "maximum": 50}, "b": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": S})}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    _obj({"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}}),
    _obj({"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
         required=["size"]),
    _obj({"pt": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                      "y": {"type": "integer", "minimum": 0, "maximum": 9}})}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({}),
    _obj({"items": {"type": "array", "maxItems": 2, "items": _obj({"sku": S, "n": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 5}})}}),
    _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180,
                                                                           "maximum": 180}}),
    _obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, S]}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"level": {"enum": [1, 2, 3]}, "loud": {"type": "boolean"}}),
    _obj({"deep": _obj({"er": _obj({"est": {"enum": ["a", "b"]}})})}),
    _obj({"t": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    _obj({"version": {"const": "v1"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}),
    _obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {
        "type": "integer", "minimum": 0, "maximum": 9}}}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, required=["email"]),
    _obj({"mode": {"enum": ["fast", "slow"]}, "limit": {"type": "number", "minimum": 0.5, "maximum": 2.5}}),
]
assert len(PARAMS) == 20
TOOLS = [{"type": "function", "function": {"name": f"fn_{i}", "description": f"tool number {i}", "parameters": p}}
         for i, p in enumerate(PARAMS)]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ChatML that lists the tools by name only: the shipped template writes each tool's whole schema, which
# with the tiny model's 400-token vocabulary makes 20 tools ~6k tokens (its own test is below)
COMPACT = ("{% if tools %}{{ '<|im_start|>system\\ntools: ' + tools | map(attribute='function.name') | join(', ') "
           "+ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
           "m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tool_server(tiny_llama):
    args = ServerArgs(api_key=API_KEY, chat_template=COMPACT, enable_auto_tool_choice=True,
                      tool_call_parser="hermes", max_queued_requests=256)
    with run_server(tiny_config(tiny_llama), args) as s:
        yield s


@pytest.fixture()
def tclient(tool_server):
    with openai.OpenAI(base_url=tool_server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMA[name])


def _stream_calls(stream) -> tuple[list[dict], str | None, str]:
    """Reassemble streamed tool calls the way OpenAI's docs and clients do (by index: id and name from the
    first delta, arguments concatenated)."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def test_required_and_named_tool_calls_validate_streamed_and_not_beside_plain_chat(tclient, tool_server):
    """40 tool requests (each of the 20 tools named, streamed or not; "required" over all 20 tools,
    streamed or not) and 10 plain chats in flight together: every call parses and validates."""
    msgs = [{"role": "user", "content": "call a tool"}]

    def named(i: int, stream: bool) -> list[dict]:
        kw = dict(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=360, temperature=1.0, seed=i,
                  tool_choice={"type": "function", "function": {"name": f"fn_{i}"}})
        if stream:
            calls, reason, content = _stream_calls(tclient.chat.completions.create(stream=True, **kw))
            assert content == ""
        else:
            m = tclient.chat.completions.create(**kw).choices[0]
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in m.message.tool_calls]
            reason = m.finish_reason
            assert m.message.content is None
        assert reason == "tool_calls" and [c["name"] for c in calls] == [f"fn_{i}"]
        return calls

    def required(i: int, stream: bool) -> list[dict]:
        kw = dict(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=360, temperature=1.0, seed=200 + i,
                  tool_choice="required", parallel_tool_calls=i % 2 == 0)
        if stream:
            calls, reason, _ = _stream_calls(tclient.chat.completions.create(stream=True, **kw))
        else:
            m = tclient.chat.completions.create(**kw).choices[0]
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in m.message.tool_calls]
            reason = m.finish_reason
        assert reason == "tool_calls" and calls
        if i % 2:
            assert len(calls) == 1  # parallel_tool_calls=False
        return calls

    def plain(i: int) -> str:
        r = tclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                            max_tokens=12, temperature=1.0, seed=i)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content

    with ThreadPoolExecutor(50) as pool:
        futs = [pool.submit(named, i, i % 2 == 1) for i in range(20)]
        futs += [pool.submit(required, i, i % 4 < 2) for i in range(20)]
        plains = [pool.submit(plain, i) for i in range(10)]
        seen = set()
        for f in futs:
            for c in f.result():
                _valid(c["name"], c["arguments"])
                assert c["id"] not in seen
                seen.add(c["id"])
        assert all(isinstance(p.result(), str) for p in plains)
    m = tool_server.wait_idle()
    assert m["conveyor:tool_call_responses_total{tool_choice=named}"] >= 20
    assert m["conveyor:tool_call_responses_total{tool_choice=required}"] >= 20


FORCED_CALL = '<tool_call>\n{"name": "fn_0", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in '\\.^$|?*+()[]{}"' else c for c in s)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_hermes_parser_end_to_end(tclient, stream):
    """The model's output is forced (a guided regex in the request) to a Hermes tool call, and to plain
    text: the first comes back as tool_calls, the second as content."""
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, tools=TOOLS[:3], max_tokens=120, temperature=0)
    forced = {"guided_regex": "Let me check\\. " + _regex_escape(FORCED_CALL)}
    if stream:
        calls, reason, content = _stream_calls(tclient.chat.completions.create(stream=True, extra_body=forced, **kw))
    else:
        m = tclient.chat.completions.create(extra_body=forced, **kw).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in m.message.tool_calls]
        reason, content = m.finish_reason, m.message.content
        assert calls[0]["id"].startswith("call_")
    assert reason == "tool_calls" and content == "Let me check. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("fn_0", {"city": "Paris", "unit": "c"})]

    plain = {"guided_regex": "It is sunny <in> Paris\\."}
    if stream:
        calls, reason, content = _stream_calls(tclient.chat.completions.create(stream=True, extra_body=plain, **kw))
    else:
        m = tclient.chat.completions.create(extra_body=plain, **kw).choices[0]
        calls, reason, content = m.message.tool_calls or [], m.finish_reason, m.message.content
    assert calls == [] and reason == "stop" and content == "It is sunny <in> Paris."


def test_multi_turn_with_tool_result_renders_as_transformers_does(tiny_llama):
    """A conversation with an assistant tool call and its tool result, on a server running the shipped
    SmolLM2 tool template: the server's rendering (via /tokenize, the same path chat uses) equals
    transformers' apply_chat_template with the same tools and template; the chat request is served."""
    from transformers import AutoTokenizer

    args = ServerArgs(api_key=API_KEY, chat_template="smollm2-tools")
    with run_server(tiny_config(tiny_llama, max_model_len=1024), args) as srv:
        _multi_turn(srv, tiny_llama, AutoTokenizer)


def _multi_turn(tool_server, tiny_llama, AutoTokenizer) -> None:
    tools = TOOLS[:1]
    args = {"city": "Oslo", "unit": "c"}
    api_messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "fn_0", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    hf_messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "fn_0", "arguments": args}, "id": "call_1"}]},
        {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    template = load_chat_template("smollm2-tools")
    text = tok.apply_chat_template(hf_messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tool_call>\n{\"name\": \"fn_0\", \"arguments\": {\"city\": \"Oslo\"" in text
    assert "<tool_response>\n{\"temp\": -3}\n</tool_response>" in text and "<tools>" in text
    want = tok(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(tool_server.url + "/tokenize", json={"model": MODEL, "messages": api_messages, "tools": tools},
                   headers=tool_server.headers())
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    r = httpx.post(tool_server.base_url + "/chat/completions", headers=tool_server.headers(), timeout=60,
                   json={"model": MODEL, "messages": api_messages, "tools": tools, "tool_choice": "required",
                         "max_tokens": 100, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"]
    # the client's own round trip: the response message goes back into the history as it came
    with openai.OpenAI(base_url=tool_server.base_url, api_key=API_KEY, max_retries=0) as c:
        m = c.chat.completions.create(model=MODEL, messages=api_messages[:2], tools=tools, tool_choice="required",
                                      max_tokens=100, temperature=0).choices[0].message
        history = api_messages[:2] + [m.model_dump(exclude_none=True), {
            "role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18"}]
        again = c.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=5)
        assert again.choices[0].message.content is not None


BAD_PARAMS = {"type": "objekt"}


@pytest.mark.parametrize("body,param", [
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": BAD_PARAMS}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "object",
                                                                             "required": "a"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": TOOLS[:2], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS[:2], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS[:2], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "fn_0", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_tools_are_a_400_and_the_server_goes_on(tool_server, tclient, body, param):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(tool_server.base_url + "/chat/completions", json=payload, headers=tool_server.headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = tclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.choices[0].message.content is not None


def test_tools_on_completions_and_auto_without_parser_are_refused(server, tiny_llama):
    r = httpx.post(server.base_url + "/completions", headers=server.headers(),
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "tools": TOOLS[:1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # the shared server has no --tool-call-parser: "auto" is a 400, and tools without tool_choice are plain chat
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS[:1]}
    r = httpx.post(server.base_url + "/chat/completions", headers=server.headers(),
                   json={**base, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(server.base_url + "/chat/completions", headers=server.headers(), json=base)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] is None


def test_unknown_parser_and_bad_template_are_startup_errors(tiny_llama):
    cfg = tiny_config(tiny_llama)
    from conveyor.server.api_server import build_app

    with pytest.raises(ValueError, match="unknown --tool-call-parser 'nope'.*hermes"):
        build_app(cfg, ServerArgs(enable_auto_tool_choice=True, tool_call_parser="nope"))
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        build_app(cfg, ServerArgs(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="chat-template"):
        build_app(cfg, ServerArgs(chat_template="no-such-template"))


def test_openai_stream_helper_reassembles_calls(tclient):
    """The client's own stream helper (`chat.completions.stream`) accumulates the deltas into a final
    message whose calls equal what the non-streamed request returns for the same seed."""
    # one call (a random model's array of parallel calls may run past max_tokens before it closes)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "go"}], tools=TOOLS[:6], tool_choice="required",
              parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=7)
    with tclient.chat.completions.stream(**kw) as stream:
        events = [ev.type for ev in stream]
        final = stream.get_final_completion().choices[0]
    whole = tclient.chat.completions.create(**kw).choices[0]
    assert "tool_calls.function.arguments.done" in events
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for name, args in got:
        jsonschema.validate(args, SCHEMA[name])
