"""The batch tier (Batch API lines), on the model-free harness: interactive requests take seats, tokens and KV
blocks back from batch lines at once, under every strategy of the iteration family; batch lines get only what is
left, resume from their cached prefix after a preemption, and keep their strategy's order inside their own tier."""

from __future__ import annotations

import itertools
import random

import pytest

from conveyor.request import Request, Tier
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.step_cost import DecodeShare, SeqStepCost

from .harness import Harness, distinct_prompt

ITERATION_FAMILY = ["iteration", "priority", "fair", "slo"]
_ids = itertools.count()


def add(h: Harness, tier: Tier, prompt_len: int = 8, max_tokens: int = 4, tenant: str | None = None,
        priority: int = 0) -> Request:
    k = next(_ids)
    rid = f"{tier.name.lower()}{k}"
    req = Request(rid, distinct_prompt(k, prompt_len),
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=h.clock(), tenant=tenant,
                  priority=priority, tier=tier)
    h.sched.add(req)
    return req


def batch_in(step) -> int:
    return sum(it.request.tier is Tier.BATCH for it in step.items)


@pytest.mark.parametrize("scheduler", ITERATION_FAMILY)
def test_interactive_requests_take_every_seat_back_at_once(scheduler):
    """Batch lines hold all four seats with more queued: four interactive requests all get their first token
    in the very next step (four batch lines go back to the queue), and every batch line still finishes."""
    h = Harness(scheduler=scheduler, max_num_seqs=4)
    lines = [add(h, Tier.BATCH, max_tokens=30) for _ in range(12)]
    for _ in range(5):
        h.step()
    assert sum(r.tier is Tier.BATCH for r in h.sched.running) == 4
    chats = [add(h, Tier.INTERACTIVE, max_tokens=6) for _ in range(4)]
    step = h.step()
    assert all(r.first_token_time is not None for r in chats), scheduler
    assert len(step.reclaimed) == 4 and step.preempted == [], "reclaims are not the policy's preemptions"
    assert batch_in(step) == 0
    h.run()
    assert all(len(r.output_token_ids) == 30 for r in lines)
    assert h.sched.num_batch == 0


@pytest.mark.parametrize("scheduler", ITERATION_FAMILY)
def test_interactive_requests_take_kv_blocks_back(scheduler):
    """Batch lines hold every KV block (seats are free): an interactive request is admitted in the next step,
    taking the blocks of the newest lines, not waiting for them to finish."""
    h = Harness(num_blocks=24, scheduler=scheduler, max_num_seqs=16, block_size=4)
    for _ in range(6):
        add(h, Tier.BATCH, prompt_len=14, max_tokens=40)
    for _ in range(20):
        h.step()
        if h.kv.num_free_blocks == 0:
            break
    assert h.kv.num_free_blocks == 0
    chat = add(h, Tier.INTERACTIVE, prompt_len=12, max_tokens=4)
    step = h.step()
    assert chat.first_token_time is not None, scheduler
    assert step.reclaimed and all(r.tier is Tier.BATCH for r in step.reclaimed)
    h.run()


def test_batch_lines_get_only_the_tokens_interactive_work_leaves():
    """With no cut (batch_tier_slowdown 0) the batch tier gets exactly the leftover: nothing while an
    interactive prompt is chunked through the whole budget, the rest of the budget beside interactive decodes."""
    h = Harness(scheduler="iteration", max_num_seqs=8, max_num_batched_tokens=32, batch_tier_slowdown=0)
    [add(h, Tier.BATCH, prompt_len=8, max_tokens=200) for _ in range(4)]
    h.step()
    long = add(h, Tier.INTERACTIVE, prompt_len=200, max_tokens=3)
    while long.num_computed_tokens < 150:
        step = h.step()
        inter = sum(it.num_tokens for it in step.items if it.request.tier is Tier.INTERACTIVE)
        assert inter + 4 == 32 or inter == 32, "the interactive prompt takes all but the batch decodes' seats..."
        assert batch_in(step) in (0, 4)
    # the decodes of running lines come first in their own pass only after interactive work: here, the
    # prompt's chunks took the whole budget, so batch lines waited (their seats kept)
    assert any(batch_in(s) == 0 for s in h.steps[-5:])


