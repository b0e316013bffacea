"""Structured outputs over HTTP with the official client: 20 JSON schemas of varied shapes, streaming and
not, in one batch with unconstrained requests; regex and choice; every malformed constraint a 400.

The tiny random model knows nothing about JSON, so every valid answer here is the grammar's doing;
every schema bounds its strings, arrays and numbers so that even a random walk through the grammar
ends well within max_tokens.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from .conftest import MODEL

NAME = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": {"type": "string",
                                                                           "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["id", "email"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                      "ok": {"type": "boolean"}}, "required": ["x", "ok"],
     "additionalProperties": False},
    {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "note": NAME,
                                      "tag": {"enum": ["a", "b"]}}, "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"const": "v1"}, "n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 5}},
     "required": ["version", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                                                      {"type": "string", "maxLength": 5}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 8}}, "required": ["maybe"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": [1, 2, 3]}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
     "items": False, "minItems": 2},
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 10}},
     "required": ["size", "qty"], "additionalProperties": False},
    {"type": "object", "properties": {"t": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["t"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}},
                      "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"orders": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"item": {"enum": ["tea", "cake"]}, "paid": {"type": "boolean"}},
        "required": ["item", "paid"], "additionalProperties": False}}}, "required": ["orders"],
     "additionalProperties": False},
]
assert len(SCHEMAS) == 20


def _fmt(schema: dict, i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_twenty_schemas_streaming_and_not_beside_unconstrained_requests(client, server):
    """All in flight at once: 20 chat requests, 20 streamed completions (sampled, seeded) and 10
    unconstrained requests share the engine's steps; every constrained answer validates."""

    def chat(i: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"give JSON {i}"}],
                                           max_tokens=400, temperature=0, response_format=_fmt(SCHEMAS[i], i))
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    def streamed(i: int) -> str:
        parts = []
        for c in client.completions.create(model=MODEL, prompt=f"JSON number {i}:", max_tokens=400, temperature=1.0,
                                           seed=i, stream=True, extra_body={"guided_json": SCHEMAS[i]}):
            parts.append(c.choices[0].text)
            last = c.choices[0].finish_reason
        assert last == "stop"
        return "".join(parts)

    def free(i: int) -> str:
        r = client.completions.create(model=MODEL, prompt=f"plain {i}", max_tokens=40, temperature=1.0, seed=i)
        return r.choices[0].text

    with ThreadPoolExecutor(32) as pool:
        chats = [pool.submit(chat, i) for i in range(20)]
        streams = [pool.submit(streamed, i) for i in range(20)]
        frees = [pool.submit(free, i) for i in range(10)]
        for i, (c, s) in enumerate(zip(chats, streams)):
            _check(c.result(), SCHEMAS[i])
            _check(s.result(), SCHEMAS[i])
        unconstrained = [f.result() for f in frees]
    assert sum(t.lstrip().startswith(("{", "[")) for t in unconstrained) < 5  # they were not constrained
    server.wait_idle()


def test_regex_choice_grammar_and_n(client):
    r = client.completions.create(model=MODEL, prompt="phone:", max_tokens=30, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    choices = ["yes", "no", 'it "depends"']
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}], max_tokens=20,
                                       temperature=1.0, n=4, seed=1, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"grammar": 'start: "a"+ "b"'}})
    assert re.fullmatch("a+b", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "(cat|dog)s?"}})
    assert re.fullmatch("(cat|dog)s?", r.choices[0].text)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": '{"type": "object", '}, "guided_json"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: a b"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_malformed_constraints_are_a_400(server, body, param):
    for path, base in (("/completions", {"prompt": "hi"}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server.base_url + path, json={**base, "max_tokens": 4, **body}, headers=server.headers())
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    m = server.wait_idle()
    assert m["conveyor:kv_cache_blocks_used"] == 0
