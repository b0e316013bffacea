"""Switching the batching strategy on a live server (`POST /admin/scheduler`) under streaming clients.

Every registered strategy takes a turn, ten switches in all, while 64 streaming clients (three
tenants, three priorities) run: no request is lost or duplicated, no KV block stays in use, and the
greedy outputs equal those of the same load without switching (the engine is batch-invariant, so
they must match bit for bit whatever the strategies batched together).
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest

from conveyor.scheduler.policies import POLICIES
from conveyor.server.api_server import ServerArgs
from tests.conftest import build_tiny_llama
from tests.server.conftest import API_KEY, run_server, tiny_config

CLIENTS, TOKENS, SWITCHES = 64, 24, 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # SmolLM2's head shape (head_dim 64), so the batch-invariant CPU path runs (as test_batch_invariance)
    return build_tiny_llama(tmp_path_factory.mktemp("switch"), hidden_size=192, intermediate_size=384,
                            num_attention_heads=3, num_key_value_heads=1)


@pytest.fixture(scope="module")
def srv(model_dir):
    cfg = tiny_config(model_dir, dtype="auto", max_num_seqs=8, max_num_batched_tokens=128)
    with run_server(cfg, ServerArgs(api_key=API_KEY, log_interval=60.0)) as s:
        if not s.app.state.engine.info.batch_invariant:
            pytest.skip("this machine's engine is not batch-invariant: outputs may differ with batching")
        yield s


def _post(srv, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + "/admin/scheduler", json=body, headers=headers, timeout=60)


async def _load(srv, switch: bool) -> tuple[dict[int, str], list[str], int]:
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    names = itertools.cycle(POLICIES)
    done: list[str] = []
    finished = asyncio.Event()

    async def one(i: int) -> tuple[int, str]:
        stream = await client.completions.create(
            model="tiny", prompt=f"client {i} says " + "word " * (i % 7 * 5), max_tokens=TOKENS, temperature=0,
            stream=True, user=f"tenant{i % 3}", extra_body={"priority": i % 3, "ignore_eos": True})
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        assert reasons == ["length"], (i, reasons)  # exactly one end per request: none lost, none doubled
        return i, text

    async def switcher() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            for k in range(SWITCHES):
                name = "iteration" if k == SWITCHES - 1 else next(names)  # end somewhere that drains anything
                body = {"scheduler": name, **_options(name)}
                r = await http.post(srv.url + "/admin/scheduler", json=body,
                                    headers={"Authorization": f"Bearer {API_KEY}"})
                assert r.status_code == 200, r.text
                done.append(r.json()["scheduler"])
                if not finished.is_set():
                    await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(one(i)) for i in range(CLIENTS)]
    sw = asyncio.create_task(switcher()) if switch else None
    results = dict(await asyncio.gather(*tasks))
    in_flight = len(done)  # switches answered while requests were still streaming
    finished.set()
    if sw is not None:
        await sw
    await client.close()
    return results, done, in_flight


def _options(name: str) -> dict:
    """Some of each strategy's own options, so that switching with options is exercised too."""
    opts = {o.name for o in POLICIES[name].options}
    out: dict = {}
    if "static_flush_ms" in opts:
        out["static_flush_ms"] = 20.0  # a partial batch must not wait for an end of input that never comes
    if "tenant_weights" in opts:
        out["tenant_weights"] = "tenant0=2,tenant1=1"
    if "batch_size" in opts:
        out["batch_size"] = 4
    return out


def test_switching_ten_times_under_streaming_clients_loses_nothing(srv):
    before = srv.scrape()
    plain, _, _ = asyncio.run(_load(srv, switch=False))
    switched, names, in_flight = asyncio.run(_load(srv, switch=True))
    assert len(names) == SWITCHES and set(names[:-1]) <= set(POLICIES)
    assert in_flight >= SWITCHES // 2, f"only {in_flight} switches happened while the clients streamed"
    assert switched == plain, "greedy outputs changed with the strategy switches"
    m = srv.wait_idle()
    assert m["conveyor:kv_cache_blocks_used"] == 0
    assert m["conveyor:scheduler_switches_total"] - before["conveyor:scheduler_switches_total"] == SWITCHES
    assert m["conveyor:scheduler_info{scheduler=iteration}"] == 1
    assert sum(m[f"conveyor:scheduler_info{{scheduler={n}}}"] for n in POLICIES) == 1
    assert m["conveyor:request_success_total{finished_reason=length}"] - \
        before["conveyor:request_success_total{finished_reason=length}"] == 2 * CLIENTS


def test_admin_scheduler_refuses_bad_input_and_changes_nothing(srv):
    assert _post(srv, {"scheduler": "iteration"}, key=None).status_code == 401
    assert _post(srv, {"scheduler": "iteration"}, key="wrong").status_code == 401
    for body, param in (({}, "scheduler"), ({"scheduler": 3}, "scheduler"), ({"scheduler": "nope"}, "scheduler"),
                        ({"scheduler": "iteration", "batch_size": 4}, "batch_size"),
                        ({"scheduler": "iteration", "priority_aging_steps": "8"}, "priority_aging_steps"),
                        ({"scheduler": "iteration", "priority_aging_steps": True}, "priority_aging_steps")):
        r = _post(srv, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    fair = next((n for n, s in POLICIES.items() if any(o.name == "tenant_weights" for o in s.options)), None)
    if fair is not None:  # a value only the policy itself can judge: refused by the engine, nothing changed
        r = _post(srv, {"scheduler": fair, "tenant_weights": "a=-1"})
        assert r.status_code == 400 and "tenant_weights" in r.json()["error"]["message"], r.text
    current = httpx.get(srv.url + "/admin/scheduler", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert current["scheduler"] == "iteration" and set(current["available"]) == set(POLICIES)
    r = _post(srv, {"scheduler": "iteration", "priority_aging_steps": 32})
    assert r.status_code == 200 and r.json()["options"]["priority_aging_steps"] == 32
    assert httpx.get(srv.url + "/health").status_code == 200
