"""The scheduler prefers requests whose LoRA adapter is already resident when `--max-loras` is the limit,
bounded by aging so the other adapters are never starved (`Scheduler.prefer_resident_loras`)."""

from __future__ import annotations

import pytest

from conveyor.lora.request import LoRARequest
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from tests.scheduler.harness import Harness, distinct_prompt

LORAS = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("ABCDEF")}


def add(h: Harness, lora: str | None, max_tokens: int = 4, prompt_len: int = 4) -> Request:
    """A request under adapter `lora` (None: the base model), arriving now."""
    k = next(h.ids)
    rid = f"{lora or 'base'}{k}"
    req = Request(rid, distinct_prompt(k, prompt_len),
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=h.clock(),
                  lora_request=LORAS[lora] if lora else None)
    h.sched.add(req)
    return req


def lora_harness(scheduler: str = "iteration", **config) -> Harness:
    config.setdefault("max_num_seqs", 3)
    config.setdefault("max_loras", 2)
    return Harness(scheduler=scheduler, enable_lora=True, priority_aging_steps=config.pop("aging", 64), **config)


@pytest.mark.parametrize("scheduler", ["iteration", "priority", "fair", "slo"])
def test_free_seat_goes_to_a_resident_adapter_before_an_earlier_new_one(scheduler):
    """Two adapters per step, one runs (A). B and C arrived before two more A requests, and there are two
    seats: in arrival order B would take one (a second adapter in the batch); preferring the resident
    adapter gives both seats to A, and B and C wait."""
    h = lora_harness(scheduler)
    a1 = add(h, "A", max_tokens=20)
    h.step()
    b, c = add(h, "B"), add(h, "C")
    a2, a3 = add(h, "A"), add(h, "A")
    step = h.step()
    assert h.ids_in(step) == {a1.request_id, a2.request_id, a3.request_id}
    assert step.lora_ids == {1} and b.request_id not in h.ids_in(step) and c.request_id not in h.ids_in(step)
    assert h.sched.num_lora_deferrals >= 1
    h.run()
    assert all(r.finished for r in (a1, a2, a3, b, c))


def test_base_model_requests_are_never_deferred():
    h = lora_harness()
    add(h, "A", max_tokens=20)
    h.step()
    b, base = add(h, "B"), add(h, None)
    add(h, "C")
    step = h.step()
    assert base.request_id in h.ids_in(step) and b.request_id in h.ids_in(step)  # base first, then B's free slot


def test_no_limit_keeps_the_policy_order():
    """When every adapter fits in one step (here max_loras 4 for 3 adapters) nothing is reordered: the
    earlier B takes the seat before the later A requests."""
    h = lora_harness(max_loras=4, max_num_seqs=2)
    add(h, "A", max_tokens=20)
    h.step()
    b = add(h, "B")
    add(h, "A")
    add(h, "C")
    step = h.step()
    assert b.request_id in h.ids_in(step)
    assert h.sched.num_lora_deferrals == 0


def test_aging_bounds_the_preference_no_starvation():
    """A new A request every step, one adapter per step: A's stream alone would keep `lora_fits` shut for
    B for as long as it lasts. Once B has waited its aging steps, no fresh A request is admitted, the
    running A requests drain (the longest has 10 tokens), and B runs."""
    aging = 4
    h = lora_harness(max_loras=1, max_num_seqs=2, aging=aging)
    add(h, "A", max_tokens=10)
    h.step()
    b = add(h, "B", max_tokens=2)
    waited = 0
    for _ in range(60):
        add(h, "A", max_tokens=2)
        step = h.step()
        if b.request_id in h.ids_in(step):
            break
        waited += 1
    else:
        raise AssertionError("B starved behind the resident adapter")
    assert aging <= waited <= aging + 10
    h.run()
    assert not h.sched.has_unfinished()


def test_resident_means_running_even_when_not_yet_in_this_step():
    """An adapter counts as resident because a request under it runs, not only because this step has it."""
    h = lora_harness(max_loras=1, max_num_seqs=4)
    add(h, "A", max_tokens=20)
    h.step()
    order = [add(h, "B"), add(h, "A")]
    from conveyor.scheduler.core import Step

    empty = Step(64, 4)
    got = h.sched.prefer_resident_loras(list(h.sched.waiting), empty)
    assert [r.request_id for r in got] == [order[1].request_id, order[0].request_id]


def test_only_the_adapter_closest_to_done_drains_for_an_aged_request():
    """Two adapter slots held by A (long requests) and B (short ones), C aged in the queue: only B stops
    admitting newcomers, so it drains first and C takes its slot, while A keeps its batch full."""
    aging = 2
    h = lora_harness(max_loras=2, max_num_seqs=8, aging=aging)
    add(h, "A", max_tokens=40)
    add(h, "B", max_tokens=6)
    h.step()
    c = add(h, "C", max_tokens=2)
    a_admitted_late = 0
    for _ in range(30):
        a, b = add(h, "A", max_tokens=40), add(h, "B", max_tokens=6)
        step = h.step()
        if c.request_id in h.ids_in(step):
            break
        if c.waited_steps > aging:  # C is aged: B drains, A does not
            assert b.request_id not in h.ids_in(step)
            a_admitted_late += a.request_id in h.ids_in(step)
    else:
        raise AssertionError("C starved")
    assert a_admitted_late >= 1
