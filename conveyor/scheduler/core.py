"""The scheduling *mechanism* shared by every batching strategy.

A step is a list of `(request, num_tokens)` under two limits, `max_num_seqs` and
`max_num_batched_tokens` (the token budget), and under the KV pool's free blocks. The mechanism
knows how to schedule a running request (preempting others by recompute when the pool is full),
how to admit a waiting one (reusing cached prefix blocks), and how to retire a finished one. The
*policy* (see `policies.py`) decides who goes first and who may join; nothing else differs between
static, dynamic, continuous and iteration-level batching.

Tiers (`conveyor.request.Tier`): batch lines (the Batch API) are a lower tier than every other request, and the
mechanism keeps them apart here, once, for every strategy. A step is planned in two passes. The interactive pass
runs the policy over the interactive requests alone, as if the batch tier were not there: it may take every seat
(`max_num_seqs`), the whole token budget and every KV block, and whatever of those batch lines hold is taken back
by preemption (recompute; a preempted line keeps what it generated and its full blocks stay in the prefix cache,
so it resumes from its cached prefix). The batch pass then runs a second instance of the same policy (its own
counters, timers and aging) over the batch lines, with the seats and tokens left over, cut further while
interactive traffic is about (`tier_budget`), so that a batch step never makes an interactive request wait much
longer than it would on an idle engine. Priorities, tenants' shares and deadlines hold inside each tier.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from conveyor.config import EngineConfig
from conveyor.kv_cache import KVCacheManager
from conveyor.outputs import FinishReason
from conveyor.request import Request, ScheduledItem, Status, Tier
from conveyor.scheduler.step_cost import DecodeShare, SeqStepCost, StepTimer

INTERACTIVE, BATCH = Tier.INTERACTIVE, Tier.BATCH
# the batch tier's share of a step while interactive work is about (`Scheduler.tier_budget`)
TIER_REF_DECAY = 0.8  # the running mean of interactive prompts' uncomputed tokens keeps this much of itself


@dataclass
class Step:
    """One step's plan, filled in by the policy through the `Scheduler` helpers."""

    token_budget: int
    max_seqs: int
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    reclaimed: list[Request] = field(default_factory=list)  # batch lines preempted for interactive work
    admitted: list[Request] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    lora_ids: set[int] = field(default_factory=set)  # distinct LoRA adapters in this step
    interactive_decodes: int | None = None  # a step of this many interactive decodes and batch lines (tier_budget)
    # an item feeds the last tokens of a prompt (or of a recompute, or of an embedding's input) and so ends with
    # that request's first token (or its result): kept as items are added (Scheduler.chunk_allowed asks per request)
    ends_a_prompt: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    def has_room(self) -> bool:
        return self.token_budget > 0 and len(self.items) < self.max_seqs

    def add(self, req: Request, n: int) -> None:
        self.items.append(ScheduledItem(req, n))
        self.ends_a_prompt |= n > 1 and req.num_computed_tokens + n == req.num_tokens
        self.scheduled_ids.add(req.request_id)
        self.token_budget -= n
        if req.lora_request is not None:
            self.lora_ids.add(req.lora_request.lora_int_id)

    def lora_fits(self, req: Request, max_loras: int) -> bool:
        """Whether `req` may join without the step holding more than `max_loras` distinct adapters."""
        lid = req.lora_int_id
        return lid is None or lid in self.lora_ids or len(self.lora_ids) < max_loras


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        # the seat limit: running sequences, and so sequences per step (vLLM's max_num_seqs). Read here, once,
        # where steps are planned; policies read it from the scheduler (a strategy switch keeps it)
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv
        self.policy = policy
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, list[Request]] = {}  # n > 1: siblings waiting for sample 0's prompt
        self.input_ended = False  # offline: no more requests will come (static batches may flush)
        self.num_preemptions = 0
        self.num_lora_deferrals = 0  # steps where requests for resident adapters went first (prefer_resident_loras)
        self.step_count = 0
        # tiers (see the module docstring)
        self.num_batch = 0  # batch-tier sequences here (waiting, held or running): none, and a step is one pass
        self._tiers: dict[Tier, tuple[list[Request], deque[Request]]] | None = None  # each tier's queues, mid-plan
        self._reclaimable: list[Request] = []  # batch lines the interactive pass may take seats and blocks from
        self.timer = StepTimer(SeqStepCost())  # how long steps take, for the batch tier's share (`tier_budget`)
        self.decode_share = DecodeShare()  # what batch tokens cost interactive decode steps, measured on them
        self.last_interactive: float | None = None  # when interactive work was last here (clock)
        self.interactive_prompt_tokens: float | None = None  # running mean of their prompts' uncomputed tokens

    @property
    def policy(self):
        """The strategy. Setting it also gives the batch tier a fresh instance of its own (a copy taken now, so
        the one given must not have served yet: the engine builds a new one for every switch)."""
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        self._policy = policy
        self.batch_policy = copy.deepcopy(policy)

    # --- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Siblings of an n > 1 request are held until sample 0 has computed the
        prompt, then fork its blocks instead of computing the prompt again."""
        self.requests[req.request_id] = req
        self.num_batch += req.tier is BATCH
        if req.fork_from is not None and not req.fork_from.finished:
            self.held.setdefault(req.fork_from.request_id, []).append(req)
        else:
            req.fork_from = None
            self.waiting.append(req)
            if self.kv.tier is not None and self._reuses_prefix(req):
                self.kv.prefetch(req)  # a disk tier reads its prefix blocks while it waits

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    # --- views of the queues (the engine's snapshot: /metrics and the dashboard) ---------------------------
    def _queued(self) -> Iterable[Request]:
        """Waiting sequences, n > 1 siblings held for their prompt included."""
        yield from self.waiting
        for v in self.held.values():
            yield from v

    def tenant_rows(self, tokens: dict[str, int]) -> tuple[tuple[str, int, int, int], ...]:
        """(tenant, running, waiting, tokens generated) for every tenant with a request now and every one in
        `tokens` (the engine's bounded count of generated tokens per tenant). Running and waiting are counted
        from the queues at each call rather than kept up to date at every transition: the queues are the only
        truth."""
        rows: dict[str, list[int]] = {t: [0, 0] for t in tokens}
        for r in self.running:
            rows.setdefault(r.tenant_id, [0, 0])[0] += 1
        for r in self._queued():
            rows.setdefault(r.tenant_id, [0, 0])[1] += 1
        return tuple((t, run, wait, tokens.get(t, 0)) for t, (run, wait) in sorted(rows.items()))

    def tier_counts(self) -> tuple[int, int]:
        """Batch-tier sequences (running, waiting), for /metrics and the dashboard."""
        if not self.num_batch:
            return 0, 0
        return (sum(r.tier is BATCH for r in self.running), sum(r.tier is BATCH for r in self._queued()))

    def lora_counts(self) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
        """Sequences per adapter name, (running, waiting) (vLLM's lora_requests_info)."""

        def count(reqs: Iterable[Request]) -> tuple[tuple[str, int], ...]:
            counts: dict[str, int] = {}
            for r in reqs:
                if r.lora_request is not None:
                    counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
            return tuple(sorted(counts.items()))

        return count(self.running), count(self._queued())

    def _release_held(self, source: Request) -> None:
        """Send `source`'s held siblings to the head of the queue (they fork if it still runs)."""
        for sib in reversed(self.held.pop(source.request_id, [])):
            if sib.prompt_logprobs is not None and len(source.prompt_logprobs or ()) > len(sib.prompt_logprobs):
                sib.prompt_logprobs = list(source.prompt_logprobs)  # the shared prompt's, computed once
            self._queues(sib)[1].appendleft(sib)

    def _queues(self, req: Request) -> tuple[list[Request], deque[Request]]:
        """The running list and waiting queue `req` belongs in: its tier's while a step is planned in tiers."""
        return self._tiers[req.tier] if self._tiers is not None else (self.running, self.waiting)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.finish(req, FinishReason.ABORT)
        return req

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        running, waiting = self._queues(req)
        if req.status is Status.RUNNING:
            running.remove(req)
        elif req in waiting:
            waiting.remove(req)
        elif req.fork_from is not None and req in self.held.get(req.fork_from.request_id, ()):
            self.held[req.fork_from.request_id].remove(req)
        self._release_held(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = self.clock()
        self.kv.free(req)
        if self.requests.pop(req.request_id, None) is not None:
            self.num_batch -= req.tier is BATCH

    def preempt(self, req: Request, step: Step) -> None:
        """Recompute-style preemption: drop its KV, send it to the head of the queue."""
        running, waiting = self._queues(req)
        running.remove(req)
        self.kv.free(req)
        self._release_held(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        waiting.appendleft(req)
        step.preempted.append(req)

    def _reclaim(self, step: Step) -> bool:
        """Take one batch line out of the running set for interactive work (the lowest priority, newest first):
        False when no batch line runs. Counted apart (`Step.reclaimed`): to the policy planning interactive work
        it is room that was free, not a sign that the KV pool is full."""
        if not self._reclaimable:
            return False
        victim = max(self._reclaimable, key=lambda r: (r.priority, r.arrival_time))
        self.preempt(victim, step)
        step.preempted.pop()
        step.reclaimed.append(victim)
        return True

    def _allocate(self, req: Request, n: int, step: Step, cached: list[int] = ()) -> bool:
        """`kv.allocate_slots`, taking blocks back from batch lines when the pool is short (interactive pass)."""
        while not self.kv.allocate_slots(req, n, cached):
            if not self._reclaim(step):
                return False
        return True

    def free_blocks(self) -> int:
        """KV blocks the policy planning now may count on: the free ones, and while interactive work is planned,
        those batch lines hold (taken back when needed)."""
        return self.kv.num_free_blocks + sum(self.kv.num_blocks_of(r) for r in self._reclaimable)

    # --- the step ---------------------------------------------------------------------------------
    def schedule(self) -> Step:
        timed = self.timer.observe(self)
        if timed is not None and timed[0].interactive_decodes is not None:
            last, seconds = timed
            batch = [it.num_tokens for it in last.items if it.request.tier is BATCH]
            if all(n == 1 for n in batch):  # decodes only (a prompt chunk costs less per token: not measured)
                self.decode_share.observe(last.interactive_decodes, len(batch), seconds)
        step = Step(self.config.max_num_batched_tokens, self.max_num_seqs)
        if self.kv.tier is not None:
            self.kv.poll_loads()  # blocks read from disk since the last step join the pool's cached blocks
        if self.num_batch:
            self._schedule_tiers(step)
        else:
            if self.running or self.waiting:
                self.last_interactive = self.clock()
            self._policy.schedule(self, step)
            self._note_interactive_prompts(step)
        self.timer.planned(self, step)
        self._add_guesses(step)
        for req in self.waiting:
            req.waited_steps += 1
            req.total_waited_steps += 1
        self.step_count += 1
        return step

    def _schedule_tiers(self, step: Step) -> None:
        """Plan a step with batch lines about: the interactive pass, then the batch pass (module docstring)."""
        inter_run = [r for r in self.running if r.tier is not BATCH]
        batch_run = [r for r in self.running if r.tier is BATCH]
        inter_wait = deque(r for r in self.waiting if r.tier is not BATCH)
        batch_wait = deque(r for r in self.waiting if r.tier is BATCH)
        if inter_run or inter_wait or any(r.tier is not BATCH for r in self._queued()):
            self.last_interactive = self.clock()
        self._tiers = {INTERACTIVE: (inter_run, inter_wait), BATCH: (batch_run, batch_wait)}
        seats = self.max_num_seqs
        try:
            # the interactive pass: every seat, token and block is there for the taking
            self.running, self.waiting = inter_run, inter_wait
            self._reclaimable = batch_run
            self._policy.schedule(self, step)
            self._note_interactive_prompts(step)
            while len(inter_run) + len(batch_run) > seats and self._reclaim(step):
                pass  # interactive requests took seats batch lines held
            self._reclaimable = []
            # the batch pass: what is left, in steps of every strategy that shares steps between requests (the
            # iteration family); the others (run-to-completion batches, prefill-only steps) keep their step shape,
            # and batch lines run in the steps interactive work leaves empty
            if step.items and not getattr(self._policy, "tiers_share_steps", False):
                return
            self.tier_budget(step)
            if not step.has_room():
                return  # nothing for the batch tier in this step: not even its queue's order is worth computing
            self.running, self.waiting = batch_run, batch_wait
            self.max_num_seqs = max(seats - len(inter_run), 0)
            self.batch_policy.schedule(self, step)
        finally:
            self.max_num_seqs = seats
            self._reclaimable = []
            self._tiers = None
            self.running = inter_run + batch_run
            self.waiting = deque([*inter_wait, *batch_wait])

    def _note_interactive_prompts(self, step: Step) -> None:
        """Keep a running mean of the uncomputed tokens of interactive prompts as they are admitted: the size of
        the step an interactive request's first token takes on an engine with nothing else to do."""
        for r in step.admitted:
            if r.tier is BATCH or r.num_preemptions:
                continue
            n = max(r.num_prompt_tokens - r.num_cached_tokens, 1)
            m = self.interactive_prompt_tokens
            self.interactive_prompt_tokens = n if m is None else TIER_REF_DECAY * m + (1 - TIER_REF_DECAY) * n

    def tier_budget(self, step: Step) -> None:
        """Cut the token budget the batch pass gets, while interactive work is about (it was here within
        `batch_tier_quiet_s`), so that interactive requests barely notice the batch tier:
        - a step that carries an interactive prompt (or a chunk of one) takes no batch tokens: a first token
          does not wait for batch work;
        - a step of interactive decodes may grow to `batch_tier_slowdown` x the time it takes alone, by what batch
          tokens were measured to add to such steps (`DecodeShare`), which bounds what the batch tier adds to
          their time per output token;
        - a step with no interactive work takes at most the cost of a typical interactive prompt's step (the
          running mean of their uncomputed tokens, by the online step-cost model `SeqStepCost`): an interactive
          request arriving while it runs waits at most about as long as its own first step takes.
        Nothing is cut without interactive traffic (the batch then runs at the engine's full throughput), with
        `batch_tier_slowdown` 0, or before the cost model has seen a step. A step with no interactive work always
        leaves the batch at least one token, so that it progresses in every step interactive work leaves empty."""
        cfg = self.config
        slowdown = cfg.batch_tier_slowdown
        now = self.clock()
        if (not slowdown or self.last_interactive is None or now - self.last_interactive > cfg.batch_tier_quiet_s
                or self.timer.cost.fit() is None):
            return
        if any(it.num_tokens - it.num_draft > 1 or not it.request.output_token_ids for it in step.items):
            step.token_budget = 0  # an interactive prompt (or a chunk of one, or a recompute) is in this step
            return
        if step.items:
            step.interactive_decodes = len(step.items)
            fit = self.decode_share.budget(len(step.items), slowdown)
        else:  # the step's fixed cost is paid anyway; the rest may grow to an interactive prompt's share
            a, b, c = self.timer.cost.fit()
            per_item = max(b + c, 1e-12)  # what a batch decode adds (a prompt token adds less: errs on the safe side)
            fit = max(int((b * (self.interactive_prompt_tokens or 1) + c) / per_item), 1)
        step.token_budget = min(step.token_budget, max(fit, 0))

    def _add_guesses(self, step: Step) -> None:
        """Speculative decoding: the guessed tokens of decoding sequences ride along in what is left of
        the token budget once the policy has placed every real token, so guesses never displace a
        decode or a prefill chunk, and never cause a preemption (no room: no guesses this step)."""
        for it in step.items:
            req = it.request
            if not req.spec_token_ids:
                continue
            d = min(len(req.spec_token_ids), step.token_budget)
            if it.num_tokens != 1 or req.num_remaining_work != 1 or d <= 0 or not self.kv.allocate_slots(req, 1 + d):
                req.spec_token_ids = []
                continue
            del req.spec_token_ids[d:]
            it.num_tokens += d
            it.num_draft = d
            step.token_budget -= d

    def schedule_running(self, step: Step, order: Iterable[Request], chunk: bool = True,
                         victims: Callable[[list[Request]], Request] | None = None) -> None:
        """Give each running request (in `order`) its pending tokens, preempting when KV runs out.

        `victims` picks whom to preempt from the running requests not yet scheduled this step
        (default: the newest arrival, as vLLM does). With `chunk=False` a request whose pending
        tokens do not fit the remaining budget waits for the next step instead of being split.
        """
        pick = victims or (lambda cands: max(cands, key=lambda r: r.arrival_time))
        for req in list(order):
            if req.status is not Status.RUNNING or not step.has_room() or req.request_id in step.scheduled_ids:
                continue  # (already in this step: a policy may serve some requests before the rest)
            if not step.lora_fits(req, self.config.max_loras):
                continue  # --max-loras adapters are in this step already: next step
            want = req.num_remaining_work
            n = min(want, step.token_budget)
            if n < want and not chunk and want <= self.config.max_num_batched_tokens:
                continue
            if not self.chunk_allowed(step, n, want):
                continue
            while not self._allocate(req, n, step):
                cands = [r for r in self.running if r is not req and r.request_id not in step.scheduled_ids]
                if not cands:
                    self.preempt(req, step)
                    break
                self.preempt(pick(cands), step)
            else:
                step.add(req, n)

    def chunk_allowed(self, step: Step, n: int, want: int) -> bool:
        """Whether `n` of a request's `want` pending tokens may join `step`: not a partial chunk of a prompt in a
        step that ends another prompt (`isolate_prompt_ends`). Why: the step's time is the sum of its tokens', and
        a partial chunk samples nothing, so it only makes the other prompt's first token later; in the next step it
        costs the same. Filling the budget anyway (vLLM's chunked prefill) buys a larger matrix product, which at a
        CPU's budgets (512 tokens and up) runs no faster per token. Measured with vLLM's client, 16 users sending
        prompts of 1,920-3,200 tokens to SmolLM2 on a Zen 3 (docs/performance.md): TTFT p50 11.1-11.7 -> 7.8-8.3 s,
        mean 21.0-22.4 -> 19.3-19.9 s, throughput level (two runs each). Nobody waits long for it: the refused
        request goes first next step (the ended prompt no longer competes), and only whole prompts that fit the
        rest of this one may pass it."""
        return n >= want or not self.config.isolate_prompt_ends or not step.ends_a_prompt

    def prefer_resident_loras(self, order: Iterable[Request], step: Step) -> list[Request]:
        """`order` (a policy's admission order) with requests for adapters already resident put first.

        Only when `--max-loras` is the limit (more distinct adapters among running and waiting requests
        than `max_loras`): a seat given to a request whose adapter is new to the running batch takes one
        of the few adapter slots, while one whose adapter already runs (or the base model's) fills the
        batch at no extra adapter: fewer adapters per step, fewer segments in every LoRA linear, and the
        batch stays full instead of holding requests that `Step.lora_fits` would skip. Resident means in
        the running batch or in this step. Without such a limit the policy's order is kept as it is.

        Bounded like the policies' aging: a request that has waited `priority_aging_steps` steps keeps
        its place in the policy's order; and while such a request's adapter cannot get a slot (the
        resident adapters take all `max_loras`), the resident adapter closest to done (least output left
        among its running requests) admits nobody who arrived after it, so that adapter drains and frees
        a slot. Without that, a steady stream for one resident adapter would hold `Step.lora_fits` shut
        for every other adapter forever; draining only one adapter (not all) keeps the batch as full as
        the bound allows. The order only changes who goes first, never what a request computes: outputs
        are the same (batch invariance)."""
        order = list(order)
        if not self.config.enable_lora or len(order) <= 1:
            return order
        resident = {r.lora_int_id for r in self.running} | step.lora_ids
        resident.discard(None)
        wanted = resident | {r.lora_int_id for r in order if r.lora_int_id is not None}
        if len(wanted) <= self.config.max_loras:
            return order  # every adapter fits in one step: no slot to save
        aging = max(self.config.priority_aging_steps, 1)
        since = min((r.arrival_time for r in order if r.lora_int_id is not None and r.lora_int_id not in resident
                     and r.waited_steps >= aging), default=None) if len(resident) >= self.config.max_loras else None
        drain = self._lora_to_drain() if since is not None else None
        first: list[Request] = []
        later: list[Request] = []
        for r in order:
            lid = r.lora_int_id
            if drain is not None and lid == drain and r.arrival_time > since:
                continue  # this adapter drains: an older request waits for its slot
            keep = lid is None or lid in resident or r.waited_steps >= aging
            (first if keep else later).append(r)
        self.num_lora_deferrals += bool(later) and bool(first)
        return first + later

    def _lora_to_drain(self) -> int | None:
        """The running adapter whose requests finish first (least output left at most), ties by id."""
        left: dict[int, int] = {}
        for r in self.running:
            if r.lora_int_id is not None:
                left[r.lora_int_id] = max(left.get(r.lora_int_id, 0), r.max_tokens - len(r.output_token_ids))
        return min(left, key=lambda lid: (left[lid], lid)) if left else None

    def admit(self, step: Step, req: Request, chunk: bool = True) -> bool:
        """Try to move `req` from waiting to running in this step. False when it does not fit."""
        if not step.has_room() or len(self.running) >= self.max_num_seqs:
            return False  # max_num_seqs caps the running set too (vLLM), not only one step's batch
        if not step.lora_fits(req, self.config.max_loras):
            return False
        if self._admit_fork(step, req):
            return True
        reuse = self._reuses_prefix(req)
        cached = self.kv.lookup_prefix(req) if reuse else []
        if reuse and self.kv.tier is not None:
            cached = self.kv.fetch_from_tier(req, cached)
            if cached is None:
                return False  # its prefix blocks are being read from disk: admitted once they are in
        num_cached = len(cached) * self.kv.block_size
        want = req.num_tokens - req.num_computed_tokens - num_cached
        n = min(want, step.token_budget)
        if n < want and not chunk and (want <= self.config.max_num_batched_tokens or step.items):
            return False  # whole prompts only; one longer than the whole budget goes alone, chunked
        if not self.chunk_allowed(step, n, want):
            return False
        if self.config.admission_reserve and not self._fits_with_reserve(req, num_cached):
            return False
        if not self._allocate(req, n, step, cached):
            return False
        self.kv.record_prefix_query(req.num_tokens, num_cached)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.RUNNING
        req.num_computed_tokens += num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        req.waited_steps = 0
        step.admitted.append(req)
        step.add(req, n)
        return True

    @staticmethod
    def _reuses_prefix(req: Request) -> bool:
        """Whether `req` may start from cached prefix blocks: not if it asks for prompt logprobs (or an
        embedding that pools every token), since a cached prefix has K/V but no logits."""
        wants_every_row = req.params.prompt_logprobs is not None or (req.pooling is not None
                                                                     and req.pooling.needs_every_token)
        return req.num_computed_tokens == 0 and not wants_every_row

    def _admit_fork(self, step: Step, req: Request) -> bool:
        """Parallel sampling: share every block of the sibling that computed the prompt, and
        recompute only the last prompt token (its own logits). That write lands in the shared,
        partly filled last block, so the KV manager copies that one block on write."""
        src = req.fork_from
        req.fork_from = None
        if (src is None or src.status is not Status.RUNNING or src.num_computed_tokens < req.num_prompt_tokens
                or req.num_computed_tokens != 0 or req.output_token_ids):
            return False
        self.kv.fork(src, req, req.num_prompt_tokens - 1)
        req.num_computed_tokens = req.num_prompt_tokens - 1
        if not self._allocate(req, 1, step):
            self.kv.free(req)
            req.num_computed_tokens = 0
            return False
        self.kv.record_prefix_query(req.num_tokens, req.num_prompt_tokens - 1)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.RUNNING
        req.num_cached_tokens = req.num_prompt_tokens - 1
        req.first_scheduled_time = req.first_scheduled_time or self.clock()
        step.admitted.append(req)
        step.add(req, 1)
        return True

    def _fits_with_reserve(self, req: Request, num_cached: int) -> bool:
        """mini-sglang's rule: admit only if this prompt, its remaining output, and what running
        requests may still write all fit, so that preemption should never be needed."""
        bs = self.kv.block_size

        def future_blocks(r: Request) -> int:
            final = min(r.num_prompt_tokens + r.max_tokens, self.max_model_len)
            return -(-final // bs) - self.kv.num_blocks_of(r)

        need = future_blocks(req) - num_cached // bs + sum(max(future_blocks(r), 0) for r in self.running)
        return need <= self.kv.num_free_blocks

    def update(self, step: Step, token_ids: list[int] | list[list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance every scheduled request; return (request, new tokens) for those that sampled.

        `token_ids` has one entry per sampling item: its token, or (speculative decoding) the list
        of its kept guesses followed by the token after them. Only the kept guesses count as
        computed; blocks that held nothing but rejected guesses go back to the pool."""
        sampled: list[tuple[Request, list[int]]] = []
        k = 0
        now = self.clock()
        for it in step.items:
            req = it.request
            samples = it.samples
            toks: list[int] = []
            if samples:
                entry = token_ids[k]
                k += 1
                toks = entry if isinstance(entry, list) else [entry]
            rejected = it.num_draft - (len(toks) - 1) if it.num_draft else 0
            req.num_computed_tokens += it.num_tokens - rejected
            if req.spec_token_ids:  # verified (or unused): the next guesses come after this step
                req.spec_token_ids = []
            if it.num_draft and not req.finished:
                req.output_token_ids.extend(toks[:-1])  # kept guesses, before their blocks are indexed
                self.kv.truncate(req, req.num_computed_tokens)
            self.kv.cache_full_blocks(req)
            if req.request_id in self.held and req.num_computed_tokens >= req.num_prompt_tokens:
                self._release_held(req)
            if samples:
                if req.finished:
                    continue
                req.output_token_ids.append(toks[-1])
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
                sampled.append((req, toks))
        return sampled
