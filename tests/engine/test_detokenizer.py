"""Incremental detokenization: streamed text is the decoded text, and never splits a character.

The tiny tokenizer is byte-level BPE trained on a little CJK and emoji, so many of those characters
span several tokens; a naive per-token decode would stream U+FFFD halves.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from conveyor.engine.output_processor import Detokenizer
from conveyor.request import Request, make_request

MULTIBYTE = "日本語のテキストと中文文本 🎉🚀😀 café, naïve. 😀 ok 中文"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_model_len=256)


def feed(detok: Detokenizer, req: Request, ids: list[int], final_at_end: bool = True) -> list[str]:
    """Drive the detokenizer exactly as the engine's `_update` does; return the streamed chunks."""
    chunks = []
    for i, t in enumerate(ids):
        req.output_token_ids.append(t)
        req.output_text += detok.decode_token(req, t)
        chunks.append(detok.take_new_text(req, final=final_at_end and i == len(ids) - 1))
    return chunks


def test_multibyte_characters_are_never_split(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # guard: the string really has characters split across tokens
    assert sum(REPLACEMENT in tok.decode([i]) for i in ids) >= 5
    for prompt_text in ("Hello", "日本"):  # the prompt context must not leak into the output either
        req = Request("r", tok.encode(prompt_text, add_special_tokens=False), SamplingParams())
        chunks = feed(Detokenizer(tok), req, ids)
        assert "".join(chunks) == MULTIBYTE
        assert not any(REPLACEMENT in c for c in chunks), chunks
        assert req.output_text == MULTIBYTE
        assert sum(1 for c in chunks if c == "") >= 3  # bytes were held back, then released whole


def test_special_tokens_are_skipped_or_kept(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello world!", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        req = Request("r", [tok.bos_token_id], SamplingParams(skip_special_tokens=skip))
        text = "".join(feed(Detokenizer(tok), req, ids))
        assert text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_stop_string_hold_back_never_streams_a_partial_stop(llm):
    """While running, the last len(stop) - 1 characters wait, so a stop string is never half-sent."""
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    req = Request("r", [tok.bos_token_id], SamplingParams(stop=["lazy dog"]))
    detok = Detokenizer(tok)
    streamed = ""
    for t in ids:
        req.output_token_ids.append(t)
        req.output_text += detok.decode_token(req, t)
        streamed += detok.take_new_text(req, final=False)
        assert len(streamed) <= max(0, len(req.output_text) - (len("lazy dog") - 1))
        assert "lazy" not in streamed
    assert (streamed + detok.take_new_text(req, final=True)) == text


def test_engine_text_equals_batch_decode(llm):
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    words = ["The", "quick", "brown", "fox", "Paris", "日本語", "🎉", "café", "Hello", "world"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 8))) for _ in range(24)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    exact = 0
    for o in outs:
        c = o.outputs[0]
        ref = tok.decode(c.token_ids, skip_special_tokens=True)
        if c.text == ref:
            exact += 1
        else:
            # the only allowed difference: an incomplete character at the very end is not emitted
            assert ref.startswith(c.text) and set(ref[len(c.text):]) == {REPLACEMENT}, (c.text, ref)
    assert exact >= len(outs) // 2


def test_streamed_deltas_add_up_to_the_final_text(llm):
    """Drive the engine step by step as the server does: the deltas concatenate to the output text,
    and a chunk has no more U+FFFD than the whole decode (no character is split across chunks)."""
    tok = llm.get_tokenizer()
    eng = llm.engine
    prompts = ["日本語のテキスト", "Hello world! How are you", "emoji 🎉🚀", "café naïve"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e"]))
    reqs = [eng.add_request(make_request(tok.encode(p), sp))[0] for p, sp in zip(prompts, params)]
    chunks: dict[str, list[str]] = {r.request_id: [] for r in reqs}
    finished = set()
    while eng.has_unfinished_requests():
        for d in eng.step().deltas:
            assert d.request_id not in finished
            chunks[d.request_id].append(d.new_text)
            if d.finished:
                finished.add(d.request_id)
    assert finished == set(chunks)
    for r in reqs:
        joined = "".join(chunks[r.request_id])
        assert joined == r.output_text
        ref = tok.decode(r.output_token_ids, skip_special_tokens=True)
        if r.params.stop_list:
            assert "e" not in joined and r.finish_reason in ("stop", "length")
        else:
            assert ref.startswith(joined)
            assert joined.count(REPLACEMENT) <= ref.count(REPLACEMENT)
