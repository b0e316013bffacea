"""LoRA adapters over the OpenAI API, as vLLM serves them: `--lora-modules`, the request's `model` naming
the adapter, `/v1/models` with parents, runtime load/unload behind a flag and the API key, clear
errors (startup error, 400, 404) that leave the server serving the others, and /metrics per adapter.

One server (tiny model, three adapters, at most two per step and two loaded) serves every test here.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from conveyor import LLM, SamplingParams
from conveyor.lora import LoRARequest
from conveyor.server.api_server import ServerArgs, build_app
from tests.engine.insides import lora_weights_held
from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter, merged_reference
from tests.server.conftest import API_KEY, MODEL, run_server, tiny_config

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-adapters")
    specs = {"sql": (8, ALL_PROJECTIONS), "chat": (4, ["q_proj", "v_proj", "down_proj"]),
             "poem": (16, ["gate_proj", "up_proj", "o_proj"]), "late": (4, ["k_proj", "up_proj"]),
             "wide": (32, ["q_proj"])}
    return {name: make_adapter(tiny_llama, root / name, r, t, seed=20 + i) for i, (name, (r, t)) in
            enumerate(specs.items())}


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapter_dirs):
    cfg = tiny_config(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    args = ServerArgs(api_key=API_KEY, allow_runtime_lora_updating=True, max_queued_requests=512,
                      lora_modules=[f"{n}={adapter_dirs[n]}" for n in ("sql", "chat")]
                      + [json.dumps({"name": "poem", "path": str(adapter_dirs["poem"])})])
    with run_server(cfg, args) as s:
        yield s


@pytest.fixture()
def lclient(lora_server):
    with openai.OpenAI(base_url=lora_server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The offline engine, the bridge from HF token ids to the server's text (same detokenizer)."""
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=4)


def offline_text(llm: LLM, ref, lora: LoRARequest | None, prompt: list[int]) -> str:
    """The text the offline engine makes of `prompt` under `lora`, after checking its tokens against HF +
    peft (`ref`: the adapter merged into the base)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
    assert out.outputs[0].token_ids == hf_greedy(ref, prompt, MAX_TOKENS)
    return out.outputs[0].text


def _post(srv, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _greedy(srv, model: str, prompt: list[int]) -> list[int]:
    r = _post(srv, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_models_lists_base_and_adapters_with_parent(lclient, adapter_dirs):
    cards = {m.id: m for m in lclient.models.list().data}
    assert set(cards) >= {MODEL, "sql", "chat", "poem"}
    assert getattr(cards[MODEL], "parent", None) is None
    for name in ("sql", "chat", "poem"):
        assert cards[name].parent == MODEL and cards[name].root == str(adapter_dirs[name])


def test_mixed_adapter_requests_match_hf_peft(lora_server, tiny_llama, hf_tiny, adapter_dirs, offline):
    """12 concurrent requests over three adapters and the base (at most two adapters per step, two
    loaded): each greedy text is that of HF + peft's tokens with its adapter merged."""
    rng = random.Random(5)
    vocab = hf_tiny.config.vocab_size
    jobs = [(m, [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))])
            for m in ["sql", "chat", "poem", MODEL] * 3]
    refs = {n: merged_reference(tiny_llama, adapter_dirs[n]) for n in ("sql", "chat", "poem")}
    refs[MODEL] = hf_tiny
    loras = {n: LoRARequest(n, i + 1, str(adapter_dirs[n])) for i, n in enumerate(("sql", "chat", "poem"))}
    want = [offline_text(offline, refs[m], loras.get(m), p) for m, p in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _greedy(lora_server, *job), jobs))
    assert got == want
    assert len({w for (m, _), w in zip(jobs, want) if m != MODEL}) > 1


def test_unknown_adapter_is_404_and_others_still_served(lclient):
    with pytest.raises(openai.NotFoundError) as e:
        lclient.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        lclient.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "x"}])
    out = lclient.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.model == "chat" and out.choices[0].finish_reason in ("stop", "length")


