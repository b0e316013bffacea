"""The replica router on its own: prefix affinity, the load margin, least-loaded turn-taking, down replicas."""

from __future__ import annotations

import pytest

from conveyor.scaleout.router import Router, block_hashes, prefix_text

SYSTEM_A = "You are a terse assistant for a bakery. " * 8
SYSTEM_B = "You answer questions about trains and timetables. " * 8


def chat(system: str, user: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_prefix_text_of_each_endpoint():
    assert prefix_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert prefix_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prefix_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"
    assert prefix_text("/v1/completions", {"prompt": [[4, 5], [6]]}) == "4 5"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prefix_text("/v1/chat/completions", parts) == prefix_text("/v1/chat/completions",
                                                                     {"messages": [{"role": "user", "content": "ab"}]})
    assert prefix_text("/v1/completions", None) is None
    assert prefix_text("/v1/completions", {"prompt": ""}) is None
    assert prefix_text("/v1/chat/completions", {"messages": "not a list of messages"}) is None


def test_block_hashes_are_chained_and_whole_blocks_only():
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 10, 64, 10)
    b = block_hashes("w" * 64 + "y" * 64, 64, 10)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # the same second block after a different first one is a different prefix
    assert block_hashes("short", 64, 10) == []
    assert len(block_hashes("x" * 64 * 20, 64, 5)) == 5


def test_prefix_router_keeps_each_system_prompt_on_one_replica():
    r = Router(2, "prefix", imbalance=8)
    loads = [0.0, 0.0]
    homes = {}
    for i in range(20):
        system = SYSTEM_A if i % 2 == 0 else SYSTEM_B
        d = r.pick(prefix_text("/v1/chat/completions", chat(system, f"question {i}")), loads)
        homes.setdefault(system, set()).add(d.replica)
        loads[d.replica] += 1  # every request stays in flight: the margin is not reached with 10 each
    assert homes[SYSTEM_A] == {0} and homes[SYSTEM_B] == {1}


def test_prefix_router_gives_up_affinity_beyond_the_margin_and_moves_the_home():
    r = Router(2, "prefix", imbalance=4)
    text = SYSTEM_A + "q"
    assert r.pick(text, [0.0, 0.0]).replica == 0
    d = r.pick(text, [4.0, 0.0])
    assert (d.replica, d.reason) == (0, "prefix_hit")  # exactly at the margin: still affinity
    d = r.pick(text, [5.0, 0.0])
    assert (d.replica, d.reason) == (1, "prefix_overloaded")
    assert r.pick(text, [0.0, 0.0]).replica == 1  # the prefix now lives where it went last


def test_least_loaded_takes_turns_and_skips_down_replicas():
    r = Router(3, "least-loaded")
    assert [r.pick("same text" * 20, [0.0, 0.0, 0.0]).replica for _ in range(4)] == [0, 1, 2, 0]
    assert r.pick(None, [3.0, 1.0, 2.0]).replica == 1
    assert r.pick(None, [None, 5.0, 2.0]).replica == 2
    assert r.pick(None, [None, None, None]) is None


def test_prefix_router_avoids_a_down_home():
    r = Router(2, "prefix")
    text = SYSTEM_B + "q"
    assert r.pick(text, [0.0, 0.0]).replica == 0
    d = r.pick(text, [None, 3.0])
    assert (d.replica, d.reason) == (1, "prefix_overloaded")


def test_table_is_bounded():
    r = Router(2, "prefix", chars_per_block=8, max_blocks=4, table_size=10)
    for i in range(50):
        r.pick(f"{i:08d}" * 4, [0.0, 0.0])
    assert len(r.table) == 10


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="router must be one of"):
        Router(2, "random")


def test_the_single_process_server_does_not_import_ray():
    """Ray is an optional extra: building the CLI and the single server's app must not pull it in."""
    import subprocess
    import sys

    code = ("import sys, conveyor.cli, conveyor.server.api_server, conveyor.scaleout.ingress; "
            "conveyor.cli.document; assert 'ray' not in sys.modules, 'ray was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_prefix_hit_does_not_use_up_a_turn():
    r = Router(2, "prefix")
    a, b = SYSTEM_A + "q1", SYSTEM_B + "q1"
    assert r.pick(a, [0.0, 0.0]).replica == 0
    assert r.pick(a, [0.0, 0.0]).reason == "prefix_hit"
    assert r.pick(b, [0.0, 0.0]).replica == 1  # the new prompt still gets the other, equally idle replica


def test_a_draining_or_restarting_replica_gets_no_new_requests():
    """The ingress routes only to replicas whose engine serves. A replica that drains (it got SIGTERM) or
    whose engine is restarting still answers the ingress's polls (it is up, and finishes what it has) but
    is given no new request, not even one whose prefix lives there; once it reports ok again it is."""
    from conveyor.scaleout.ingress import ReplicaState

    reps = [ReplicaState(i, handle=None, up=True, report={"state": "ok", "running": 0, "waiting": 0})
            for i in range(3)]
    r = Router(3, "prefix", imbalance=8)
    text = SYSTEM_A + "question"
    home = r.pick(text, [rep.load for rep in reps]).replica
    reps[home].report = {**reps[home].report, "state": "draining", "running": 2}
    restarting = (home + 1) % 3
    reps[restarting].report = {**reps[restarting].report, "state": "restarting"}
    assert [rep.state for rep in reps][home] == "draining" and reps[home].up and reps[home].load is None
    assert reps[restarting].load is None
    picks = {r.pick(text if i % 2 else f"fresh {i}", [rep.load for rep in reps]).replica for i in range(20)}
    assert picks == {3 - home - restarting}, picks  # only the replica that serves
    last = 3 - home - restarting
    reps[last].up = False  # and with none left to serve: no replica (the ingress answers 503 no_replica)
    assert reps[last].state == "down" and r.pick(text, [rep.load for rep in reps]) is None
    reps[restarting].report = {**reps[restarting].report, "state": "ok"}  # its new engine serves: requests again
    assert r.pick(text, [rep.load for rep in reps]).replica == restarting