def test_batch_decodes_wait_while_an_interactive_prompt_takes_the_budget():
    h = Harness(scheduler="iteration", max_num_seqs=8, max_num_batched_tokens=32, batch_tier_slowdown=0)
    lines = [add(h, Tier.BATCH, prompt_len=8, max_tokens=200) for _ in range(4)]
    h.step()
    long = add(h, Tier.INTERACTIVE, prompt_len=200, max_tokens=3)
    step = h.step()
    assert [it.request for it in step.items] == [long] and step.items[0].num_tokens == 32
    assert all(r.status.value == "running" for r in lines), "lines keep their seats and blocks meanwhile"
    while not long.finished:
        step = h.step()
        if long.output_token_ids:  # the interactive request decodes: the batch gets the rest of the budget
            assert batch_in(step) == 4


def test_a_preempted_line_resumes_from_its_cached_prefix():
    """A batch line taken back mid-decode keeps its output; readmitted, it recomputes only what its cached full
    blocks do not hold (prompt and generated tokens alike), not its whole sequence."""
    h = Harness(scheduler="iteration", max_num_seqs=1, block_size=4)
    line = add(h, Tier.BATCH, prompt_len=20, max_tokens=30)
    for _ in range(12):
        h.step()
    out_before = list(line.output_token_ids)
    chat = add(h, Tier.INTERACTIVE, prompt_len=6, max_tokens=2)
    step = h.step()
    assert step.reclaimed == [line] and line.status.value == "waiting"
    while not chat.finished:
        h.step()
    step = h.step()
    assert line.output_token_ids[:len(out_before)] == out_before
    (item,) = [it for it in step.items if it.request is line]
    total = 20 + len(out_before)
    assert item.num_tokens <= 4, f"recomputed {item.num_tokens} of {total} tokens: not from the cached prefix"
    h.run()
    assert len(line.output_token_ids) == 30


def test_fair_shares_hold_inside_the_batch_tier():
    """Two tenants' batches, the first one's lines all queued first: under fair the batch tier shares its seats
    between them (Jain's index of service while both wait), although tenant a also sends interactive requests all
    along, which come first and count in the interactive tier's shares alone (counted in the batch tier's too,
    they pushed a's batch down to half of b's: Jain 0.91)."""
    h = Harness(scheduler="fair", max_num_seqs=6)
    a = [add(h, Tier.BATCH, max_tokens=12, tenant="a") for _ in range(60)]
    b = [add(h, Tier.BATCH, max_tokens=12, tenant="b") for _ in range(60)]
    served = {"a": 0, "b": 0}
    for i in itertools.count():
        if not all(any(r.first_scheduled_time is None for r in reqs) for reqs in (a, b)):
            break
        chat = add(h, Tier.INTERACTIVE, prompt_len=64, max_tokens=6, tenant="a") if i % 2 == 0 else None
        step = h.step()
        assert chat is None or chat.first_token_time is not None
        for it in step.items:
            if it.samples and it.request.tier is Tier.BATCH:
                served[it.request.tenant_id] += 1
    x = list(served.values())
    assert sum(x) ** 2 / (len(x) * sum(v * v for v in x)) >= 0.98, served


