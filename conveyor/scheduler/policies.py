"""The batching strategies, each a small policy over the shared `Scheduler` mechanism.

| policy     | who may join                          | prompt in first step | decodes during a prefill |
|------------|---------------------------------------|----------------------|--------------------------|
| static     | a batch of N, when N are waiting      | whole                | the batch runs together  |
| dynamic    | a batch, at N waiting or a timeout    | whole                | the batch runs together  |
| continuous | anyone, at every step                 | whole                | wait (prefill-first)     |
| iteration  | anyone, by priority with aging        | chunked, one budget  | go first, never stall    |
| priority   | as iteration; higher priority preempts lower when seats or KV run out (aging bounds it)  |
| fair       | as iteration; next from the tenant with the least weighted service (Virtual Token Counter); |
|            | a tenant below its share of seats takes one back from the tenant furthest above its own,   |
|            | and its short prompts go into the budget before running prefill chunks                      |
| slo        | as iteration; by latest start (TTFT deadline); requests that cannot make theirs last;    |
|            | prefill chunks cut to keep each step within the tightest running TPOT target              |

Adding a strategy touches this module only (its policy and its `PolicySpec`: options, colour, claim,
display name), plus its tests and docs; the engine, server and lab read everything from `POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.request import Request, Status
from conveyor.scheduler.core import Scheduler, Step
from conveyor.scheduler.step_cost import StepCost, StepTimer

__all__ = ["POLICIES", "Policy", "StepCost", "StepTimer", "make_policy"]  # StepCost: where tests and the lab look

if TYPE_CHECKING:
    from conveyor.config import EngineConfig


class Policy:
    name = "base"
    # whether batch lines may ride in the same steps as interactive requests (the iteration family: one token
    # budget shared by everyone); otherwise they run in the steps interactive work leaves empty (scheduler/core.py)
    tiers_share_steps = False

    def schedule(self, s: Scheduler, step: Step) -> None:
        raise NotImplementedError

    def adopt(self, s: Scheduler) -> None:
        """Take over a live scheduler's requests (a strategy switch on a running server): by default
        there is nothing to take over, the queues and the KV cache belong to the mechanism."""


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
    def adopt(self, s: Scheduler) -> None:
        """What runs now is the batch: it runs to completion before a new one forms."""
        self.batch = {r.group_id for r in s.running}

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
    tiers_share_steps = True

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
        before = len(step.preempted)  # a subclass may have preempted for a waiting request already
        s.schedule_running(step, decodes + prefills, chunk=True, victims=self.victim)
        if len(step.preempted) > before:
            return  # the pool is full: admitting more would only thrash
        if not step.has_room() or not s.waiting:
            return  # (ordering the queue looks every waiting request's prefix up: not for nothing)
        long_running = sum(1 for r in s.running if r.is_prefill and r.num_remaining_work > self.long_threshold)
        inflight = self.inflight_prefix_hashes(s, s.running)
        for req in s.prefer_resident_loras(self.order_waiting(s), step):
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
            elif s.kv.num_free_blocks == 0:
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


class PriorityPolicy(IterationPolicy):
    """vLLM's `priority` scheduling, preemptive: iteration-level batching, and when the running set
    (`max_num_seqs`) or the KV cache is full, a waiting request of strictly higher priority (lower
    value) preempts the lowest-priority running one (recompute: its KV is dropped, it waits again).

    Aging here counts a request's whole life of waiting (`total_waited_steps`), and a running request
    keeps the level it earned: a low-priority request that waited `gap * priority_aging_steps` steps in
    all ranks with the high-priority stream and can no longer be preempted by it, so a constant stream
    of high-priority work delays the rest by a bounded number of steps, never forever. A waiting
    request preempts with its own priority, not its aged one: requests of equal priority never
    preempt each other, so aging cannot make two of them take turns evicting each other.
    """

    name = "priority"

    def effective_priority(self, req: Request) -> int:
        return req.priority - req.total_waited_steps // self.aging_steps

    def victim(self, cands: list[Request]) -> Request:
        return max(cands, key=lambda r: (self.effective_priority(r), r.arrival_time))

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.preempt_for_waiting(s, step)
        super().schedule(s, step)

    def preempt_for_waiting(self, s: Scheduler, step: Step) -> None:
        """Make room, by preemption, for the waiting requests that outrank running ones (best first),
        as far as one step can take them."""
        if not s.waiting or not s.running:
            return
        bs = s.kv.block_size
        seqs = len(s.running)
        # blocks the running decodes will open this step (one each whose last block is full)
        blocks = sum(1 for r in s.running if r.num_remaining_work == 1 and s.kv.num_blocks_of(r) * bs < r.num_tokens)
        budget = step.token_budget
        for w in self.order_waiting(s):
            if budget <= 0:
                return
            level = w.priority  # waiting earns admission order, not the power to preempt (no churn)
            n = min(w.num_tokens - w.num_computed_tokens, budget)
            need = -(-n // bs)
            while seqs + 1 > s.max_num_seqs or blocks + need > s.free_blocks():
                cands = [r for r in s.running if self.effective_priority(r) > level]
                if not cands:
                    return  # nobody it outranks: it waits like everyone else
                v = self.victim(cands)
                blocks -= v.num_remaining_work == 1 and s.kv.num_blocks_of(v) * bs < v.num_tokens
                s.preempt(v, step)
                seqs -= 1
            seqs += 1
            blocks += need
            budget -= n


def parse_tenant_weights(spec: str | None) -> dict[str, float]:
    """`"a=2,b=1"` -> {"a": 2.0, "b": 1.0}; a file name (`@path`, lines of `name=weight`) works too."""
    if not spec:
        return {}
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            spec = ",".join(line.strip() for line in f if line.strip() and not line.startswith("#"))
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().rpartition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        if not sep or not name or not w > 0 or w == float("inf"):
            raise ValueError(f"tenant_weights must look like 'a=2,b=1' with positive weights, got {part!r}")
        out[name] = w
    return out


class FairPolicy(IterationPolicy):
    """Token-weighted fairness between tenants: the Virtual Token Counter (Sheng et al., OSDI 2024).

    - every tenant has a counter of the service it received: prompt tokens computed, plus
      `fair_output_token_weight` per generated token, divided by the tenant's weight
      (`tenant_weights`, default 1);
    - the step's mechanics are iteration's (decodes first, chunked prefill, one budget); the
      admission order differs: the next request comes from the backlogged tenant with the smallest
      counter (within a tenant: priority, then arrival);
    - seats: when the running set is full and a tenant holding less than its weighted share of
      `max_num_seqs` waits, the tenant furthest above its share gives one seat back (its newest
      request is preempted by recompute), so a quiet tenant's request starts at once beside a noisy
      one rather than after one of the noisy tenant's requests finishes;
    - budget: with two tenants or more, a tenant below its share gets its short waiting prompts into
      the step right after the decodes, before running prefill chunks (`serve_under_share_first`); a step
      that admits a light tenant's prompt (below) takes no other prefill;
    - counter lift: a tenant that becomes backlogged (arrives, or returns after an idle spell) starts
      at no less than the smallest counter of the tenants already waiting (or, with nobody waiting, of
      the last one to leave the queue), so idle time earns no credit to spend later in a burst;
    - light tenants: a tenant whose recent service (weighted tokens, fading by `RECENT_DECAY` per step)
      falls under `LIGHT_FRACTION` of the active tenants' mean while all its requests (running and
      waiting) fit in `max_num_seqs` becomes *light*, and stays light until it has more than the mean or
      more than `BACKLOG_SEATS` x `max_num_seqs` requests. A light tenant is never preempted for another's
      share; its waiting requests come first and may take seats past its share, heavy tenants giving back
      as many as it needs, down to none: it is served as it would be alone, for as long as its burst
      lasts. A quiet tenant's requests are short and rare; capping them at a seat share made them queue
      behind each other in every burst, while the noisy tenant, far above its share of service, kept its
      seats (leaving the noisy tenant one seat made the fourth request of a burst on four seats wait
      ~650 ms for one of the first three; and when a burst of five made the quiet tenant lose its
      lightness, its third seat was taken back). Two backlogged tenants receive about equal service, so
      neither becomes light and the seat shares hold. A backlog (more requests than seats) cannot become
      light, so one that comes back after an idle spell takes no more than its share (idle time earns no
      seats either), and a newcomer that was light for its first requests stops being light once they pile
      up past `BACKLOG_SEATS` x the seats (until then, for the first second or so of a flood, it is served
      as a light tenant). The gap between entering (half the mean) and leaving (the mean) keeps a tenant
      near the line from flipping;
    - short steps beside a light tenant: while one is around, a step takes at most `GUARD_STEPS` x a step
      of its decodes alone, the others' prompts going in chunks (`guard_light`), so that a light tenant's
      request arriving mid-step does not wait for a long prompt step of someone else's.
    """

    LIGHT_FRACTION = 0.5  # a tenant becomes light under this fraction of the active tenants' mean service
    RECENT_DECAY = 0.99  # per step: recent service fades with a half-life of ~70 steps
    BACKLOG_SEATS = 2  # a light tenant with more requests (running and waiting) than this x max_num_seqs is not
    GUARD_STEPS = 2.0  # beside a light tenant, a step takes at most this many steps of its decodes alone
    GUARD_MIN_PREFILL = 16  # ... and carries at least this many prefill tokens (prompts never stall)

    name = "fair"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.weights = parse_tenant_weights(config.tenant_weights)
        self.output_weight = config.fair_output_token_weight
        if not self.output_weight >= 0:
            raise ValueError(f"fair_output_token_weight must be >= 0, got {self.output_weight}")
        self.counters: dict[str, float] = {}
        self.backlogged: set[str] = set()
        self.last_left = 0.0  # counter of the last tenant whose queue emptied
        self.recent: dict[str, float] = {}  # weighted service, fading by RECENT_DECAY per step
        self.light: set[str] = set()  # tenants light now (see the class docstring)
        self.light_now: set[str] = set()  # ... that have requests now: served first
        self.timer = StepTimer()  # how long steps take, for the light tenant's guard (`guard_light`)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def lift(self, s: Scheduler) -> None:
        now = {r.tenant_id for r in s.waiting}
        stayed = now & self.backlogged
        for t in sorted(self.backlogged - now):
            self.last_left = self.counters.get(t, 0.0)
        base = min((self.counters.get(t, 0.0) for t in stayed), default=self.last_left)
        for t in sorted(now - self.backlogged):
            self.counters[t] = max(self.counters.get(t, 0.0), base)
        self.backlogged = now

    def order_waiting(self, s: Scheduler) -> list[Request]:
        self.lift(s)
        queues: dict[str, list[Request]] = {}
        for r in sorted(s.waiting, key=lambda r: (self.effective_priority(r), 0 if r.num_preemptions else 1,
                                                  r.arrival_time)):
            queues.setdefault(r.tenant_id, []).append(r)
        virtual = {t: self.counters.get(t, 0.0) for t in queues}
        seats: dict[str, int] = {}
        for r in s.running:
            seats[r.tenant_id] = seats.get(r.tenant_id, 0) + 1
        share = self.shares(s)
        out = []
        while queues:
            # a tenant that would go past its share of seats comes after those that would not (so a seat does
            # not go to one tenant only to be taken back by preemption a step later); then the counters; ties
            # (a tenant just lifted to another's counter) go to the one holding fewer seats
            # light tenants (see the class docstring) come first: far under the others' service, they would
            # win on a counter of recent service, and a seat taken back for one must not go to another
            t = min(queues, key=lambda t: (t not in self.light_now, seats.get(t, 0) + 1 > share[t], virtual[t],
                                           seats.get(t, 0), t))
            r = queues[t].pop(0)
            out.append(r)
            seats[t] = seats.get(t, 0) + 1
            virtual[t] += (r.num_tokens - r.num_computed_tokens + self.output_weight) / self.weight(t)
            if not queues[t]:
                del queues[t]
        return out

    def shares(self, s: Scheduler) -> dict[str, float]:
        """Each active tenant's fair share of the running set's seats, by weight."""
        active = {r.tenant_id for r in s.running} | {r.tenant_id for r in s.waiting}
        total = sum(self.weight(t) for t in active) or 1.0
        return {t: s.max_num_seqs * self.weight(t) / total for t in active}

    def update_light(self, s: Scheduler) -> None:
        """An active tenant whose requests fit in the seats becomes light under LIGHT_FRACTION of the active
        tenants' mean recent service (strictly: with nobody served yet, nobody is) and stops being light above
        the mean or past BACKLOG_SEATS x the seats. Tenants not active now keep their state: a quiet tenant is
        idle between its requests."""
        demand: dict[str, int] = {}
        for r in (*s.running, *s.waiting):
            demand[r.tenant_id] = demand.get(r.tenant_id, 0) + 1
        self.light_now = set()
        if len(demand) < 2:
            self.light -= demand.keys()
            return
        mean = sum(self.recent.get(t, 0.0) for t in demand) / len(demand)
        for t in demand:
            mine = self.recent.get(t, 0.0)
            if mine > mean or demand[t] > self.BACKLOG_SEATS * s.max_num_seqs:
                self.light.discard(t)
            elif mine < self.LIGHT_FRACTION * mean and demand[t] <= s.max_num_seqs:
                self.light.add(t)
        self.light_now = self.light & demand.keys()

    def may_take_seat(self, t: str, seats: dict[str, int], share: dict[str, float]) -> bool:
        return t in self.light_now or seats.get(t, 0) + 1 <= share[t]

    def preempt_for_share(self, s: Scheduler, step: Step) -> None:
        """Seats full and a tenant below its share (or a light one) waiting: take a seat back from the tenant
        furthest above its share (the newest of its requests, by recompute), so that a quiet tenant's request
        starts at once beside a noisy one instead of waiting for one of the noisy tenant's requests to
        finish. A tenant at or below its share is never preempted for another, nor is a light tenant, so
        this cannot churn; for a light tenant, heavy ones give seats down to none."""
        if not s.waiting or len(s.running) < s.max_num_seqs:
            return
        share = self.shares(s)
        seats: dict[str, int] = {}
        for r in s.running:
            seats[r.tenant_id] = seats.get(r.tenant_id, 0) + 1
        for w in self.order_waiting(s):
            t = w.tenant_id
            if not self.may_take_seat(t, seats, share):
                continue
            # a heavy tenant gives a seat down to its share; for a light tenant, down to none
            keep_share = t not in self.light_now
            over = [u for u in seats if u != t and u not in self.light
                    and seats[u] - 1 >= (share[u] if keep_share else 0)]
            if not over or sum(seats.values()) < s.max_num_seqs:
                break  # nobody to take from, or a seat is free for it (one taken back, not yet refilled)
            u = max(over, key=lambda u: (seats[u] - share[u], self.counters.get(u, 0.0), u))
            victim = max((r for r in s.running if r.tenant_id == u), key=lambda r: (r.arrival_time, r.request_id))
            s.preempt(victim, step)
            seats[u] -= 1
            seats[t] = seats.get(t, 0) + 1

    def serve_under_share_first(self, s: Scheduler, step: Step) -> None:
        """A tenant below its share of seats gets its waiting (short) prompts into this step before the
        prefill chunks of the running requests: decodes first as always, then these admissions, then the
        rest. Otherwise a running long prompt of the noisy tenant, chunked into the whole token budget,
        would hold the quiet tenant's request back for as many steps as that prompt has chunks, although
        a seat was free (or was just taken back for it)."""
        share = self.shares(s)
        if len(share) < 2:
            return  # one tenant: nobody to serve before anybody (iteration's order)
        seats: dict[str, int] = {}
        for r in s.running:
            seats[r.tenant_id] = seats.get(r.tenant_id, 0) + 1
        first = []
        for r in s.prefer_resident_loras(self.order_waiting(s), step):
            t = r.tenant_id
            if (self.may_take_seat(t, seats, share) and r.num_tokens - r.num_computed_tokens <= self.long_threshold
                    and len(s.running) + len(first) < s.max_num_seqs):
                first.append(r)
                seats[t] = seats.get(t, 0) + 1
        if not first:
            return
        before = len(step.preempted)
        s.schedule_running(step, [r for r in s.running if not r.is_prefill], chunk=True, victims=self.victim)
        if len(step.preempted) > before:
            return  # the KV pool is full: iteration's rule (admit nobody) applies
        light_prompt = False
        for r in first:
            if not step.has_room() or not s.admit(step, r, chunk=True):
                break
            light_prompt |= r.tenant_id in self.light_now
        if light_prompt:
            # a light tenant's prompt goes in a step of its own prompts and the decodes: no other tenant's
            # prefill chunk (a long prompt, or a preempted request's recompute) makes its first token wait
            step.token_budget = 0

    def guard_light(self, s: Scheduler, step: Step) -> None:
        """While a light tenant is around (served lately, idle or not) beside a heavy one, cut the step's
        budget so that it takes at most `GUARD_STEPS` x a step of its decodes alone (by the step-cost model,
        `StepCost`), keeping at least `GUARD_MIN_PREFILL` prefill tokens so that prompts never stall.

        A light tenant's request that arrives mid-step waits for the step in flight. Alone, that is one of its
        own short steps, or none; beside a heavy tenant it may be that tenant's prompt step: several prompts
        admitted together (a 32-token prompt beside 3 decodes took 104 ms on a 2-core Zen 3, four of them
        nearly 300 ms, a 4-row decode 28 ms). So the heavy tenant's prompts go in chunks that keep every step
        short. The cut costs a heavy tenant little: its decodes still run in every step, only its prompts
        take a few more steps. It lasts as long as the light tenant stays in the light set, whose recent
        service fades in ~1,000 steps of idleness; on a fast device a step's fixed cost dwarfs its tokens,
        and the cut allows whole prompts."""
        if not self.light or all(t in self.light for t in self.recent):
            return
        decodes = sum(1 + len(r.spec_token_ids) for r in s.running if not r.is_prefill)
        fit = self.timer.cost.tokens_within(self.GUARD_STEPS * self.timer.cost.seconds(decodes))
        if fit is None:
            return  # no step timed yet
        cap = max(fit, decodes + self.GUARD_MIN_PREFILL)
        step.token_budget = min(step.token_budget, max(cap - step.num_tokens, 0))

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.timer.observe(s)
        first = len(step.items)  # what this call plans (the step may hold another tier's items already)
        self.update_light(s)
        self.preempt_for_share(s, step)
        self.serve_under_share_first(s, step)
        self.guard_light(s, step)
        super().schedule(s, step)
        self.timer.planned(s, step)
        # fade; a tenant whose recent service has faded to nothing is dropped (tenants come and go by the thousand)
        self.recent = {t: v * self.RECENT_DECAY for t, v in self.recent.items() if v > 1e-3}
        for it in step.items[first:]:  # charge what this step serves
            r = it.request
            fed = it.num_tokens - it.num_draft
            decode = fed == 1 and r.num_computed_tokens >= r.num_prompt_tokens
            cost = (0 if decode else fed) + (self.output_weight if it.samples else 0)
            t = r.tenant_id
            self.counters[t] = self.counters.get(t, 0.0) + cost / self.weight(t)
            self.recent[t] = self.recent.get(t, 0.0) + cost / self.weight(t)
        # a light tenant gone quiet for good leaves the light set with its recent service (one back later is
        # judged afresh); one with requests stays, served in this step or not
        self.light &= self.recent.keys() | self.light_now


class SloPolicy(IterationPolicy):
    """Deadline-aware, for goodput (requests meeting both their TTFT and TPOT targets, per second) under
    overload, where plain earliest-deadline-first collapses: once the queue is longer than the targets,
    the earliest deadline belongs to a request that will miss it anyway, and serving it first makes the
    one behind it late too, until every request is late.

    - step time: the token budget of a step is cut so that, by the step-cost model (`StepCost`), every
      request decoding now keeps its TPOT (an average: time banked by fast steps may pay for a slow one)
      within `tpot_margin` x its target. The cut falls on prefill chunks (decodes go first, as in
      iteration); every decode still runs, and prefills keep at least `min_prefill_tokens` per step so
      that they never stall (a target that cannot be kept even so is ignored: see `token_cap`);
    - admission: waiting requests are walked in order of their latest start (TTFT deadline minus the time
      their prompt takes), and each one's first token is estimated from the prompt tokens of the requests
      ahead of it. A request whose estimate still meets its deadline is *reachable*: it is admitted first,
      and its prompt counts for those behind it. One that would miss it is *hopeless*: it goes behind every
      reachable request and every request without a target, in arrival order. It is demoted, never
      refused: it runs whenever the reachable ones leave room (as soon as the overload ends), and the
      oldest hopeless request that has waited `4 x priority_aging_steps` steps is rescued to the front,
      one at a time (the next only once the last has its first token), which bounds every wait under a
      sustained overload at a cost of at most one seat;
    - running decodes go by TPOT target, tightest first, when the budget is short.
    Priorities still rank above all of this, but without iteration's aging: aging promotes whoever waited
    longest, which under overload is first come first served again, the collapse this policy exists to
    avoid. The rescue above is what bounds waiting here.
    """

    name = "slo"
    tpot_margin = 0.9  # a step may take this much of the tightest TPOT target (the rest: scheduling, sampling)
    min_prefill_tokens = 16  # prefill tokens a step keeps whatever the TPOT targets (progress)

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.timer = StepTimer()
        self.cost = self.timer.cost
        self.rescued: Request | None = None  # the lost cause now served out of turn (bounds waiting)

    def token_cap(self, s: Scheduler) -> int | None:
        """The step's token budget under the TPOT targets of the requests decoding now (None: no cap).

        A TPOT is an average, (last token - first token) / (tokens - 1), so what a step may take is what
        keeps each such request's average within `tpot_margin` x its target once this step's token is
        out: `margin x target x k - (now - first token)` for a request with k tokens so far. A request
        that decoded faster than its target has banked the difference, and a longer step (a bigger
        prefill chunk) may spend it; one at its limit holds the step to a decode. Capping every step at
        the target instead cost a third of the throughput on a small model on a CPU, where a step's
        fixed cost dominates, and overloaded the machine it meant to protect. A request whose limit
        even a step of bare decodes would break is ignored: it misses its target whatever the cut, and
        cutting for it would only starve the prefills; the next tightest limit decides."""
        now = s.clock()
        decoding = [r for r in s.running if not r.is_prefill]
        floor = len(decoding) + self.min_prefill_tokens
        limits = sorted(self.tpot_margin * r.slo_tpot_s * len(r.output_token_ids) - (now - r.first_token_time)
                        for r in decoding if r.slo_tpot_s is not None and r.first_token_time is not None
                        and r.output_token_ids)
        for limit in limits:
            fit = self.cost.tokens_within(limit)
            if fit is None:
                return None
            if fit >= floor:
                return fit
        return None

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.timer.observe(s)
        cap = self.token_cap(s)  # the whole step's tokens (it may hold another tier's items already)
        if cap is not None and cap - step.num_tokens < step.token_budget:
            step.token_budget = max(cap - step.num_tokens, 0)
        s.running.sort(key=lambda r: (r.slo_tpot_s is None, r.slo_tpot_s or 0.0, r.arrival_time))
        super().schedule(s, step)
        self.timer.planned(s, step)

    def prefill_rate(self, s: Scheduler) -> float | None:
        """Prompt tokens per second a step serves beside the running decodes (None: no cost model yet)."""
        if self.cost.fit() is None:
            return None
        decodes = sum(1 for r in s.running if not r.is_prefill)
        room = s.config.max_num_batched_tokens - decodes
        cap = self.token_cap(s)
        if cap is not None:
            room = min(room, cap - decodes)
        room = max(room, 1)
        return room / max(self.cost.seconds(decodes + room), 1e-9)

    def order_waiting(self, s: Scheduler) -> list[Request]:
        now = s.clock()
        rate = self.prefill_rate(s)
        if self.rescued is not None and (self.rescued.finished or self.rescued.first_token_time is not None):
            self.rescued = None

        def need(r: Request) -> float:  # seconds of prefill before its first token
            return (r.num_tokens - r.num_computed_tokens) / rate if rate else 0.0

        def slack_key(r: Request):
            return (r.priority, r.ttft_deadline - need(r), r.arrival_time)

        targeted = sorted((r for r in s.waiting if r.ttft_deadline is not None), key=slack_key)
        # prompts being prefilled now come before any waiting one
        ahead = sum(r.num_remaining_work for r in s.running if r.is_prefill) / rate if rate else 0.0
        reachable, hopeless = [], []
        for r in targeted:
            if r.first_token_time is None and now + ahead + need(r) > r.ttft_deadline:
                hopeless.append(r)  # its first token would come too late (a preempted request has had it)
            else:
                reachable.append(r)
                ahead += need(r)
        untargeted = sorted((r for r in s.waiting if r.ttft_deadline is None),
                            key=lambda r: (r.priority, r.arrival_time))
        hopeless.sort(key=lambda r: (r.priority, r.arrival_time))
        patience = 4 * self.aging_steps
        if self.rescued is None:
            self.rescued = next((r for r in hopeless if r.total_waited_steps >= patience), None)
        head = [r for r in hopeless if r is self.rescued]
        rest = [r for r in hopeless if r is not self.rescued]
        # priorities rank above deadlines: a stable sort by priority keeps each group's order inside it
        return sorted(head + reachable + untargeted + rest, key=lambda r: r.priority)


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
class Claim:
    """A claim the lab tests about a strategy (`conveyor bench compare`'s verdicts): its `metric`
    ("throughput", or "latency": checked on p99 TTFT and median E2E) is below that of strategy `below`,
    or it is the `extreme` ("highest" | "lowest") of every strategy run. `text` may hold `{metric}`."""

    text: str
    metric: str
    below: str | None = None
    extreme: str | None = None


@dataclass(frozen=True)
class PolicySpec:
    """Everything the engine, the CLI and the lab (report, plots, dashboard, tuner) know about a policy."""

    name: str
    summary: str
    options: tuple[Option, ...]
    build: Callable[[EngineConfig], Policy]
    display: str = ""  # the name in reports and plots (default: `name`)
    color: str = "tab:purple"  # matplotlib colour in the lab's plots and the dashboard
    claim: str = ""  # what it promises, in a few words (the report quotes it to test it)
    tunable: bool = False  # `conveyor tune` tries it by default
    in_compare: bool = False  # `conveyor bench compare` runs it by default
    no_batching_base: bool = False  # with max_num_seqs 1 it is "no batching" (the lab's baseline)
    waits_for_end_of_input: Callable[[EngineConfig], bool] = lambda c: False  # offline: flushes only at the end
    claims: tuple[Claim, ...] = ()  # what the lab tests about it against the others

    @property
    def shown(self) -> str:
        return self.display or self.name

    def describe(self, config: dict) -> str:
        """Its options' values in `config` (a dict of EngineConfig fields), for reports."""
        parts = []
        for o in self.options:
            v = config.get(o.name)
            parts.append(f"{o.name} {v:g}" if isinstance(v, float) else f"{o.name} {v}")
        return ", ".join(parts)


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


TENANT_WEIGHTS = Option("tenant_weights", str, "fair: tenant shares, 'a=2,b=1' or @file of name=weight lines "
                        "(unnamed tenants: 1)")
OUTPUT_WEIGHT = Option("fair_output_token_weight", float, "fair: service a generated token counts for, in prompt "
                       "tokens (VTC's w_q / w_p)")

POLICIES: dict[str, PolicySpec] = {spec.name: spec for spec in (
    PolicySpec("static", "run-to-completion batches of batch_size", (BATCH_SIZE, STATIC_FLUSH_MS),
               lambda c: StaticPolicy(c.batch_size, _flush_s(c)), color="tab:red", in_compare=True,
               claim="medium throughput, high waiting latency",
               claims=(Claim("static has medium throughput, dynamic good (static < dynamic)", "throughput",
                             below="dynamic"),
                       Claim("static has the highest waiting latency ({metric})", "latency", extreme="highest")),
               waits_for_end_of_input=lambda c: _flush_s(c) is None),
    PolicySpec("dynamic", "run-to-completion batches at batch_size or after batch_timeout_ms",
               (BATCH_SIZE, BATCH_TIMEOUT_MS), lambda c: DynamicPolicy(c.batch_size, c.batch_timeout_ms / 1000),
               color="tab:orange", claim="good throughput, medium latency", in_compare=True,
               claims=(Claim("continuous has excellent throughput (dynamic < continuous)", "throughput",
                             below="continuous"),
                       Claim("dynamic has lower latency than static ({metric})", "latency", below="static"))),
    PolicySpec("continuous", "join and leave at every step, prompts prefilled whole first", (),
               lambda c: ContinuousPolicy(), color="tab:blue", claim="excellent throughput, low latency",
               tunable=True, in_compare=True, no_batching_base=True,
               claims=(Claim("continuous has lower latency than dynamic ({metric})", "latency", below="dynamic"),)),
    PolicySpec("iteration", "one token budget per step: decodes first, chunked prefill, priorities with aging",
               (PARTIAL_PREFILLS, LONG_PREFILL, AGING_STEPS), IterationPolicy, display="iteration-level",
               color="tab:green", claim="best of both", tunable=True, in_compare=True,
               claims=(Claim("iteration-level has the best throughput", "throughput", extreme="highest"),
                       Claim("iteration-level has the lowest latency ({metric})", "latency", extreme="lowest"))),
    PolicySpec("priority", "iteration, plus preemption: a waiting request of higher priority (lower value) "
               "preempts the lowest-priority running one when seats or KV run out; aging bounds the wait",
               (PARTIAL_PREFILLS, LONG_PREFILL, AGING_STEPS), PriorityPolicy, color="tab:brown",
               claim="a high-priority request starts at once, the rest still finish"),
    PolicySpec("fair", "iteration, admitting from the tenant with the least weighted service so far (Virtual "
               "Token Counter)", (TENANT_WEIGHTS, OUTPUT_WEIGHT, PARTIAL_PREFILLS, LONG_PREFILL, AGING_STEPS),
               FairPolicy, color="tab:cyan", claim="a quiet tenant is served as if alone; shares follow weights"),
    PolicySpec("slo", "iteration, admitting by TTFT deadline while it is reachable (the rest go last, still "
               "served); prefill chunks cut to keep steps within the running TPOT targets",
               (PARTIAL_PREFILLS, LONG_PREFILL, AGING_STEPS), SloPolicy, color="tab:pink",
               claim="more requests meet their latency targets under overload", tunable=True),
)}


def no_batching_base() -> str:
    """The strategy that, run with max_num_seqs 1, is the lab's "no batching" baseline."""
    return next(name for name, spec in POLICIES.items() if spec.no_batching_base)


def default_strategies(what: str) -> list[str]:
    """The strategies `conveyor bench compare` (`what="compare"`) or `conveyor tune` (`"tune"`) runs by default."""
    flag = {"compare": "in_compare", "tune": "tunable"}[what]
    return [name for name, spec in POLICIES.items() if getattr(spec, flag)]


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


def coerce_options(name: str, options: dict) -> dict[str, object]:
    """Options for policy `name` given as JSON values: checked against its `PolicySpec` (unknown names and
    wrong types are a ValueError naming them) and converted to the option's type."""
    spec = check_scheduler(name)
    known = {o.name: o for o in spec.options}
    out: dict[str, object] = {}
    for key, value in options.items():
        opt = known.get(key)
        if opt is None:
            raise ValueError(f"{name} takes no option {key!r} (its options: {', '.join(known) or 'none'})")
        ok = (value is None or (opt.type is str and isinstance(value, str))
              or (opt.type in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
                  and (opt.type is float or float(value).is_integer())))
        if not ok:
            raise ValueError(f"{key} must be {opt.type.__name__}, got {value!r}")
        out[key] = opt.type(value) if value is not None else None
    return out


def check_scheduler(name: str) -> PolicySpec:
    """The policy called `name`, or a ValueError listing the names there are."""
    spec = POLICIES.get(name)
    if spec is None:
        raise ValueError(f"scheduler must be one of {tuple(POLICIES)}, got {name!r}")
    return spec


def make_policy(config: EngineConfig) -> Policy:
    return check_scheduler(config.scheduler).build(config)