def test_runtime_load_errors_are_400(lora_server, adapter_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs["late"], broken)
    (broken / "adapter_config.json").write_text("{oops")
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "does not exist"),
             ({"lora_name": "x", "lora_path": str(adapter_dirs["wide"])}, "above --max-lora-rank 16"),
             ({"lora_name": "x", "lora_path": str(broken)}, "not valid JSON"),
             ({"lora_name": "sql", "lora_path": str(adapter_dirs["late"])}, "already been loaded"),
             ({"lora_name": MODEL, "lora_path": str(adapter_dirs["late"])}, "already been loaded"),
             ({"lora_path": str(adapter_dirs["late"])}, "lora_name")]
    for body, message in cases:
        r = _post(lora_server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["late"])},
                 key=None).status_code == 401
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}).status_code == 404
    assert _greedy(lora_server, "sql", [1, 2, 3])  # still serving


def test_runtime_load_use_unload(lora_server, lclient, tiny_llama, adapter_dirs, offline):
    path = adapter_dirs["late"]
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in lclient.models.list().data}
    prompt = [7, 8, 9, 10, 11]
    want = offline_text(offline, merged_reference(tiny_llama, path), LoRARequest("late", 9, str(path)), prompt)
    assert _greedy(lora_server, "late", prompt) == want
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert "late" not in {m.id for m in lclient.models.list().data}
    with pytest.raises(openai.NotFoundError):
        lclient.completions.create(model="late", prompt=prompt, max_tokens=2)


def test_metrics_per_adapter(lora_server):
    before = lora_server.scrape()
    for model in ("sql", "sql", "chat"):
        _greedy(lora_server, model, [3, 4, 5])
    m = lora_server.wait_idle()
    key = "conveyor:lora_requests_total{lora_name=%s}"
    assert m[key % "sql"] - before.get(key % "sql", 0) == 2
    assert m[key % "chat"] - before.get(key % "chat", 0) == 1
    text = httpx.get(lora_server.url + "/metrics").text
    assert 'conveyor:lora_requests_info{max_lora="2"' in text


def test_load_unload_under_load_loses_nothing(lora_server, adapter_dirs):
    """50 runtime load/unload cycles while requests for the other adapters keep flowing: every request
    finishes, and the engine holds no more adapters (nor memory) than before."""
    engine = lora_server.app.state.engine.client.engine
    stop = False
    results: list[int] = []

    def traffic() -> None:
        i = 0
        while not stop:
            model = ("sql", "chat", "poem", MODEL)[i % 4]
            r = _post(lora_server, "/v1/completions", {"model": model, "prompt": [5 + i % 50, 6, 7],
                                                       "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            results.append(r.status_code)
            i += 1

    rss = []
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(traffic) for _ in range(3)]
        try:
            for i in range(60):  # 10 to warm up (oneDNN's per-shape kernels, connections), then 50 measured
                if i % 10 == 0:
                    gc.collect()
                    rss.append(psutil.Process().memory_info().rss)
                assert _post(lora_server, "/v1/load_lora_adapter",
                             {"lora_name": "cycled", "lora_path": str(adapter_dirs["late"])}).status_code == 200
                if i % 5 == 0:  # use it now and then, so that an unload meets it running
                    assert _greedy(lora_server, "cycled", [9, 9, i])
                assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "cycled"}).status_code == 200
        finally:
            stop = True
        for f in futures:
            f.result()
    lora_server.wait_idle()
    assert results and set(results) == {200}, sorted(set(results))
    gc.collect()
    rss.append(psutil.Process().memory_info().rss)
    print("RSS MB every 10 cycles:", [r >> 20 for r in rss])
    assert rss[-1] <= 1.05 * rss[1], [r >> 20 for r in rss]
    snap = lora_server.scrape()
    assert snap["conveyor:num_requests_running"] == 0
    loaded = {r.lora_name for r in engine.list_loras()}  # read between steps: the loop is idle
    assert "cycled" not in loaded and len(loaded) <= 2
    assert lora_weights_held(engine) <= {r.lora_int_id for r in engine.list_loras()}


