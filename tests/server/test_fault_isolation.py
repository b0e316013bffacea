"""A failure tied to one request fails that request alone: a 500 in OpenAI's shape (or an error event in
its stream), its blocks freed, the engine alive, and every other request served."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conveyor.runner import model_runner

from .conftest import MODEL

POISON = 377  # a prompt that starts with this token id fails


@pytest.fixture()
def poisoned_detokenizer(server, monkeypatch):
    engine = server.app.state.engine.client.engine
    real = engine.detok.decode_token

    def decode_token(req, token):
        if req.prompt_token_ids[0] == POISON:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected by the test")
        return real(req, token)

    monkeypatch.setattr(engine.detok, "decode_token", decode_token)


def _poison_logits(monkeypatch, value: float) -> None:
    """Every logit row of a request whose prompt starts with POISON becomes `value` (NaN, inf)."""
    real = model_runner.sample

    def sample(logits, reqs, grammar=None, positions=None):
        for i, r in enumerate(reqs):
            if r.prompt_token_ids[0] == POISON:
                logits[i] = value
        return real(logits, reqs, grammar, positions)

    monkeypatch.setattr(model_runner, "sample", sample)


@pytest.fixture()
def poisoned_logits(monkeypatch):
    _poison_logits(monkeypatch, float("nan"))


def _good(client, i: int) -> str:
    r = client.completions.create(model=MODEL, prompt=[5 + i, 6, 7, 8], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


@pytest.mark.parametrize("fault", ["poisoned_detokenizer", "poisoned_logits"])
def test_one_failing_request_leaves_the_rest_served(server, client, fault, request):
    request.getfixturevalue(fault)
    bad_prompt = [POISON, 6, 7, 8]
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(_good, client, i) for i in range(6)]
        r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": MODEL, "prompt": bad_prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "request_failed" and err["type"] == "internal_error"
        with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(), timeout=60,
                          json={"model": MODEL, "prompt": bad_prompt, "max_tokens": 12, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events and events[-1]["error"]["code"] == "request_failed"
        assert all(len(g.result()) > 0 for g in goods)
    m = server.wait_idle()
    assert m["conveyor:engine_alive"] == 1 and m["conveyor:kv_cache_blocks_used"] == 0
    assert _good(client, 99)  # and the engine still serves


def test_offline_generate_reports_the_failed_request(tiny_llama, monkeypatch):
    from conveyor import LLM, SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256)
    _poison_logits(monkeypatch, float("inf"))
    outs = llm.generate([{"prompt_token_ids": [POISON, 5]}, {"prompt_token_ids": [9, 5]}],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    assert llm.engine.snapshot().kv_blocks_used == 0
