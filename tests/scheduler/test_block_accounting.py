"""Property-based: whatever arrives when, every policy keeps the KV pool's books straight.

A model-free driver runs `Scheduler` + `KVCacheManager` as the engine does (schedule -> fake run ->
update -> stop checks). Beyond the counting invariants, the fake runner keeps a *simulated KV
cache*: every slot a step writes records which token, at which position, it holds. Before a step
"runs", every slot its requests will read must hold their own tokens. That catches a block handed
to two writers, a prefix-cache hit on a block that was evicted or overwritten, a missed
copy-on-write, and a block table that does not cover the tokens being written.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import EngineConfig
from conveyor.engine.output_processor import check_stop
from conveyor.kv_cache import KVCacheManager
from conveyor.request import Request, Status
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler, Step
from conveyor.scheduler.policies import POLICIES, make_policy

FAKE_TOKEN = 3  # what the fake model "samples"; prompts use a tiny alphabet so prefixes repeat


@dataclass
class Spec:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    n: int = 1  # parallel samples: siblings fork sample 0's prompt blocks
    priority: int = 0  # the priority / fair / slo policies preempt or reorder by these
    tenant: str | None = None
    slo_ttft_s: float | None = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_blocks = draw(st.integers(2, 40))
    capacity = num_blocks * block_size
    n_req = draw(st.integers(1, 10))
    shared = draw(st.lists(st.integers(0, 3), min_size=0, max_size=40))  # a common prefix, sometimes
    specs = []
    for _ in range(n_req):
        max_tokens = draw(st.integers(1, min(24, capacity - 1)))
        plen = draw(st.integers(1, min(80, capacity - max_tokens)))
        use_shared = draw(st.booleans())
        prompt = (shared + draw(st.lists(st.integers(0, 3), min_size=plen, max_size=plen)))[:plen] \
            if use_shared else draw(st.lists(st.integers(0, 3), min_size=plen, max_size=plen))
        specs.append(Spec(draw(st.integers(0, 30)), prompt, max_tokens, draw(st.sampled_from([1, 1, 2, 3])),
                          draw(st.integers(0, 3)), draw(st.sampled_from([None, "a", "b"])),
                          draw(st.sampled_from([None, 0.002, 0.05]))))
    config = dict(
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 96)),
        batch_size=draw(st.integers(1, 6)),
        batch_timeout_ms=draw(st.sampled_from([0.0, 5.0, 1000.0])),
        enable_prefix_caching=draw(st.booleans()),
        max_num_partial_prefills=draw(st.integers(1, 3)),
        admission_reserve=draw(st.booleans()),
        priority_aging_steps=draw(st.sampled_from([1, 4, 64])),
        tenant_weights=draw(st.sampled_from([None, "a=2,b=1"])),
    )
    return num_blocks, specs, config


class SimulatedKV:
    """Which (token, position) each physical slot holds, written as the runner would write it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.slots[dst * self.bs:(dst + 1) * self.bs] = self.slots[src * self.bs:(src + 1) * self.bs]

    def run(self, step: Step, tables: dict[str, list[int]]) -> None:
        for it in step.items:
            req, table = it.request, tables[it.request.request_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + it.num_tokens
            tokens = req.all_token_ids
            assert len(table) * self.bs >= end, "block table does not cover the tokens being written"
            for pos in range(start, end):  # write this step's KV
                self.slots[table[pos // self.bs] * self.bs + pos % self.bs] = (tokens[pos], pos)
        for it in step.items:  # then every query reads its whole context
            req, table = it.request, tables[it.request.request_id]
            end = req.num_computed_tokens + it.num_tokens
            tokens = req.all_token_ids
            for pos in range(end):
                got = self.slots[table[pos // self.bs] * self.bs + pos % self.bs]
                assert got == (tokens[pos], pos), \
                    f"{req.request_id} reads {got} at position {pos}, expected {(tokens[pos], pos)}"


def check_pool(kv: KVCacheManager, sched: Scheduler) -> None:
    pool = kv.pool
    refs = Counter(b for table in kv.block_tables.values() for b in table)
    assert all(c >= 0 for c in pool.ref_cnt), "negative reference count"
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == refs.get(b, 0), f"block {b}: ref_cnt {pool.ref_cnt[b]} vs {refs.get(b, 0)} tables"
    in_tables = set(refs)
    assert not in_tables & set(pool.free), "a block is both free and in a block table"
    assert len(in_tables) + pool.num_free == pool.num_blocks, "a block is neither free nor in use"
    assert pool.num_used <= pool.num_blocks
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h, "the prefix index points at a block holding something else"
    # only running requests hold blocks; a waiting (new or preempted) request holds none
    assert set(kv.block_tables) <= {r.request_id for r in sched.running}
    for r in sched.waiting:
        assert r.status is Status.WAITING and r.request_id not in kv.block_tables


def drive(policy: str, num_blocks: int, specs: list[Spec], config: dict) -> None:
    cfg = EngineConfig(model="unused", scheduler=policy, **config)
    clock = Clock()
    kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    max_model_len = num_blocks * cfg.block_size
    sched = Scheduler(cfg, kv, make_policy(cfg), max_model_len, clock=clock)
    sim = SimulatedKV(num_blocks, cfg.block_size)
    reqs: list[Request] = []
    pending = sorted(enumerate(specs), key=lambda x: x[1].arrival_step)
    last_arrival = max(s.arrival_step for s in specs)
    step_no = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1].arrival_step <= step_no:
            i, s = pending.pop(0)
            params = SamplingParams(n=s.n, max_tokens=s.max_tokens, ignore_eos=True)
            group: list[Request] = []
            for k in range(s.n):  # as LLMEngine.add_request fans out n > 1
                req = Request(f"r{i}#{k}", list(s.prompt), params.for_sample(k), parent_id=f"r{i}", index=k,
                              arrival_time=clock(), fork_from=group[0] if group else None, priority=s.priority,
                              tenant=s.tenant, slo_ttft_s=s.slo_ttft_s)
                sched.add(req)
                group.append(req)
            reqs.extend(group)
        sched.input_ended = step_no >= last_arrival  # offline: static batches may flush now
        step = sched.schedule()

        assert len(step.items) <= cfg.max_num_seqs
        assert step.num_tokens <= cfg.max_num_batched_tokens
        assert all(it.num_tokens >= 1 for it in step.items)
        assert len({it.request.request_id for it in step.items}) == len(step.items), "request scheduled twice"
        assert all(it.request.status is Status.RUNNING for it in step.items)
        check_pool(kv, sched)
        # no step writes into a block another table also holds (copy-on-write must have happened)
        for it in step.items:
            r, table = it.request, kv.block_tables[it.request.request_id]
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + it.num_tokens):
                assert kv.pool.ref_cnt[table[pos // cfg.block_size]] == 1, "writing into a shared block"

        sim.apply_copies(kv.take_copies())
        sim.run(step, kv.block_tables)
        n_samplers = sum(1 for it in step.items if it.samples)
        for req, tok in sched.update(step, [FAKE_TOKEN] * n_samplers):
            stop = check_stop(req, tok, "", max_model_len)
            if stop is not None:
                sched.finish(req, *stop)
        check_pool(kv, sched)

        step_no += 1
        clock.now += 0.001
        assert step_no < 20_000, "the scheduler stopped making progress"

    assert len(reqs) == sum(s.n for s in specs)
    for req in reqs:
        s = specs[int(req.group_id[1:])]
        assert req.finished and req.finish_reason == "length"
        assert req.output_token_ids == [FAKE_TOKEN] * s.max_tokens
    assert kv.pool.num_free == num_blocks
    assert not kv.block_tables and all(c == 0 for c in kv.pool.ref_cnt)
    assert not sched.running and not sched.waiting


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_static_block_accounting(scenario):
    drive("static", *scenario)


@SETTINGS
@given(scenarios())
def test_dynamic_block_accounting(scenario):
    drive("dynamic", *scenario)


@SETTINGS
@given(scenarios())
def test_continuous_block_accounting(scenario):
    drive("continuous", *scenario)


@SETTINGS
@given(scenarios())
def test_iteration_block_accounting(scenario):
    drive("iteration", *scenario)


@SETTINGS
@given(scenarios())
def test_priority_block_accounting(scenario):
    drive("priority", *scenario)


@SETTINGS
@given(scenarios())
def test_fair_block_accounting(scenario):
    drive("fair", *scenario)


@SETTINGS
@given(scenarios())
def test_slo_block_accounting(scenario):
    drive("slo", *scenario)


def test_every_policy_is_covered():
    covered = {name.split("_")[1] for name in globals() if name.endswith("_block_accounting")}
    assert covered == set(POLICIES)

