"""Structured outputs in the engine: the bitmask kernel against its torch reference, grammars
compiled once, and constrained outputs that batching, preemption and n > 1 do not change."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.runner.grammar_mask import GrammarMask
from conveyor.sampling_params import close_objects

SCHEMA = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["k", "n"], "additionalProperties": False}


@pytest.mark.parametrize("vocab", [64, 100, 401])
def test_bitmask_kernel_matches_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 - (1 if vocab == 401 else 0)  # 401: a mask shorter than the vocabulary
    bits = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bits[1] = -1  # a row that allows everything
    logits = torch.randn(5, vocab, generator=g)
    mask = GrammarMask([4, 0, 2], bits)
    fast, ref = logits.clone(), logits.clone()
    mask.apply(fast)
    if vocab == 401:  # the reference needs a full-width mask: pad with zeros (banned), as the kernel treats it
        mask = GrammarMask(mask.rows, torch.cat([bits, torch.zeros(3, 1, dtype=torch.int32)], dim=1))
    mask.apply_reference(ref)
    assert torch.equal(fast, ref)
    assert torch.equal(fast[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched
    assert torch.isinf(fast[4]).any() and not torch.isinf(fast[0][: 32 * words]).any()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=160, max_model_len=512)


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def test_outputs_follow_the_schema_and_do_not_depend_on_the_batch(llm):
    prompts = [[5 + i, 9, 11 + i] for i in range(6)]
    params = [_params(temperature=0), _params(temperature=1.0, seed=7)] * 3
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    together = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(alone, together):
        assert a.finish_reason == "stop" and a.token_ids == b.token_ids
        obj = json.loads(a.text)
        assert set(obj) == {"k", "n"} and 0 <= obj["n"] <= 999
    compiled = llm.engine.structured.compiled_count
    llm.generate(prompts[:2], [_params(temperature=0)] * 2, use_tqdm=False)
    assert llm.engine.structured.compiled_count == compiled  # the same schema is compiled once


def test_preemption_and_n_keep_each_sequence_in_its_grammar(tiny_llama, llm):
    """A pool too small for the batch forces recompute-preemption mid-output; the matcher, which
    only follows sampled tokens, must carry on exactly where the sequence was."""
    regex = StructuredOutputsParams(regex="(ab|cd){40,60}")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, n=2, structured_outputs=regex)
              for s in range(4)]
    prompts = [list(range(20 + i, 60 + i)) for i in range(4)]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=14, max_model_len=200)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        for x, y in zip(a.outputs, b.outputs):
            assert re.fullmatch("(ab|cd){40,60}", x.text), x.text
            assert x.token_ids == y.token_ids


def test_invalid_constraints_raise_before_the_engine():
    for kw in ({"json": {"type": "objekt"}}, {"regex": "(a"}, {"choice": []}, {"grammar": "start: x"},
               {"json": {"type": "object"}, "regex": "a"}, {}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**kw)


OPEN = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4},
                                         "sub": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def test_objects_that_list_their_properties_are_closed_by_default(llm):
    """A schema that says nothing about other keys gets only its own (vLLM's xgrammar and OpenAI's strict
    mode do the same); `additionalProperties: true` keeps JSON Schema's open object. Random sampling on
    the random model: the open schema does get invented keys, so the closed run proves the default."""
    prompts = [[7 + i, 3, 9] for i in range(8)]

    def keys(schema: dict) -> list[tuple[set, set]]:
        sp = SamplingParams(temperature=1.0, seed=11, max_tokens=120, n=4,
                            structured_outputs=StructuredOutputsParams(json=schema))
        out = []
        for o in llm.generate(prompts, [sp] * len(prompts), use_tqdm=False):
            for c in o.outputs:
                if c.finish_reason == "stop":
                    obj = json.loads(c.text)
                    out.append((set(obj), set(obj.get("sub", {}) if isinstance(obj.get("sub"), dict) else {})))
        return out

    closed = keys(OPEN)
    assert len(closed) >= 16 and all(k <= {"k", "sub"} and s <= {"x"} for k, s in closed), closed
    opened = keys({**OPEN, "additionalProperties": True})
    assert any(not k <= {"k", "sub"} for k, _ in opened), opened


def test_close_objects_leaves_what_the_schema_decides():
    assert close_objects(OPEN) == {**OPEN, "additionalProperties": False, "properties": {
        "k": OPEN["properties"]["k"], "sub": {**OPEN["properties"]["sub"], "additionalProperties": False}}}
    kept = [{"type": "object"},  # any object
            {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
            {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
            {"properties": {"a": {}}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
            {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},  # each holds part of them
            {"type": "array", "items": {"type": "string"}}]
    for schema in kept:
        assert close_objects(schema) == schema
    nested = {"$defs": {"P": {"properties": {"a": {}}}}, "anyOf": [{"$ref": "#/$defs/P"}, {"properties": {"b": {}}}],
              "items": [{"properties": {"c": {}}}], "allOf": [{"properties": {"d": {}}}]}
    got = close_objects(nested)
    assert got["$defs"]["P"]["additionalProperties"] is False
    assert got["anyOf"][1]["additionalProperties"] is False and "additionalProperties" not in got["anyOf"][0]
    assert got["items"][0]["additionalProperties"] is False
    assert got["allOf"][0]["additionalProperties"] is False  # a lone allOf member is the whole object
    assert "additionalProperties" not in got and nested["$defs"]["P"] == {"properties": {"a": {}}}  # a copy