@pytest.mark.parametrize("case", ["missing", "rank", "malformed", "no-enable-lora", "bad-flag"])
def test_bad_lora_modules_stop_startup(tiny_llama, adapter_dirs, tmp_path, case):
    modules = {"missing": [f"a={tmp_path / 'nope'}"], "rank": [f"a={adapter_dirs['wide']}"],
               "malformed": [f"a={tmp_path}"], "no-enable-lora": [f"a={adapter_dirs['sql']}"],
               "bad-flag": ["just-a-name"]}[case]
    cfg = tiny_config(tiny_llama, enable_lora=case != "no-enable-lora", num_kv_blocks=40)
    message = {"missing": "does not exist", "rank": "above --max-lora-rank", "malformed": "no adapter_config.json",
               "no-enable-lora": "--enable-lora", "bad-flag": "expected name=path"}[case]
    with pytest.raises(ValueError, match=message):
        build_app(cfg, ServerArgs(lora_modules=modules))


def test_runtime_routes_are_off_without_the_flag(tiny_llama, adapter_dirs):
    cfg = tiny_config(tiny_llama, enable_lora=True, num_kv_blocks=40)
    with run_server(cfg, ServerArgs(lora_modules=[f"sql={adapter_dirs['sql']}"])) as srv:
        r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["late"])})
        assert r.status_code == 404
        assert _greedy(srv, "sql", [1, 2])


def test_unknown_adapter_404_is_openais_error_body_streamed_or_not(lora_server):
    """vLLM answers an unknown `model` with 404; the body is OpenAI's error object (message naming the
    model, type, param, code), also for a streaming request (before any event), and for both endpoints."""
    for path, body in (("/v1/completions", {"prompt": [1, 2, 3]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            r = _post(lora_server, path, {"model": "no-such-adapter", "max_tokens": 2, "stream": stream, **body})
            assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), r.text
            assert r.json() == {"error": {"message": "The model `no-such-adapter` does not exist.",
                                          "type": "invalid_request_error", "param": "model",
                                          "code": "model_not_found"}}
    for model in ("sql", "chat", "poem", MODEL):  # every other model still served
        assert _greedy(lora_server, model, [4, 5, 6])


def test_unloading_an_adapter_mid_stream_loses_none_of_its_requests(lora_server, adapter_dirs):
    """Requests already running under an adapter that is unloaded finish in full; new ones get 404; the
    weights go once they are done."""
    engine = lora_server.app.state.engine.client.engine
    assert _post(lora_server, "/v1/load_lora_adapter",
                 {"lora_name": "going", "lora_path": str(adapter_dirs["late"])}).status_code == 200
    started = threading.Barrier(5)
    results: list[tuple[int, str | None, int]] = []
    last_token: dict[int, float] = {}

    def stream(i: int) -> None:
        body = {"model": "going", "prompt": [11, 12, i], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        finish, tokens, first = None, 0, True
        with httpx.stream("POST", lora_server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first:
                    first = False
                    started.wait(60)
                for c in chunk.get("choices") or ():
                    finish = c.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                last_token[i] = time.monotonic()
            results.append((r.status_code, finish, tokens))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        started.wait(60)  # every stream has its first token: all four run under the adapter now
        assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "going"}).status_code == 200
        unloaded = time.monotonic()
        r = _post(lora_server, "/v1/completions", {"model": "going", "prompt": [1], "max_tokens": 2})
        assert r.status_code == 404
        for f in futures:
            f.result()
    assert results == [(200, "length", 200)] * 4
    assert max(last_token.values()) > unloaded  # they really were running when the adapter was unloaded
    lora_server.wait_idle()
    assert "going" not in {r.lora_name for r in engine.list_loras()}
    assert _greedy(lora_server, "sql", [1, 2, 3])