def test_priorities_hold_inside_the_batch_tier():
    """Under priority, a batch line of higher priority preempts lower-priority lines; an interactive request of
    the lowest priority still goes before every batch line."""
    h = Harness(scheduler="priority", max_num_seqs=2)
    low = [add(h, Tier.BATCH, max_tokens=20, priority=5) for _ in range(2)]
    h.step()
    urgent = add(h, Tier.BATCH, max_tokens=3, priority=0)
    h.step()
    assert urgent.first_token_time is not None and sum(r.status.value == "running" for r in low) == 1
    chat = add(h, Tier.INTERACTIVE, max_tokens=2, priority=9)
    h.step()
    assert chat.first_token_time is not None
    h.run()


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_other_strategies_run_batch_lines_in_steps_left_empty(scheduler):
    """Strategies that do not share steps between requests keep their step shape: batch lines run only in steps
    with no interactive work, and interactive requests still take their seats back."""
    h = Harness(scheduler=scheduler, max_num_seqs=4, batch_size=2, static_flush_ms=1.0)
    lines = [add(h, Tier.BATCH, max_tokens=20) for _ in range(6)]
    for _ in range(6):
        h.step()
    assert batch_in(h.steps[-1]) > 0
    chats = [add(h, Tier.INTERACTIVE, max_tokens=5) for _ in range(2)]
    while not all(r.finished for r in chats):
        step = h.step()
        if any(it.request.tier is Tier.INTERACTIVE for it in step.items):
            assert batch_in(step) == 0, scheduler
    h.run()
    assert all(len(r.output_token_ids) == 20 for r in lines)


# scripted step costs: (fixed, per token, per sequence) seconds; a model whose tokens dominate, and one (like the
# tests' tiny model, or any small model on a fast device) whose per-sequence costs (sampling, detokenizing) do
COSTS = {"tokens": (0.02, 0.001, 0.0), "sequences": (0.002, 0.00001, 0.0005)}


def costed_step(h: Harness, cost: tuple[float, float, float]):
    step = h.step(dt=0.0)
    h.clock.now += seconds(step, cost)
    return step


def seconds(step, cost: tuple[float, float, float], tier: Tier | None = None) -> float:
    items = [it for it in step.items if tier is None or it.request.tier is tier]
    return cost[0] + cost[1] * sum(it.num_tokens for it in items) + cost[2] * len(items)


@pytest.mark.parametrize("shape", COSTS)
def test_the_batch_tier_keeps_interactive_steps_short(shape):
    """With a scripted step cost and a backlog of batch lines on 64 seats: a step of interactive decodes grows to at
    most 1.25x its own cost (their time per output token), a step with an interactive prompt carries no batch
    token, a step with batch lines alone while interactive work is about costs at most a typical interactive
    prompt's step; once interactive work has been gone batch_tier_quiet_s, batch lines get whole steps. Whether a
    step's cost is in its tokens or in its sequences (the cost model fits both)."""
    cost = COSTS[shape]
    h = Harness(num_blocks=4096, scheduler="iteration", max_num_seqs=64, max_num_batched_tokens=256,
                batch_tier_quiet_s=1.0)
    [add(h, Tier.BATCH, prompt_len=40, max_tokens=400) for _ in range(40)]
    for _ in range(8):
        costed_step(h, cost)
    chat = add(h, Tier.INTERACTIVE, prompt_len=24, max_tokens=40)
    first = costed_step(h, cost)
    assert chat.first_token_time is not None and batch_in(first) == 0
    decode_steps = 0
    while not chat.finished:
        step = costed_step(h, cost)
        assert seconds(step, cost) <= 1.25 * seconds(step, cost, Tier.INTERACTIVE) + 1e-9
        decode_steps += batch_in(step) > 0
    assert decode_steps > 30, "batch lines ride beside the interactive decodes"
    ref = cost[0] + cost[1] * 24 + cost[2]  # the interactive prompt's own step
    t_end = h.clock()
    sizes = []
    while h.clock() - t_end < 0.9 * 1.0:  # (the quiet window counts from the last step with interactive work)
        step = costed_step(h, cost)
        assert seconds(step, cost) <= ref + 1e-9
        sizes.append(step.num_tokens)
    assert min(sizes) >= 1
    h.clock.now = max(h.clock.now, h.sched.last_interactive + 1.01)  # quiet for a second: whole steps
    step = costed_step(h, cost)
    assert step.num_tokens > 100, step.num_tokens


