"""/v1/responses with the official `openai` client on the tiny random model: the answer whole and streamed
(the SDK's stream helper and the raw event stream), function tools under the grammar, structured text,
conversations continued from the store (their prompt reuses the stored tokens, so the prefix cache serves
them), who may read a stored response, the errors, and a store that cannot be written.

The tiny model knows nothing: every call that validates is the grammar's doing, and the continuation's
cache hits are checked against the token arithmetic of the previous turn, not against what a model says.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conveyor.server.api_server import ServerArgs
from conveyor.server.responses import OutputBuilder
from conveyor.server.responses_store import ResponseStore, StoredResponse, owner_key
from conveyor.server.tool_parsers import get_tool_parser
from conveyor.server.tools import ToolPlan

from .conftest import MODEL, bound_url, popen_server, run_server, server_output, tiny_config

KEYS = ("k1", "k2")
S = {"type": "string", "maxLength": 8}
WEATHER = {"type": "object", "properties": {"city": S, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
SUM = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "add", "parameters": SUM}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
# the text stream of one message, and of one function call: the order the SDK's helper relies on
TEXT_EVENTS = (r"response\.created response\.in_progress response\.output_item\.added response\.content_part\.added"
               r"( response\.output_text\.delta)* response\.output_text\.done response\.content_part\.done"
               r" response\.output_item\.done response\.completed")
CALL_EVENTS = (r"response\.created response\.in_progress response\.output_item\.added"
               r"( response\.function_call_arguments\.delta)+ response\.function_call_arguments\.done"
               r" response\.output_item\.done response\.completed")


@pytest.fixture(scope="module")
def rserver(tiny_llama, tmp_path_factory):
    args = ServerArgs(api_key=",".join(KEYS), enable_auto_tool_choice=True, tool_call_parser="hermes",
                      responses_dir=str(tmp_path_factory.mktemp("responses")))
    with run_server(tiny_config(tiny_llama), args) as s:
        yield s


def make_client(srv, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture()
def rclient(rserver):
    with make_client(rserver) as c:
        yield c


@pytest.fixture()
def prompts(rserver):
    """The token ids of every prompt the Responses endpoint submits from now on."""
    seen: list[list[int]] = []
    aengine = rserver.app.state.engine
    real = aengine.submit

    def submit(api_id, inputs):
        seen.extend(list(i.prompt_token_ids) for i in inputs)
        return real(api_id, inputs)

    aengine.submit = submit
    yield seen
    del aengine.submit


def test_one_response_is_the_chat_answer_in_items(rclient):
    """Greedy, the same conversation through chat and Responses gives the same text and token counts:
    Responses is the chat path with other clothes, and `max_output_tokens` cuts it as `max_tokens` does."""
    kw = {"model": MODEL, "temperature": 0}
    chat = rclient.chat.completions.create(messages=[{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "hello there"}], max_tokens=12, **kw)
    r = rclient.responses.create(instructions="be brief", input="hello there", max_output_tokens=12, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_the_stream_helper_and_the_raw_stream(rclient):
    kw = {"model": MODEL, "input": "tell me a story", "max_output_tokens": 16, "temperature": 0}
    whole = rclient.responses.create(**kw)
    with rclient.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = " ".join(e.type for e in events)
    assert re.fullmatch(TEXT_EVENTS, types), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert events[-1].response.status == whole.status == "incomplete"  # 16 tokens of a random model
    assert final.usage.output_tokens == whole.usage.output_tokens == 16
    stored = rclient.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage == final.usage
    assert [(o.id, o.status) for o in stored.output] == [(o.id, o.status) for o in final.output]
    raw = list(rclient.responses.create(stream=True, **kw))
    assert " ".join(e.type for e in raw) == types and raw[-1].response.output_text == whole.output_text


def test_named_and_required_function_calls_validate(rclient):
    for choice, parallel in ((({"type": "function", "name": "add"}), True), ("required", False)):
        r = rclient.responses.create(model=MODEL, input="add 2 and 3", tools=TOOLS, tool_choice=choice,
                                     parallel_tool_calls=parallel, max_output_tokens=120, temperature=1.0,
                                     extra_body={"seed": 3})
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and len(r.output) == 1, r.output
        call = calls[0]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert call.name == "add" or choice == "required"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # a forced call has no text for text.format to shape: OpenAI takes both (instructor's RESPONSES_TOOLS sends both)
    r = rclient.responses.create(model=MODEL, input="add", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                                 text={"format": {"type": "json_schema", "name": "x", "schema": WEATHER}},
                                 max_output_tokens=120)
    jsonschema.validate(json.loads(r.output[0].arguments), SUM)


def test_a_streamed_call_and_its_result_sent_back(rclient):
    kw = {"model": MODEL, "tools": TOOLS, "max_output_tokens": 120, "temperature": 0}
    with rclient.responses.stream(input="weather in Paris?", tool_choice={"type": "function", "name": "get_weather"},
                                  **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert re.fullmatch(CALL_EVENTS, " ".join(e.type for e in events)), [e.type for e in events]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.call_id == done.call_id
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == done.arguments == final.output[0].arguments
    jsonschema.validate(json.loads(args), WEATHER)
    # the result goes back as a function_call_output item of the stored conversation
    r = rclient.responses.create(previous_response_id=final.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": done.call_id, "output": json.dumps({"temp_c": 18})}], **kw)
    assert [o.type for o in r.output] == ["message"]
    items = list(rclient.responses.input_items.list(r.id, order="asc"))
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == done.call_id and items[1].arguments == args


def test_auto_tool_calls_become_items_as_they_stream():
    """tool_choice "auto" reads calls out of the text with --tool-call-parser (hermes): content before a call is
    a message, each call a function_call item, and the stream fed a character at a time builds what the whole
    text builds."""
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    plan = ToolPlan("auto", [], parser=get_tool_parser("hermes"))
    whole = OutputBuilder(plan)
    whole.feed(text)
    whole.finish("stop")
    pieces = OutputBuilder(plan)
    events = [e for ch in text for e in pieces.feed(ch)] + pieces.finish("stop")
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole.items]
    assert strip == [{"type": "message", "role": "assistant", "status": "completed", "content": [
        {"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"}]
    assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in pieces.items] == strip
    kinds = [k for k, _ in events]
    assert kinds[0] == "response.output_item.added" and kinds.count("response.output_item.done") == 2
    assert "".join(f["delta"] for k, f in events if k == "response.function_call_arguments.delta") == \
        '{"city": "Paris"}'
    cut = OutputBuilder(plan)
    cut.feed(text[:-30])
    cut.finish("length")
    assert [i["status"] for i in cut.items] == ["completed", "incomplete"]


class City(BaseModel):
    name: str = Field(max_length=8)
    country: str = Field(max_length=8)


def test_text_format_json_schema_parses_into_the_model(rclient):
    schema = {"type": "object", "properties": {"name": S, "country": S}, "required": ["name", "country"]}
    r = rclient.responses.create(model=MODEL, input="a city", max_output_tokens=60, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"name", "country"}  # closed by default: no invented keys
    parsed = rclient.responses.parse(model=MODEL, input="a city", text_format=City, max_output_tokens=60,
                                     temperature=0)
    assert isinstance(parsed.output_parsed, City)


def test_a_continued_conversation_reuses_the_stored_tokens(rclient, prompts):
    """The continuation's prompt starts with the previous prompt and answer tokens themselves, so every full
    KV block of them (the answer's last token never had its KV computed) comes from the prefix cache. A prompt
    tokenized afresh from text would lose the random model's answer tokens, and with them these hits."""
    first = rclient.responses.create(model=MODEL, instructions="you are a poet", input="write about the sea " * 3,
                                     max_output_tokens=40, temperature=0)
    second = rclient.responses.create(model=MODEL, instructions="you are a poet", input="and the moon?",
                                      previous_response_id=first.id, max_output_tokens=8, temperature=0)
    p1, p2 = prompts[-2], prompts[-1]
    n_out = first.usage.output_tokens
    reused = (len(p1) + n_out - 1) // 16 * 16
    assert reused > len(p1) // 16 * 16  # the answer's tokens count, not only the first prompt's
    assert p2[:len(p1)] == p1 and second.usage.input_tokens == len(p2)
    assert second.usage.input_tokens_details.cached_tokens == reused
    third = rclient.responses.create(model=MODEL, input="once more", previous_response_id=second.id,
                                     max_output_tokens=4, temperature=0)  # no instructions: a new head, no hits
    assert third.usage.input_tokens_details.cached_tokens == 0 and third.instructions is None
    items = [i.type for i in rclient.responses.input_items.list(third.id, order="asc")]
    assert items == ["message"] * 5  # three inputs and two answers, earlier turns included
    pages = list(rclient.responses.input_items.list(third.id, limit=2))  # the SDK follows `after`, newest first
    assert [i.id for i in pages] == [i.id for i in rclient.responses.input_items.list(third.id, order="asc")][::-1]


def test_a_response_belongs_to_its_key_and_tenant(rserver, rclient):
    mine = rclient.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    with make_client(rserver, KEYS[1]) as other:
        for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                     lambda: list(other.responses.input_items.list(mine.id)),
                     lambda: other.responses.create(model=MODEL, input="x", previous_response_id=mine.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    alice = rclient.responses.create(model=MODEL, input="hi", max_output_tokens=2, user="alice")
    with pytest.raises(openai.NotFoundError) as e:
        rclient.responses.create(model=MODEL, input="x", previous_response_id=alice.id, user="bob")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):  # a read names its tenant too (the `user` rule: ?user=)
        rclient.responses.retrieve(alice.id)
    assert rclient.responses.retrieve(alice.id, extra_query={"user": "alice"}).id == alice.id
    assert rclient.responses.create(model=MODEL, input="x", previous_response_id=alice.id, user="alice",
                                    max_output_tokens=2).previous_response_id == alice.id
    rclient.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(mine.id)
    unstored = rclient.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body,status,param,says", [
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id", "resp_nope"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "'web_search'"),
    ({"tools": [TOOLS[0], {"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[1].type", "'file_search'"),
    ({"tools": [{"type": "image_generation"}]}, 400, "tools[0].type", "'image_generation'"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 8, "display_height": 8, "environment": "linux"}]},
     400, "tools[0].type", "'computer_use_preview'"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, 400, "input[0].type",
     "'computer_call_output'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0].type", "'input_image'"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice", "'web_search_preview'"),
    ({"background": True}, 400, "background", "background"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, 400, "tools[0].parameters",
     "tools[0].parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", "'nope'"),
    ({"max_output_tokens": 100000}, 400, "max_output_tokens", "maximum context length"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema", "schema"),
    ({"input": []}, 400, "input", "empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role", "role"),
    ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "metadata"),
])
def test_bad_requests_name_the_field(rserver, body, status, param, says):
    r = httpx.post(rserver.base_url + "/responses", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    ok = httpx.post(rserver.base_url + "/responses", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30,
                    json={"model": MODEL, "input": "still there?", "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_request_that_fails_alone_fails_in_the_responses_shape(rserver, rclient, monkeypatch):
    """A failure tied to one request (here its detokenizing): a 500 whole, or in the stream an `error` event and
    `response.failed` (the SDK's stream helper hands both out); the engine serves everyone else meanwhile."""
    engine = rserver.app.state.engine.client.engine
    real = engine.detok.decode_token

    def decode_token(req, token):
        if req.request_id.startswith("resp_"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected by the test")
        return real(req, token)

    monkeypatch.setattr(engine.detok, "decode_token", decode_token)
    with pytest.raises(openai.InternalServerError) as e:
        rclient.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert e.value.body["code"] == "request_failed"
    with rclient.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
        events = list(stream)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2].code == "request_failed" and "injected by the test" in events[2].message
    assert events[3].response.status == "failed" and events[3].response.error.code == "request_failed"
    assert [e.sequence_number for e in events] == [0, 1, 2, 3]
    chat = rclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].finish_reason in ("stop", "length")
    rserver.wait_idle()


def test_an_unwritable_store_loses_no_answer(tiny_llama, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = ServerArgs(responses_dir=str(blocker / "responses"))
    with run_server(tiny_config(tiny_llama), args) as s, make_client(s, "none") as c:
        with caplog.at_level(logging.WARNING, logger="conveyor.server.responses"):
            r = c.responses.create(model=MODEL, input="hello", max_output_tokens=4)
            streamed = c.responses.stream(model=MODEL, input="hello", max_output_tokens=4).__enter__()
            final = streamed.get_final_response()
        assert r.output_text is not None and final.usage.output_tokens == 4
        assert sum("answered but not stored" in m for m in caplog.messages) == 2, caplog.messages
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model=MODEL, input="x", previous_response_id=r.id)
        assert c.responses.create(model=MODEL, input="hello", max_output_tokens=2).status == "incomplete"


def test_the_store_keeps_its_bounds_and_owners(tmp_path):
    store = ResponseStore(tmp_path, max_stored=3, max_age_s=60.0)

    def row(i: int) -> StoredResponse:
        return StoredResponse(f"resp_{i}", {"id": f"resp_{i}", "output": []}, [], "prompt", [1, 2, i], [i])

    async def run() -> None:
        me, other = owner_key("k", "t"), owner_key("k", None)
        for i in range(5):
            assert await store.put(me, row(i))
        assert [await store.get(me, f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
        got = await store.get(me, "resp_4")
        assert (got.prompt_ids, got.output_ids, got.prompt_text) == ([1, 2, 4], [4], "prompt")
        assert await store.get(other, "resp_4") is None and not await store.delete(other, "resp_4")
        await store._run(store._put, me, row(9), time.time() - 61)  # older than max_age
        assert await store.get(me, "resp_9") is None
        assert await store.delete(me, "resp_4") and await store.get(me, "resp_4") is None

    asyncio.run(run())
    store.close()


def test_two_server_processes_share_the_store(tiny_llama, tmp_path):
    """What one server process stored, another reads and continues, also once the first has exited."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama), "--port", "0", "--kv-cache-memory",
           "0.01", "--max-model-len", "512", "--served-model-name", MODEL, "--dtype", "float32", "--api-key", "k",
           "--responses-dir", str(tmp_path), "--shutdown-timeout", "0.5"]
    procs = [popen_server(cmd) for _ in range(2)]
    try:
        urls = [bound_url(p) for p in procs]
        for proc, url in zip(procs, urls):
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, server_output(proc)
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not get ready"
                time.sleep(0.1)
        a, b = (openai.OpenAI(base_url=u + "/v1", api_key="k", max_retries=0, timeout=60) for u in urls)
        first = a.responses.create(model=MODEL, input="remember me", max_output_tokens=4, temperature=0)
        assert b.responses.retrieve(first.id).output == first.output
        procs[0].terminate()
        assert procs[0].wait(30) == 0
        more = b.responses.create(model=MODEL, input="and now?", previous_response_id=first.id, max_output_tokens=4)
        assert [i.type for i in b.responses.input_items.list(more.id)] == ["message"] * 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert "Traceback" not in server_output(procs[0]) + server_output(procs[1])
