"""The scheduling mechanism (conveyor/scheduler/core.py) under every chunking strategy: a step that ends a prompt
takes no partial chunk of another one (`isolate_prompt_ends`)."""

from __future__ import annotations

import pytest

from conveyor.request import Request
from conveyor.scheduler.core import Step
from tests.scheduler.harness import Harness


def chunks(step: Step) -> dict[str, int]:
    return {it.request.request_id: it.num_tokens for it in step.items}


def ends_a_prompt(step: Step) -> bool:
    """An item feeds a prompt's last tokens (more than one: a decode is not a prompt's end)."""
    return any(it.num_tokens > 1 and it.request.num_computed_tokens + it.num_tokens == it.request.num_tokens
               for it in step.items)


def partial_prompt_chunks(step: Step) -> list[str]:
    """Items that feed prompt tokens but stop short of the prompt's end (they sample nothing)."""
    return [it.request.request_id for it in step.items
            if it.num_tokens > 1 and it.request.num_computed_tokens + it.num_tokens < it.request.num_tokens]


def test_the_step_that_ends_a_prompt_does_not_start_the_next_one():
    h = Harness(scheduler="iteration", max_num_batched_tokens=16)
    a, b = h.add(prompt_len=20, max_tokens=3), h.add(prompt_len=20, max_tokens=3)
    assert chunks(h.step()) == {a.request_id: 16}
    assert chunks(h.step()) == {a.request_id: 4}, "b's first chunk would only have delayed a's first token"
    assert len(a.output_token_ids) == 1
    assert chunks(h.step()) == {a.request_id: 1, b.request_id: 15}  # b first now: nobody passes it
    assert chunks(h.step()) == {a.request_id: 1, b.request_id: 5}


def test_filling_the_budget_as_vllm_does_is_one_flag_away():
    h = Harness(scheduler="iteration", max_num_batched_tokens=16, isolate_prompt_ends=False)
    a, b = h.add(prompt_len=20, max_tokens=3), h.add(prompt_len=20, max_tokens=3)
    h.step()
    assert chunks(h.step()) == {a.request_id: 4, b.request_id: 12}


def test_whole_prompts_that_fit_still_join_the_step_that_ends_one():
    h = Harness(scheduler="iteration", max_num_batched_tokens=16)
    a, b, c = h.add(prompt_len=20, max_tokens=2), h.add(prompt_len=20, max_tokens=2), h.add(prompt_len=8)
    h.step()
    assert chunks(h.step()) == {a.request_id: 4, c.request_id: 8}  # c ends too; b's chunk would end nothing
    assert next(iter(chunks(h.step()))) != c.request_id
    assert b.request_id in chunks(h.steps[-1])


@pytest.mark.parametrize("scheduler", ["iteration", "priority", "fair", "slo", "static", "dynamic"])
def test_no_step_ends_a_prompt_beside_a_partial_chunk_and_everyone_finishes(scheduler):
    h = Harness(scheduler=scheduler, max_num_batched_tokens=24, max_num_seqs=8, batch_size=4)
    for i in range(12):
        h.add(prompt_len=5 + 7 * i % 40, max_tokens=1 + i % 4, priority=i % 2, tenant=f"t{i % 3}")
    h.sched.input_ended = True
    for _ in range(2_000):
        if not h.sched.has_unfinished():
            break
        h.clock.now += 0.001
        step = h.sched.schedule()
        if ends_a_prompt(step):
            assert not partial_prompt_chunks(step), f"step {len(h.steps)}: {chunks(step)}"
        sampled = h.sched.update(step, [7] * sum(1 for it in step.items if it.samples))
        for req, _ in sampled:
            if len(req.output_token_ids) >= req.max_tokens:
                h.sched.finish(req, "length")
        h.steps.append(step)
    assert not h.sched.has_unfinished(), "a refused chunk must go first in a later step, not starve"


def first_token_times(isolate: bool, users: int = 8, prompt_len: int = 40, budget: int = 32) -> tuple[list, float]:
    """A burst of `users` prompts on a clock where a step takes as long as its tokens (a compute-bound CPU
    step): each request's first-token time, and when the last request ended."""
    h = Harness(scheduler="iteration", max_num_batched_tokens=budget, isolate_prompt_ends=isolate)
    reqs: list[Request] = [h.add(prompt_len=prompt_len + 3 * i, max_tokens=4) for i in range(users)]
    first: dict[str, float] = {}
    while h.sched.has_unfinished():
        step = h.sched.schedule()
        h.clock.now += step.num_tokens * 0.01
        for req, _ in h.sched.update(step, [7] * sum(1 for it in step.items if it.samples)):
            first.setdefault(req.request_id, h.clock.now)
            if len(req.output_token_ids) >= req.max_tokens:
                h.sched.finish(req, "length")
    return [first[r.request_id] for r in reqs], h.clock.now


def test_first_tokens_come_sooner_for_the_same_work():
    isolated, end_isolated = first_token_times(True)
    filled, end_filled = first_token_times(False)
    assert end_isolated == pytest.approx(end_filled)  # the same tokens through the model
    assert all(a <= b + 1e-9 for a, b in zip(isolated, filled)), "no first token may come later"
    assert sum(isolated) < 0.95 * sum(filled)  # (here 7% sooner on the mean)
