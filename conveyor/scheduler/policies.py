"""The four batching strategies, each a small policy over the shared `Scheduler` mechanism.

| policy     | who may join                          | prompt in first step | decodes during a prefill |
|------------|---------------------------------------|----------------------|--------------------------|
| static     | a batch of N, when N are waiting      | whole                | the batch runs together  |
| dynamic    | a batch, at N waiting or a timeout    | whole                | the batch runs together  |
| continuous | anyone, at every step                 | whole                | wait (prefill-first)     |
| iteration  | anyone, by priority with aging        | chunked, one budget  | go first, never stall    |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.request import Request, Status
from conveyor.scheduler.core import Scheduler, Step

if TYPE_CHECKING:
    from conveyor.config import EngineConfig


class Policy:
    name = "base"

    def schedule(self, s: Scheduler, step: Step) -> None:
        raise NotImplementedError


class ContinuousPolicy(Policy):
    """Orca / early vLLM: FCFS; newcomers are prefilled whole, and a step with prefills runs only
    prefills (running decodes wait one step); otherwise every running request decodes."""

    name = "continuous"

    def schedule(self, s: Scheduler, step: Step) -> None:
        while s.waiting and s.admit(step, s.waiting[0], chunk=False):
            pass
        if step.items:
            return
        s.schedule_running(step, s.running, chunk=False)


class StaticPolicy(Policy):
    """Run-to-completion batches: wait until `batch_size` requests are waiting (or the input has
    ended offline, or `flush_after_s` passed for the oldest), take them, and admit nobody else
    until every member has finished. Finished members' slots stay idle meanwhile."""

    name = "static"

    def __init__(self, batch_size: int, flush_after_s: float | None = None) -> None:
        self.batch_size = batch_size
        self.flush_after_s = flush_after_s
        self.batch: set[str] = set()  # group ids of the running batch
    def ready(self, s: Scheduler) -> bool:
        if len(s.waiting) >= self.batch_size or (s.input_ended and s.waiting):
            return True
        oldest = min((r.arrival_time for r in s.waiting), default=None)
        return (oldest is not None and self.flush_after_s is not None
                and s.clock() - oldest >= self.flush_after_s)

    def schedule(self, s: Scheduler, step: Step) -> None:
        # the batch is a set of user requests (group ids), so n > 1 siblings belong to it too
        if self.batch and not any(r.group_id in self.batch for r in s.requests.values()):
            self.batch = set()  # every member finished: the batch is over
        if not self.batch:
            if not self.ready(s):
                return
            self.batch = {r.group_id for r in list(s.waiting)[: self.batch_size]}
        s.schedule_running(step, s.running, chunk=True,
                           victims=lambda cands: max(cands, key=lambda r: r.arrival_time))
        for req in [r for r in s.waiting if r.group_id in self.batch]:
            if not s.admit(step, req, chunk=True):
                break


class DynamicPolicy(StaticPolicy):
    """Like static, but a batch also starts when the oldest waiting request has waited
    `timeout_s` (Triton's dynamic batcher): bounded waiting, still run to completion."""

    name = "dynamic"

    def __init__(self, batch_size: int, timeout_s: float) -> None:
        super().__init__(batch_size, flush_after_s=timeout_s)


