"""`conveyor serve --replicas 2` on a local Ray instance: real replicas of the tiny model behind the ingress,
spoken to with the official `openai` client.

Skipped, with the reason, where Ray is not installed or cannot start a local instance.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..server.conftest import API_KEY, MODEL, server_output
from .conftest import SECOND_KEY, ReplicatedServer

SYSTEMS = {
    "A": "You are the assistant of a small bakery. You answer in one sentence about bread, cakes and opening hours. "
         "Be polite, be brief, and never invent prices that are not on the list. " * 2,
    "B": "You are a railway timetable helper. You answer questions about trains, platforms and connections, "
         "with times in 24-hour format, and you say so plainly when you do not know. " * 2,
}


def chat_stream(client, group: str, i: int, max_tokens: int = 12) -> tuple[str, str]:
    """One streaming chat request with `group`'s system prompt: (the replica that answered, the text)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEMS[group]}, {"role": "user", "content": f"question {i}?"}])
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return raw.headers["x-conveyor-replica"], text


def shared_prefix_round(server: ReplicatedServer) -> dict[str, list[str]]:
    """One warm-up request per system prompt, then 8 more of each at once (all A first, then all B)."""
    client = server.client()
    placed: dict[str, list[str]] = {"A": [], "B": []}
    for g in "AB":
        placed[g].append(chat_stream(client, g, 0)[0])
    lock = threading.Lock()

    def one(g: str, i: int) -> None:
        rep, _ = chat_stream(client, g, i)
        with lock:
            placed[g].append(rep)

    threads = [threading.Thread(target=one, args=(g, i)) for g in "AB" for i in range(1, 9)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # arrival order A1..A8, B1..B8
    for t in threads:
        t.join(120)
    assert all(len(v) == 9 for v in placed.values()), placed
    return placed


def test_routers_two_replicas_share_the_traffic_and_prefix_routing_raises_the_hit_rate(prefix_server,
                                                                                       least_loaded_server):
    placed = shared_prefix_round(prefix_server)
    # prefix: each system prompt stays on one replica, and the two prompts took different ones
    assert len(set(placed["A"])) == 1 and len(set(placed["B"])) == 1, placed
    assert set(placed["A"]) != set(placed["B"]), placed
    m = prefix_server.metrics_by_replica()
    assert set(m) == {"0", "1"}
    for rep, d in m.items():  # both replicas served traffic, and said so in their own series
        assert d["conveyor:request_success_total"] >= 9, (rep, d)
    prefix_rate = prefix_server.hit_rate()

    before = least_loaded_server.prefix_counts()  # (the LoRA tests may have used it first)
    placed_ll = shared_prefix_round(least_loaded_server)
    least_rate = least_loaded_server.hit_rate(since=before)
    assert len(set(placed_ll["A"])) == 2, placed_ll  # least-loaded spreads a shared prompt over both
    print(f"\nprefix hit rate: prefix router {prefix_rate:.3f}, least-loaded {least_rate:.3f}")
    assert prefix_rate > least_rate


def aborts(server: ReplicatedServer, replica: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "conveyor:request_success_total" and s.labels.get("replica") == replica
               and s.labels.get("finished_reason") == "abort")


def test_client_disconnect_through_the_ingress_aborts_on_the_replica(prefix_server):
    before = {rep: aborts(prefix_server, rep) for rep in ("0", "1")}
    with httpx.stream("POST", prefix_server.url + "/v1/completions", timeout=60, headers=prefix_server.headers, json={
            "model": MODEL, "prompt": "a long one", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        replica = r.headers["x-conveyor-replica"]
        for n, _ in enumerate(r.iter_lines()):
            if n > 3:
                break
    deadline = time.monotonic() + 30
    while True:  # the replica aborted the request (it did not run to its 500 tokens) and freed its blocks
        d = prefix_server.metrics_by_replica()[replica]
        if (aborts(prefix_server, replica) > before[replica] and d["conveyor:num_requests_running"] == 0
                and d["conveyor:kv_cache_blocks_used"] == 0):
            break
        assert time.monotonic() < deadline, (d, before)
        time.sleep(0.2)


def test_bad_input_and_auth_free_endpoints_through_the_ingress(prefix_server):
    import openai

    client = prefix_server.client()
    with pytest.raises(openai.AuthenticationError):  # the ingress checks the key; replicas never see requests without
        openai.OpenAI(base_url=prefix_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(prefix_server.url + "/dashboard/events", timeout=30).status_code == 401
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = httpx.post(prefix_server.url + "/v1/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json", **prefix_server.headers})
    assert bad.status_code == 400 and "error" in bad.json()
    health = prefix_server.health()
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]


def test_killed_replica_fails_its_requests_others_complete_and_it_comes_back(prefix_server):
    import openai

    client = prefix_server.client()
    home = {g: chat_stream(client, g, 100)[0] for g in "AB"}  # where each prompt lives now
    assert home["A"] != home["B"], home
    victim = home["A"]
    pid = next(r["pid"] for r in prefix_server.health()["replicas"] if str(r["replica"]) == victim)
    started = threading.Barrier(7)
    results: dict[str, list] = {"A": [], "B": []}

    def long_stream(g: str, i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, stream=True, max_tokens=220, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": SYSTEMS[g]}, {"role": "user", "content": f"long {i}"}])
            n = 0
            for _chunk in raw.parse():
                n += 1
                if n == 2:
                    started.wait(60)
            results[g].append(("done", raw.headers["x-conveyor-replica"], n))
        except openai.APIError as e:
            results[g].append(("error", str(e)))
            started.abort()  # only a kill may fail a stream: if this one failed before it, fail the test now
        except threading.BrokenBarrierError:
            results[g].append(("barrier", None))

    threads = [threading.Thread(target=long_stream, args=(g, i)) for g in "AB" for i in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(120)  # every stream has its first tokens: kill A's replica mid-answer
    except threading.BrokenBarrierError:
        pytest.fail(f"a stream failed before the kill: {results}")
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    assert [r[0] for r in results["A"]] == ["error"] * 3, results
    assert all("replica" in r[1] for r in results["A"]), results
    assert [r[0] for r in results["B"]] == ["done"] * 3, results
    assert all(r[1] == home["B"] for r in results["B"]), results

    deadline = time.monotonic() + 180  # Ray starts a new replica process in the dead one's place
    while True:
        reps = {str(r["replica"]): r for r in prefix_server.health()["replicas"]}
        if reps[victim]["status"] == "ok" and reps[victim]["pid"] != pid:
            break
        assert time.monotonic() < deadline, reps
        time.sleep(0.5)
    # new prompts spread over both replicas again: the restarted one answers some of them
    served = []
    threads = [threading.Thread(target=lambda i=i: served.append(_fresh(client, i))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(served) == 6 and victim in served, served


def _fresh(client, i: int) -> str:
    """A completion with a prompt no replica has seen: routed by load alone."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"fresh prompt number {i} " * 3,
                                                      max_tokens=24, extra_body={"ignore_eos": True})
    assert raw.parse().usage.completion_tokens == 24
    return raw.headers["x-conveyor-replica"]


def test_each_replicas_dashboard_through_the_ingress(prefix_server):
    import json

    assert 'id="occupancy"' in httpx.get(prefix_server.url + "/dashboard", timeout=30).text
    for rep in ("0", "1"):
        with httpx.stream("GET", prefix_server.url + f"/dashboard/events?replica={rep}", timeout=60,
                          headers=prefix_server.headers) as r:
            assert r.status_code == 200 and r.headers["x-conveyor-replica"] == rep
            setup = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        assert setup["strategy"] == "iteration" and setup["model"] == MODEL
    bad = httpx.get(prefix_server.url + "/dashboard/events?replica=7", timeout=30, headers=prefix_server.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "replica"


def tenant_counts(server: ReplicatedServer, name: str) -> dict[str, float]:
    """A per-tenant counter from the replicas' /metrics (through the ingress), summed over replicas."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == name and "tenant" in s.labels:
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
    return out


def test_every_key_and_the_tenant_header_pass_the_ingress(prefix_server):
    """`--api-key k1,k2` behind replicas: either key is accepted (the ingress checks keys by the single server's
    rule); `--tenant-key header:NAME`: the header reaches the replica, which counts the request for that tenant,
    on completions and on embeddings alike."""
    url = prefix_server.url + "/v1"
    before = tenant_counts(prefix_server, "conveyor:tenant_generation_tokens_total")
    before_prompt = tenant_counts(prefix_server, "conveyor:tenant_prompt_tokens_total")
    for key, team in ((API_KEY, "blue"), (SECOND_KEY, "green")):
        r = httpx.post(url + "/completions", headers={"Authorization": f"Bearer {key}", "X-Tenant": team}, timeout=120,
                       json={"model": MODEL, "prompt": f"hello from {team}", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, (key, r.text)
    r = httpx.post(url + "/embeddings", headers={"Authorization": f"Bearer {SECOND_KEY}", "X-Tenant": "red"},
                   json={"model": MODEL, "input": "embed me"}, timeout=120)
    assert r.status_code == 200, r.text
    for bad in (f"{API_KEY},{SECOND_KEY}", "wrong", "test-key-3"):
        r = httpx.post(url + "/completions", headers={"Authorization": f"Bearer {bad}"}, timeout=30,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 401, bad
    after = tenant_counts(prefix_server, "conveyor:tenant_generation_tokens_total")
    after_prompt = tenant_counts(prefix_server, "conveyor:tenant_prompt_tokens_total")
    assert {t: after[t] - before.get(t, 0.0) for t in ("blue", "green")} == {"blue": 3, "green": 3}, after
    assert after_prompt.get("red", 0.0) > before_prompt.get("red", 0.0), after_prompt


def test_sigterm_drains_the_ingress_then_exits_0(prefix_server):
    """Last in this module (it stops the shared server). SIGTERM: the ingress answers new requests and
    /health with 503 draining (Retry-After), the requests it relays (16 of 400 tokens) all finish, then
    the server exits 0."""
    import json

    client = prefix_server.client()
    done: list[int] = []

    def one(i: int) -> None:
        out = client.completions.create(model=MODEL, prompt=f"drain {i}", max_tokens=400,
                                        extra_body={"ignore_eos": True})
        done.append(out.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(d.get("conveyor:num_requests_running", 0.0) for d in prefix_server.metrics_by_replica().values()) < 8:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.01)
    prefix_server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (h := httpx.get(prefix_server.url + "/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert h.status_code == 503 and h.json()["status"] == "draining" and h.headers["retry-after"], h.text
    r = httpx.post(prefix_server.url + "/v1/completions", headers=prefix_server.headers, timeout=10,
                   json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and json.loads(r.text)["error"]["code"] == "draining", r.text
    for t in threads:
        t.join(120)
    assert done == [400] * 16, done
    assert prefix_server.proc.wait(120) == 0, server_output(prefix_server.proc)[-3000:]
