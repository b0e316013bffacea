"""`conveyor bench run` spreads one workload over N LoRA adapters, in-process and over HTTP, and reports
throughput per adapter; adapters made here with peft on the tiny model, as a user's would be."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.cli import main as bench_main
from conveyor.bench.lora import choose, parse_modules, spread
from conveyor.bench.workloads import BenchRequest
from conveyor.engine.llm_engine import LLMEngine
from conveyor.server.api_server import ServerArgs
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter
from tests.server.conftest import API_KEY, run_server, tiny_config

ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "128"]
WORKLOAD = ["--num-prompts", "12", "--input-len", "12", "--output-len", "4", "--no-progress", "--timeout", "60",
            "--peak-matmul-size", "128", "--concurrency", "6"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bench-adapters")
    specs = {"a": (4, ALL_PROJECTIONS), "b": (8, ["q_proj", "v_proj"]), "c": (2, ["down_proj"])}
    return {n: str(make_adapter(tiny_llama, root / n, r, t, seed=40 + i))
            for i, (n, (r, t)) in enumerate(specs.items())}


def test_spread_is_round_robin_and_keeps_prompts():
    reqs = [BenchRequest([100 + i], 2) for i in range(7)]
    out = spread(reqs, ["x", "y", "z"])
    assert [r.lora for r in out] == ["x", "y", "z", "x", "y", "z", "x"]
    assert [r.prompt_token_ids for r in out] == [r.prompt_token_ids for r in reqs]
    assert spread(reqs, []) == reqs
    mods = parse_modules(["x=/p/x", "y=/p/y", "z"], need_paths=False)
    assert mods == [("x", "/p/x"), ("y", "/p/y"), ("z", None)]
    assert choose(mods, 2) == mods[:2] and choose(mods, None) == mods and choose(mods, 0) == []
    with pytest.raises(ValueError, match="needs at least 4"):
        choose(mods, 4)
    with pytest.raises(ValueError, match="need name=path"):
        parse_modules(["z"], need_paths=True)


def test_in_process_run_spreads_over_adapters(tiny_llama, adapters, tmp_path, monkeypatch, capsys):
    seen: list[str | None] = []
    real = LLMEngine.add_request

    def add_request(self, request):
        lora = request.lora_request
        seen.append(lora.lora_name if lora is not None else None)
        return real(self, request)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    out = tmp_path / "r.json"
    argv = ["run", "--in-process", "--model", str(tiny_llama), "--enable-lora", "--max-loras", "2",
            "--max-cpu-loras", "3", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
            "--lora-spread", "3", "--out", str(out), *ENGINE, *WORKLOAD]
    assert bench_main(argv) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["output_throughput"] > 0
    per = res["meta"]["lora"]["per_adapter"]
    assert res["meta"]["lora"]["adapters"] == ["a", "b", "c"]
    assert {n: d["completed"] for n, d in per.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(d["output_tok_s"] > 0 for d in per.values())
    assert sorted(seen) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4  # every request reached the engine under its adapter
    assert "LoRA: 3 adapters" in capsys.readouterr().out


def test_in_process_lora_errors_are_clean(tiny_llama, adapters, capsys):
    base = ["run", "--in-process", "--model", str(tiny_llama), *ENGINE, *WORKLOAD]
    assert bench_main([*base, "--lora-modules", f"a={adapters['a']}"]) == 2  # no --enable-lora
    assert "--enable-lora" in capsys.readouterr().err
    assert bench_main([*base, "--enable-lora", "--lora-modules", f"a={adapters['a']}", "--lora-spread", "2"]) == 2
    assert "needs at least 2 adapters" in capsys.readouterr().err


def test_http_run_spreads_over_the_servers_adapters(tiny_llama, adapters):
    """Against a server: without --lora-modules the adapters come from /v1/models; each request's
    `model` names its adapter, which the server's per-adapter counter shows."""
    cfg = tiny_config(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=3)
    args = ServerArgs(api_key=API_KEY, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    with run_server(cfg, args) as srv:
        before = srv.scrape()
        argv = ["run", "--url", srv.url, "--api-key", API_KEY, "--model", str(tiny_llama), "--lora-spread", "2",
                *WORKLOAD]
        assert bench_main(argv) == 0
        after = srv.wait_idle()
    key = "conveyor:lora_requests_total{lora_name=%s}"
    got = {n: after.get(key % n, 0) - before.get(key % n, 0) for n in adapters}
    assert got == {"a": 6, "b": 6, "c": 0}