class IterationPolicy(Policy):
    """vLLM v1 / Sarathi style: one token budget per step shared by decodes and prefill chunks.

    - running decodes are scheduled first, so a long prompt never stalls the streams;
    - prompts are chunked into what is left of the budget; at most `max_partial_prefills` long
      prompts are in flight at once, so short ones are not stuck behind them;
    - waiting requests go by effective priority (lower first), which improves by one level every
      `aging_steps` steps of waiting, so nobody starves; ties go to requests whose prefix is
      cached (bounded by the same aging), then to the oldest; a request whose next uncached block
      another request is computing right now waits for it (also bounded), so a shared system prompt
      arriving in a burst is computed once, not once per request;
    - preemption picks the lowest-priority, newest running request.
    """

    name = "iteration"

    def __init__(self, config: EngineConfig) -> None:
        self.max_partial_prefills = config.max_num_partial_prefills
        self.long_threshold = config.long_prefill_token_threshold or max(config.max_num_batched_tokens // 8, 1)
        self.aging_steps = max(config.priority_aging_steps, 1)

    def effective_priority(self, req: Request) -> int:
        return req.priority - req.waited_steps // self.aging_steps

    def victim(self, cands: list[Request]) -> Request:
        return max(cands, key=lambda r: (r.priority, r.arrival_time))

    def schedule(self, s: Scheduler, step: Step) -> None:
        decodes = [r for r in s.running if not r.is_prefill]
        prefills = [r for r in s.running if r.is_prefill]
        prefills.sort(key=lambda r: (r.priority, r.arrival_time))
        s.schedule_running(step, decodes + prefills, chunk=True, victims=self.victim)
        if step.preempted:
            return  # the pool is full: admitting more would only thrash
        long_running = sum(1 for r in s.running if r.is_prefill and r.num_remaining_work > self.long_threshold)
        inflight = self.inflight_prefix_hashes(s, s.running)
        for req in self.order_waiting(s):
            if not step.has_room():
                break
            is_long = req.num_tokens - req.num_computed_tokens > self.long_threshold
            if is_long and long_running >= self.max_partial_prefills:
                continue
            if self.prefix_in_flight(s, req, inflight):
                continue
            if s.admit(step, req, chunk=True):
                long_running += is_long and req.num_remaining_work > 0
                inflight |= self.inflight_prefix_hashes(s, [req])
            elif s.kv.pool.num_free == 0:
                break

    @staticmethod
    def inflight_prefix_hashes(s: Scheduler, reqs) -> set[int]:
        """Hashes of prompt blocks that running requests are computing now (not yet cached)."""
        if not s.kv.enable_caching:
            return set()
        out: set[int] = set()
        for r in reqs:
            if r.num_computed_tokens < r.num_prompt_tokens and r.num_preemptions == 0:
                out.update(s.kv.prefix_block_hashes(r)[r.num_computed_tokens // s.kv.block_size:])
        return out

    def prefix_in_flight(self, s: Scheduler, req: Request, inflight: set[int]) -> bool:
        """Hold a request back while another one is computing the very prefix it would reuse: a step
        later that prefix is cached, instead of computed twice side by side. Bounded by aging."""
        if not inflight or req.waited_steps >= self.aging_steps or req.num_computed_tokens:
            return False
        hashes = s.kv.prefix_block_hashes(req)
        cached = len(s.kv.lookup_prefix(req))
        return cached < len(hashes) and hashes[cached] in inflight

    def order_waiting(self, s: Scheduler) -> list[Request]:
        waiting = list(s.waiting)
        if len(waiting) <= 1:
            return waiting
        bs = s.kv.block_size

        def key(r: Request):
            fresh = r.waited_steps < self.aging_steps  # the cache preference is bounded by aging
            cached = len(s.kv.lookup_prefix(r)) * bs if fresh and r.status is Status.WAITING else 0
            preempted_first = 0 if r.num_preemptions else 1
            return (self.effective_priority(r), preempted_first, -cached, r.arrival_time)

        return sorted(waiting, key=key)


# --- the registry: one table for the engine, the CLI and the lab ----------------------------------------
@dataclass(frozen=True)
class Option:
    """A policy knob: the `EngineConfig` field of this name, and the CLI flag `--name-with-dashes`."""

    name: str
    type: type
    help: str
    cli_default: object = None  # the CLI's default where it differs from EngineConfig's (servers, the lab)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class PolicySpec:
    name: str
    summary: str
    options: tuple[Option, ...]
    build: Callable[[EngineConfig], Policy]


BATCH_SIZE = Option("batch_size", int, "static/dynamic: requests per batch")
STATIC_FLUSH_MS = Option("static_flush_ms", float, "static: run a partial batch once its oldest request waited "
                         "this long, in ms (0 or unset: only when the batch fills or the input ends)", 1000.0)
BATCH_TIMEOUT_MS = Option("batch_timeout_ms", float, "dynamic: the longest the oldest request waits for a batch, ms")
PARTIAL_PREFILLS = Option("max_num_partial_prefills", int, "iteration: long prompts prefilled at once")
LONG_PREFILL = Option("long_prefill_token_threshold", int,
                      "iteration: a prompt longer than this counts as long (0: max_num_batched_tokens / 8)")
AGING_STEPS = Option("priority_aging_steps", int, "iteration: steps of waiting that earn one priority level")


def _flush_s(config: EngineConfig) -> float | None:
    ms = config.static_flush_ms
    return ms / 1000.0 if ms else None


POLICIES: dict[str, PolicySpec] = {spec.name: spec for spec in (
    PolicySpec("static", "run-to-completion batches of batch_size", (BATCH_SIZE, STATIC_FLUSH_MS),
               lambda c: StaticPolicy(c.batch_size, _flush_s(c))),
    PolicySpec("dynamic", "run-to-completion batches at batch_size or after batch_timeout_ms",
               (BATCH_SIZE, BATCH_TIMEOUT_MS), lambda c: DynamicPolicy(c.batch_size, c.batch_timeout_ms / 1000)),
    PolicySpec("continuous", "join and leave at every step, prompts prefilled whole first", (),
               lambda c: ContinuousPolicy()),
    PolicySpec("iteration", "one token budget per step: decodes first, chunked prefill, priorities with aging",
               (PARTIAL_PREFILLS, LONG_PREFILL, AGING_STEPS), IterationPolicy),
)}


def all_options() -> list[Option]:
    """Every policy option once, in table order (the CLI adds one flag for each)."""
    seen: dict[str, Option] = {}
    for spec in POLICIES.values():
        for opt in spec.options:
            seen.setdefault(opt.name, opt)
    return list(seen.values())


def policy_options(config: EngineConfig) -> dict[str, object]:
    """The options of `config`'s policy, with their values (what the lab's reports show)."""
    return {o.name: getattr(config, o.name) for o in POLICIES[config.scheduler].options}


def make_policy(config: EngineConfig) -> Policy:
    return POLICIES[config.scheduler].build(config)