def test_the_tier_cost_model_tells_sequences_from_tokens():
    m = SeqStepCost()
    assert m.fit() is None
    for tokens, seqs in ((1, 1), (8, 8), (64, 1), (40, 4), (200, 2), (16, 16)):
        m.observe_step(tokens, seqs, 0.01 + 0.0001 * tokens + 0.002 * seqs)
    assert m.fit() == pytest.approx((0.01, 0.0001, 0.002))
    decodes = SeqStepCost()  # decodes only: tokens and sequences cannot be told apart; the tokens carry both
    for n in (1, 4, 16, 2):
        decodes.observe_step(n, n, 0.01 + 0.003 * n)
    assert decodes.fit() == pytest.approx((0.01, 0.003, 0.0))


def test_the_batch_share_of_decode_steps_is_measured_on_them():
    """`DecodeShare`: probes first (no batch token until three steps of n decodes alone were timed), then one
    token until a batch token was timed, then (slowdown - 1) x ref / per-token; every probe_every-th step a
    probe again; a step faster than ref cannot open the gate past ref / max_tokens_per_ref per token."""
    share = DecodeShare(probe_every=4)
    assert [share.budget(1, 1.25) for _ in range(3)] == [0, 0, 0]
    for _ in range(3):
        share.observe(1, 0, 0.010)
    assert share.budget(1, 1.25) == 1
    share.observe(1, 1, 0.0104)  # a batch decode adds 0.4 ms
    assert [share.budget(1, 1.25) for _ in range(3)] == [6, 6, 0]  # 2.5 ms of room / 0.4 ms; the 4th call: a probe
    assert share.budget(2, 1.25) == 0  # two decodes: their own reference first
    for _ in range(20):
        share.observe(1, 4, 0.009)  # faster than alone (noise): the per-token cost floors at ref / 100
    assert max(share.budget(1, 1.25) for _ in range(3)) == 25


def test_the_batch_tier_holds_decode_steps_to_the_target_on_a_cost_no_line_fits():
    """A step cost no linear model fits (the first extra row costs a jump: another kernel path), with noise:
    interactive decodes beside 40 batch lines stay within 1.3x of their time alone on average, and batch lines
    still ride along in most of their steps."""
    rng = random.Random(3)

    def cost(step) -> float:
        rows = len(step.items)
        return (0.008 + 0.0004 * rows + (0.0008 if rows > 1 else 0.0)
                + 0.00002 * sum(it.num_tokens for it in step.items)) * rng.uniform(0.85, 1.15)

    h = Harness(num_blocks=4096, scheduler="iteration", max_num_seqs=64, max_num_batched_tokens=256,
                batch_tier_quiet_s=1.0)
    [add(h, Tier.BATCH, prompt_len=40, max_tokens=2000) for _ in range(40)]
    for _ in range(8):
        step = h.step(dt=0.0)
        h.clock.now += cost(step)
    ratios, with_batch = [], 0
    for _ in range(6):
        chat = add(h, Tier.INTERACTIVE, prompt_len=24, max_tokens=60)
        while not chat.finished:
            step = h.step(dt=0.0)
            took = cost(step)
            h.clock.now += took
            inter = [it for it in step.items if it.request.tier is Tier.INTERACTIVE]
            if inter and all(it.num_tokens == 1 for it in inter):
                alone = 0.008 + 0.0004 * len(inter) + 0.00002 * len(inter)
                ratios.append(took / alone)
                with_batch += batch_in(step) > 0
    assert sum(ratios) / len(ratios) <= 1.3, sum(ratios) / len(ratios)
    assert with_batch > len(ratios) / 2, (with_batch, len(ratios))
