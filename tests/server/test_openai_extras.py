"""More of the OpenAI / vLLM surface: logit_bias, cached-token usage, /tokenize and /detokenize,
unsupported fields refused by name, and `conveyor bench run` against a server that wants a key."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL

GREEDY = {"temperature": 0.0}


def test_logit_bias_bans_and_forces_tokens(client, server):
    tok = server.app.state.serving.tokenizer
    prompt = [5, 6, 7, 8]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=0,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    first = plain.choices[0].logprobs.tokens[0]
    # every token id whose text is the greedy first token's (the API returns text, not ids)
    same_text = [i for i in range(len(tok)) if tok.decode([i]) == first]
    assert same_text
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=0,
                                       logit_bias={str(i): -100 for i in same_text},
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = 42
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 5


def test_bad_logit_bias_is_a_400(client):
    for bias, why in (({"x": 1}, "token ids"), ({"999999": 1}, "token ids"), ({"5": 101}, "[-100, 100]")):
        with pytest.raises(openai.BadRequestError, match="logit_bias") as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias=bias)
        assert why in str(e.value)


def test_usage_reports_cached_prompt_tokens(client):
    prompt = list(range(300, 300 + 70))  # 4 full blocks of 16 + a partial one
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 64


def test_tokenize_and_detokenize(server):
    h = server.headers()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, headers=h).json()["prompt"]
    assert "Hello world" in back
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert chat.status_code == 200 and chat.json()["count"] > 2
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # same key rules
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
                      headers=h)
    assert both.status_code == 400


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("suffix", "tail"), ("best_of", 3), ("tool_choice", "auto")])
def test_unsupported_fields_are_refused_by_name(server, field, value):
    chat = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    # chat serves tools (tests/server/test_tools.py); completions has none
    for path, body in (("/v1/completions", {"prompt": "hi"}),) + ((chat,) if field not in ("tools", "tool_choice")
                                                                  else ()):
        r = httpx.post(server.base_url + path[3:], json={**body, "max_tokens": 2, field: value},
                       headers=server.headers())
        assert r.status_code == 400, (path, field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"]


def test_harmless_values_of_unsupported_fields_pass(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "text"}, tool_choice="none", **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bench_run_against_a_keyed_server(server, tiny_llama, tmp_path, monkeypatch):
    from conveyor.bench.cli import main as bench_main

    argv = ["run", "--url", server.url, "--model", str(tiny_llama), "--served-model", MODEL, "--dtype", "float32",
            "--concurrency", "2", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
            "--no-progress", "--out", str(tmp_path / "r.json")]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    assert bench_main(argv + ["--api-key", API_KEY]) == 0
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the key from the environment, as the openai client takes it
    assert bench_main(argv) == 0


def test_prompt_logprobs_over_http_match_offline(server, tiny_llama):
    """vLLM's `prompt_logprobs` extra: one entry per prompt token (None first), as `LLM.generate` gives."""
    from conveyor import LLM, SamplingParams

    prompt = [5, 17, 42, 99, 7, 8, 9]
    r = httpx.post(server.base_url + "/completions", headers=server.headers(),
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, **GREEDY})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=128)
    ref = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                       use_tqdm=False)[0].prompt_logprobs
    for got, want, tok in zip(plp[1:], ref[1:], prompt[1:]):
        assert abs(got[str(tok)]["logprob"] - want[tok]) < 1e-3
    # streamed: each choice's first chunk carries them (n=2: both choices, the same entries)
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(),
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1, "n": 2,
                            "stream": True, "temperature": 1.0, "seed": 1}) as stream:
        assert stream.status_code == 200
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    firsts = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch.get("prompt_logprobs") is not None:
                assert ch["index"] not in firsts  # only once per choice
                firsts[ch["index"]] = ch["prompt_logprobs"]
    assert set(firsts) == {0, 1}
    for got in firsts.values():
        assert len(got) == len(prompt) and got[0] is None
        for g, want, tok in zip(got[1:], ref[1:], prompt[1:]):
            assert abs(g[str(tok)]["logprob"] - want[tok]) < 1e-3
