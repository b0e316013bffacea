"""The OpenAI surface, driven by the official `openai` client against a real server."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MAX_MODEL_LEN, MODEL

GREEDY = {"temperature": 0.0}


def test_completion_basic(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, **GREEDY)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="Hello", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_n2_and_prompt_list(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Paris is"], n=2, max_tokens=5, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20
    # seeded sampling is reproducible
    r2 = client.completions.create(model=MODEL, prompt=["Hello", "Paris is"], n=2, max_tokens=5, temperature=1.0,
                                   seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]


def test_completion_stream_n2(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    by_index: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index].append(ch)
    for choices in by_index.values():
        assert choices[-1].finish_reason == "length"


def test_completion_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Berlin is the", max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    stop = next((base[i:i + 2] for i in range(3, len(base) - 1) if base[i:i + 2].strip() and base[i:i + 2].isprintable()
                 and base[i:i + 2] not in base[:i]), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {base!r}")
    r = client.completions.create(model=MODEL, prompt="Berlin is the", max_tokens=24, stop=[stop],
                                  extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].model_extra.get("stop_reason") == stop
    streamed = list(client.completions.create(model=MODEL, prompt="Berlin is the", max_tokens=24, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith("Hello world")
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    # prompt tokens: logprobs from the prefill (the first token has none), with their top-3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:n_prompt])
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs[1:n_prompt])
    gen = lp.token_logprobs[n_prompt:]
    assert all(x <= 0 for x in gen)
    for top, tok_lp in zip(lp.top_logprobs[n_prompt:], gen):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(tok_lp)  # greedy: sampled is the best


def test_completion_token_id_prompts(client, server):
    ids = [5, 17, 42, 99, 7]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    assert r.usage.prompt_tokens == 5
    r2 = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, **GREEDY)
    assert len(r2.choices) == 2 and r2.usage.prompt_tokens == 8
    assert r2.choices[0].text == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, **GREEDY)
    tok = server.app.state.serving.tokenizer
    assert echo.choices[0].text.startswith(tok.decode(ids))


def test_chat_basic_and_stream(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, extra_body={"ignore_eos": True},
                                       **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_max_completion_tokens_is_a_synonym(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0,
                                       max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2, n=2, temperature=0.8, seed=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 4
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_chat_content_parts_and_vllm_extras(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                                              "text": "there"}]}],
        max_tokens=5, presence_penalty=0.5, frequency_penalty=0.5, user="u1",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5, "priority": 1,
                    "ignore_eos": False, "some_unknown_field": 1})
    assert r.usage.completion_tokens == 5


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    m = server.scrape()
    for name in ("conveyor:num_requests_running", "conveyor:num_requests_waiting", "conveyor:kv_cache_usage_perc",
                 "conveyor:kv_cache_blocks_used", "conveyor:kv_cache_blocks_total", "conveyor:prompt_tokens_total",
                 "conveyor:generation_tokens_total", "conveyor:num_preemptions_total",
                 "conveyor:prefix_cache_queries_total", "conveyor:prefix_cache_hits_total",
                 "conveyor:engine_steps_total", "conveyor:engine_step_seqs_total",
                 "conveyor:request_success_total{finished_reason=length}",
                 "conveyor:time_to_first_token_seconds_count", "conveyor:inter_token_latency_seconds_count",
                 "conveyor:e2e_request_latency_seconds_count", "conveyor:request_queue_time_seconds_count"):
        assert name in m, name
    assert m["conveyor:generation_tokens_total"] >= 3 and m["conveyor:time_to_first_token_seconds_count"] >= 1
    assert m["conveyor:kv_cache_blocks_total"] > 0
    # what the weights and the KV cache are stored as, and the pool's capacity in tokens
    block_size = next(int(k.split("=")[1][:-1]) for k in m if k.startswith("conveyor:model_config_info{block_size="))
    assert m["conveyor:kv_cache_capacity_tokens"] == m["conveyor:kv_cache_blocks_total"] * block_size
    assert any(k.startswith("conveyor:model_config_info{weight_dtype=") for k in m)
    assert any(k.startswith("conveyor:model_config_info{kv_cache_dtype=") for k in m)
    # every engine option, generated from EngineConfig's declaration
    assert any(k.startswith("conveyor:engine_config_info{max_num_seqs=") for k in m)
    assert any(k.startswith("conveyor:engine_config_info{scheduler=") for k in m)
