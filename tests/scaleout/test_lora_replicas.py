"""LoRA adapters behind `serve --replicas 2`: the flags reach every replica, a request's `model` picks the
adapter on whichever replica answers, `/v1/models` lists the adapters, runtime load/unload reach every
replica, and a bad `--lora-modules` entry stops the command before Ray starts.

The real run is skipped, with the reason, where Ray cannot start a local instance (as test_ray_serve.py).
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from conveyor import LLM, SamplingParams
from conveyor.cli import build_parser, main
from conveyor.config import EngineConfig
from conveyor.scaleout.lora import check_lora_modules, lora_affinity_key
from conveyor.server.api_server import ServerArgs

from ..server.conftest import MODEL
from .conftest import ReplicatedServer

MAX_TOKENS = 6


def test_lora_flags_reach_the_replicas_server_args(tiny_llama, adapter_dirs):
    """What each replica is built from (`ServerArgs.from_namespace` of the serve flags) holds the adapters."""
    args = build_parser().parse_args(["serve", "--replicas", "2", "--model", str(tiny_llama), "--enable-lora",
                                      "--max-loras", "2", "--lora-modules", f"a={adapter_dirs['a']}",
                                      f"b={adapter_dirs['b']}", "--allow-runtime-lora-updating"])
    sargs = ServerArgs.from_namespace(args)
    assert sargs.lora_modules == [f"a={adapter_dirs['a']}", f"b={adapter_dirs['b']}"]
    assert sargs.allow_runtime_lora_updating
    assert args.enable_lora and args.max_loras == 2


@pytest.mark.parametrize("case", ["no-enable-lora", "missing", "rank", "malformed", "duplicate", "bad-flag"])
def test_bad_lora_modules_stop_serve_replicas_before_ray(tiny_llama, adapter_dirs, tmp_path, case, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs["c"], broken)
    (broken / "adapter_config.json").write_text("{oops")
    modules = {"no-enable-lora": [f"a={adapter_dirs['a']}"], "missing": [f"a={tmp_path / 'nope'}"],
               "rank": [f"a={adapter_dirs['wide']}"], "malformed": [f"a={broken}"],
               "duplicate": [f"a={adapter_dirs['a']}", f"a={adapter_dirs['b']}"], "bad-flag": ["just-a-name"]}[case]
    message = {"no-enable-lora": "--enable-lora", "missing": "does not exist", "rank": "above --max-lora-rank 16",
               "malformed": "not valid JSON", "duplicate": "already been loaded",
               "bad-flag": "expected name=path"}[case]
    argv = ["serve", "--replicas", "2", "--model", str(tiny_llama), "--port", "0", "--lora-modules", *modules]
    if case != "no-enable-lora":
        argv.append("--enable-lora")
    t0 = time.monotonic()
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 60  # no Ray started, no replica deployed
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()


def test_check_lora_modules_accepts_good_adapters(adapter_dirs):
    cfg = EngineConfig(model="unused", enable_lora=True)
    check_lora_modules(cfg, ServerArgs(lora_modules=[f"a={adapter_dirs['a']}",
                                                     json.dumps({"name": "b", "path": adapter_dirs["b"]})]))
    check_lora_modules(EngineConfig(model="unused"), ServerArgs())  # no adapters: nothing to check


def test_prefix_affinity_is_per_adapter():
    assert lora_affinity_key(MODEL, MODEL, "hello") == "hello"
    assert lora_affinity_key(None, MODEL, "hello") == "hello"
    assert lora_affinity_key("a", MODEL, "hello") != lora_affinity_key("b", MODEL, "hello")
    assert lora_affinity_key("a", MODEL, None) is None


def _complete(srv: ReplicatedServer, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True})


def test_adapters_on_every_replica(least_loaded_server, tiny_llama, adapter_dirs):
    srv = least_loaded_server
    cards = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=30).json()["data"]}
    assert set(cards) == {MODEL, "a", "b"}
    assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == adapter_dirs["a"]

    from conveyor.lora import LoRARequest

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=2)
    loras = {n: LoRARequest(n, i + 1, adapter_dirs[n]) for i, n in enumerate("abc")}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def want(model: str, prompt: list[int]) -> str:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=loras.get(model))
        return out.outputs[0].text

    # each adapter answers from both replicas, with the text it gives alone. Least-loaded routing reads loads
    # polled in the background, so on a slow machine a replica may still look busy with the previous request
    # and two requests in a row can land on the same replica (a CI run saw 8 in a row): ask until both have
    # answered (at most 8 times), waiting out the poll between tries
    replicas: dict[str, set[str]] = {}
    for j, model in enumerate(["a", "b", MODEL]):
        for i in range(8):
            prompt = [5 + i, 6 + j, 7, 8]
            r = _complete(srv, model, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want(model, prompt), model
            replicas.setdefault(model, set()).add(r.headers["x-conveyor-replica"])
            if replicas[model] == {"0", "1"}:
                break
            time.sleep(0.6)  # past the ingress's 0.5 s load poll: the replica just used no longer looks busy
    assert replicas["a"] == replicas["b"] == {"0", "1"}

    r = _complete(srv, "no-such-adapter", [1, 2, 3])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _complete(srv, "a", [1, 2, 3]).status_code == 200  # still serving

    # runtime load reaches every replica: the new adapter answers from both
    load = httpx.post(srv.url + "/v1/load_lora_adapter", headers=srv.headers, timeout=120,
                      json={"lora_name": "c", "lora_path": adapter_dirs["c"]})
    assert load.status_code == 200, load.text
    seen = set()
    for i in range(8):
        r = _complete(srv, "c", [9, i, 9])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want("c", [9, i, 9])
        seen.add(r.headers["x-conveyor-replica"])
        if len(seen) == 2 and i >= 3:
            break
    assert seen == {"0", "1"}
    bad = httpx.post(srv.url + "/v1/load_lora_adapter", headers=srv.headers, timeout=120,
                     json={"lora_name": "x", "lora_path": adapter_dirs["wide"]})
    assert bad.status_code == 400 and "above --max-lora-rank" in bad.json()["error"]["message"]
    assert httpx.post(srv.url + "/v1/load_lora_adapter", timeout=30,
                      json={"lora_name": "y", "lora_path": adapter_dirs["c"]}).status_code == 401  # the key
    unload = httpx.post(srv.url + "/v1/unload_lora_adapter", headers=srv.headers, timeout=120,
                        json={"lora_name": "c"})
    assert unload.status_code == 200, unload.text
    assert {_complete(srv, "c", [1, 2]).status_code for _ in range(2)} == {404}  # gone from both replicas
