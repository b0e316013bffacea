"""`AsyncEngine`: the asyncio face of the engine loop, for the HTTP side.

The engine itself runs in an `EngineLoop` (`conveyor/engine/loop.py`), in a thread of this
process or in its own process (`--engine-loop thread|process`); this class only speaks the loop's
typed messages:
- `submit` sends an `EngineRequest` (`conveyor/request.py`) per prompt and returns a `Submission`, an
  async iterator of that call's `StepDelta`s; closing it (client gone, error, shutdown) sends `AbortRequest`s;
- every `LoopOutput` the loop emits is handed to the event loop in one `call_soon_threadsafe`, which
  routes its deltas to their submissions and publishes its snapshot for `/metrics` and the log;
- if the engine dies (a step raised, the engine process was killed), health turns 503, new calls
  get `EngineDeadError` and every open call receives it too.
Validation (sampling params, tokenization, chat templates, prompt length) is the HTTP side's job,
done with the engine's `EngineInfo`, so bad input never reaches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from conveyor.engine.clients import EngineClient, EngineDeadError, InlineEngineClient
from conveyor.engine.messages import (
    AbortRequest,
    LoopOutput,
    SchedulerSwitch,
    SetScheduler,
    Stop,
    UnloadLoRA,
)
from conveyor.outputs import FinishReason, StepDelta
from conveyor.request import EngineRequest, Tier, sequence_ids
from conveyor.server.metrics import EngineStats, ServerMetrics

log = logging.getLogger("conveyor.server")
request_log = logging.getLogger("conveyor.server.requests")

__all__ = ["EngineRequest", "AsyncEngine", "EngineDeadError", "QueueFullError", "Submission"]


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests` sequences, or `max_queued_tokens` prompt tokens, already."""


@dataclass
class _Seq:
    """Loop-side timing of one sequence, for metrics and the request log."""

    arrival: float
    first_t: float | None = None
    last_t: float | None = None
    num_tokens: int = 0
    finish_reason: FinishReason | None = None


class Submission:
    """One API call: its engine requests feed one asyncio queue; `close()` aborts what is unfinished.

    Iterate it (`async for delta in sub`) to receive `StepDelta`s; iteration ends once every
    sequence has finished and raises `EngineDeadError` if the engine dies meanwhile.
    """

    def __init__(self, engine: AsyncEngine, api_id: str, inputs: list[EngineRequest], arrival: float) -> None:
        self.engine = engine
        self.api_id = api_id
        self.inputs = inputs
        self.arrival = arrival
        self.queue: asyncio.Queue[StepDelta | BaseException] = asyncio.Queue()
        self.seqs: dict[str, _Seq] = {}
        self.remaining = sum(inp.params.n for inp in inputs)
        self.closed = False
        self.tenant = inputs[0].tenant if inputs else None  # one API call, one tenant
        # a batch line (the Batch API): outside the queue limits, and out of the latency histograms, whose
        # numbers are interactive requests' (a line waits for what interactive work leaves, by design)
        self.batch = bool(inputs) and inputs[0].tier is Tier.BATCH
        # prompt tokens of engine requests that have produced nothing yet (queued or in prefill), by group id
        self.unstarted = {} if self.batch else {inp.request_id: len(inp.prompt_token_ids) * inp.params.n
                                                for inp in inputs}

    # --- called by AsyncEngine, on the event loop --------------------------------------------------
    def deliver(self, d: StepDelta, t: float) -> None:
        """Route one of this call's deltas (emitted at `t`) to its iterator and its metrics."""
        if self.unstarted:
            self.engine.started(self, d.group_id)
        seq = self.seqs.get(d.request_id)
        if seq is None:
            seq = self.seqs[d.request_id] = _Seq(self.arrival)
        metrics = self.engine.metrics
        if d.new_token_ids:
            if seq.first_t is None:
                seq.first_t = t
            elif metrics is not None and not self.batch:
                metrics.observe_itl(t - seq.last_t)
            seq.last_t = t
            seq.num_tokens += len(d.new_token_ids)
            if metrics is not None:
                metrics.observe_tenant_tokens(self.tenant, len(d.new_token_ids))
        if d.finished:
            seq.finish_reason = d.finish_reason
            self.remaining -= 1
            if metrics is not None:
                scheduled = d.first_scheduled_time
                queued = scheduled - self.arrival if scheduled is not None and not self.batch else None
                ttft = seq.first_t - self.arrival if seq.first_t is not None and not self.batch else None
                metrics.observe_finish(d.finish_reason, ttft, None if self.batch else t - self.arrival, queued)
                metrics.observe_tenant_finish(self.tenant, len(self.inputs[0].prompt_token_ids) if d.index == 0 else 0,
                                              ttft, queued)
        self.queue.put_nowait(d)

    def fail(self, exc: BaseException) -> None:
        """End the iteration with `exc` (the engine died or refused the request)."""
        self.queue.put_nowait(exc)

    def __aiter__(self) -> AsyncIterator[StepDelta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StepDelta]:
        while self.remaining > 0 or not self.queue.empty():
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Abort unfinished sequences (client gone, error, shutdown) and log the call. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.engine.release(self, abort=self.remaining > 0)
        if self.remaining > 0:
            for inp in self.inputs:
                for sid in sequence_ids(inp.request_id, inp.params.n):
                    seq = self.seqs.setdefault(sid, _Seq(self.arrival))
                    if seq.finish_reason is None:
                        seq.finish_reason = FinishReason.ABORT
                        if self.engine.metrics is not None:
                            self.engine.metrics.observe_finish(FinishReason.ABORT, None, None, None)
        self._log()

    def _log(self) -> None:
        now = time.monotonic()
        firsts = [s.first_t for s in self.seqs.values() if s.first_t is not None]
        reasons = sorted({s.finish_reason or "abort" for s in self.seqs.values()}) or ["abort"]
        ttft = f"{min(firsts) - self.arrival:.3f}s" if firsts else "-"
        request_log.info("request %s: prompt %d tok, output %d tok, ttft %s, total %.3fs, finish %s", self.api_id,
                 sum(len(i.prompt_token_ids) for i in self.inputs), sum(s.num_tokens for s in self.seqs.values()),
                 ttft, now - self.arrival, ",".join(reasons))

    async def __aenter__(self) -> Submission:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


@dataclass
class _Counters:
    steps: int = 0
    step_seqs: int = 0
    last_log_t: float = field(default_factory=time.monotonic)
    last_log_gen: int = 0
    last_log_prompt: int = 0
    last_log_steps: int = 0
    last_log_seqs: int = 0
    last_log_phases: dict = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, client: EngineClient, metrics: ServerMetrics | None = None,
                 max_queued_requests: int | None = None, log_interval_s: float = 10.0,
                 max_queued_tokens: int | None = None) -> None:
        self.client = client
        self.info = client.info
        self.tokenizer = client.tokenizer
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        # prompt tokens sent to the engine whose requests have not produced a token yet: what a burst of
        # long prompts holds in memory and in front of everyone else, bounded by `max_queued_tokens`
        self.queued_tokens = 0
        self.log_interval_s = log_interval_s
        self._num_pending_adds = 0  # sequences sent but not yet taken in by the engine
        self._subs: dict[str, Submission] = {}
        self._group_to_sub: dict[str, Submission] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._c = _Counters()
        self._stats = EngineStats(kv_blocks_total=client.info.num_kv_blocks)
        self.observers: list[Callable[[LoopOutput], None]] = []
        self._switches: dict[int, asyncio.Future] = {}  # SetScheduler token -> its outcome
        self._switch_token = 0
        client.on_output = self._on_output_threadsafe

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (it aborts whatever is left, freeing its blocks) and fail open calls."""
        self._stopping = True
        self.client.send(Stop())
        if isinstance(self.client, InlineEngineClient) and self.client.task is not None:
            await asyncio.wait({self.client.task}, timeout=timeout)
        else:
            await asyncio.to_thread(self.client.join, timeout)
        for sub in list(self._subs.values()):
            sub.fail(EngineDeadError("the server is shutting down"))

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the HTTP side runs on (None before `start`)."""
        return self._loop

    @property
    def alive(self) -> bool:
        return self.client.alive and not self._stopping

    @property
    def error(self) -> str | None:
        return self.client.error

    def stats(self) -> EngineStats:
        return self._stats

    # --- the HTTP side's API --------------------------------------------------------------------------
    def submit(self, api_id: str, inputs: list[EngineRequest]) -> Submission:
        """Queue one API call's requests. Raises EngineDeadError or QueueFullError (nothing queued then).

        Batch lines (`Tier.BATCH`: one call's inputs are all of one tier) are not held to the queue limits, and
        do not count against them: the batch runner feeds the engine a bounded number at a time."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running{f': {self.error}' if self.error else ''}")
        num = sum(inp.params.n for inp in inputs)
        if inputs and inputs[0].tier is Tier.BATCH:
            return self._queue(api_id, inputs, 0)
        if self.max_queued_requests is not None:
            queued = self._num_pending_adds + self._stats.waiting - self._stats.batch_waiting
            if queued + num > self.max_queued_requests:
                raise QueueFullError(f"the waiting queue is full ({queued} queued, limit "
                                     f"{self.max_queued_requests}); retry later")
        if self.max_queued_tokens is not None:
            tokens = sum(len(inp.prompt_token_ids) * inp.params.n for inp in inputs)
            # an empty queue always takes one request, so a prompt longer than the limit is not refused forever
            if self.queued_tokens and self.queued_tokens + tokens > self.max_queued_tokens:
                raise QueueFullError(f"the waiting queue is full ({self.queued_tokens} prompt tokens queued, limit "
                                     f"{self.max_queued_tokens}); retry later")
        return self._queue(api_id, inputs, num)

    def _queue(self, api_id: str, inputs: list[EngineRequest], pending: int) -> Submission:
        arrival = time.monotonic()
        inputs = [dataclasses.replace(inp, arrival_time=arrival) for inp in inputs]
        sub = Submission(self, api_id, inputs, arrival)
        self._subs[api_id] = sub
        for inp in inputs:
            self._group_to_sub[inp.request_id] = sub
        self._num_pending_adds += pending
        self.queued_tokens += sum(sub.unstarted.values())
        for inp in inputs:
            self.client.send(inp)
        return sub

    async def set_scheduler(self, name: str, options: dict, timeout: float = 60.0) -> SchedulerSwitch:
        """Switch the engine's batching strategy between two steps; returns the outcome (its `error` set if
        the engine refused). Requests in flight keep going under the new strategy."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running{f': {self.error}' if self.error else ''}")
        self._switch_token += 1
        token = self._switch_token
        fut = self._loop.create_future()
        self._switches[token] = fut
        self.client.send(SetScheduler(name, dict(options), token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._switches.pop(token, None)

    async def abort_all_after(self, grace_s: float) -> None:
        """Shutdown: give open calls `grace_s` seconds, then abort the rest *cleanly*: each
        unfinished sequence gets a final delta with finish_reason "abort", so streams still end
        with a last chunk and [DONE] instead of a cut connection. Batch lines are left to the batch runner,
        which stops them (uncommitted) when the app stops."""
        deadline = time.monotonic() + grace_s

        def open_calls() -> list[Submission]:  # batch lines are not waited for: they run again after a restart
            return [sub for sub in self._subs.values() if not sub.batch]

        while open_calls() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if open_calls():
            log.warning("aborting %d in-flight request(s) at shutdown", len(open_calls()))
            for sub in open_calls():
                for inp in sub.inputs:
                    self.client.send(AbortRequest(inp.request_id))

    def unload_lora(self, lora_int_id: int) -> None:
        """Tell the engine to drop an adapter's weights once no request runs under it."""
        self.client.send(UnloadLoRA(lora_int_id))

    def release(self, sub: Submission, abort: bool) -> None:
        """A submission is done with: stop routing to it and, if it was unfinished, abort its requests."""
        self._subs.pop(sub.api_id, None)
        self.queued_tokens -= sum(sub.unstarted.values())
        sub.unstarted.clear()
        for inp in sub.inputs:
            self._group_to_sub.pop(inp.request_id, None)
            if abort:
                self._abort(inp.request_id)

    def started(self, sub: Submission, group_id: str) -> None:
        """A request's first output: its prompt tokens leave the queued count."""
        self.queued_tokens -= sub.unstarted.pop(group_id, 0)

    def _abort(self, request_id: str) -> None:
        self.client.send(AbortRequest(request_id))

    # --- outputs of the loop ----------------------------------------------------------------------------
    def _on_output_threadsafe(self, out: LoopOutput) -> None:
        """Called where the loop emits (its thread, or the engine process's reader thread)."""
        try:
            self._loop.call_soon_threadsafe(self._on_output, out)
        except (RuntimeError, AttributeError):  # the event loop is closed (or never ran): the server is gone
            pass

    def _on_output(self, out: LoopOutput) -> None:
        self._num_pending_adds = max(0, self._num_pending_adds - (out.added - out.added_batch))
        if out.stats is not None and out.stats.num_seqs > 0:
            self._c.steps += 1
            self._c.step_seqs += out.stats.num_seqs
        if out.snapshot is not None:
            self._publish(out)
        for failed in out.failed:  # validated on the HTTP side, so this is a bug; the engine lives on
            rid, message = failed.request_id, failed.message
            log.error("add_request(%s) failed: %s", rid, message)
            sub = self._group_to_sub.get(rid)
            if sub is not None:
                self._abort(rid)
                sub.fail(RuntimeError(message))
        for sw in out.switched:
            fut = self._switches.get(sw.token)
            if fut is not None and not fut.done():
                fut.set_result(sw)
        now = out.time
        for d in out.deltas:
            sub = self._group_to_sub.get(d.group_id)
            if sub is not None and not sub.closed:
                sub.deliver(d, now)
        if out.error is not None:
            log.error("the engine died: %s", out.error)
            self._stats = EngineStats(**{**self._stats.__dict__, "alive": False})
            for sub in list(self._subs.values()):
                sub.fail(EngineDeadError(f"the engine died: {out.error}"))
            for fut in self._switches.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError(f"the engine died: {out.error}"))
        elif out.final:
            self._stats = EngineStats(**{**self._stats.__dict__, "alive": False})
        for observe in self.observers:  # e.g. the dashboard: after the requests got their tokens, and never fatal
            try:
                observe(out)
            except Exception:
                log.exception("an engine-output observer failed; ignoring it")
        self._maybe_log()

    def _publish(self, out: LoopOutput) -> None:
        s = out.snapshot
        self._stats = EngineStats(
            alive=out.error is None and not out.final, running=s.running, waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens, preemptions=s.preemptions, prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits, steps=self._c.steps, step_seqs=self._c.step_seqs,
            phase_seconds=s.phase_seconds, scheduler=s.scheduler, scheduler_switches=s.scheduler_switches,
            spec_drafts=s.spec_drafts, spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens, spec_accepted_per_pos=s.spec_accepted_per_pos,
            lora_running=s.lora_running, lora_waiting=s.lora_waiting, batch_running=s.batch_running,
            batch_waiting=s.batch_waiting)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        c, s = self._c, self._stats
        dt = now - c.last_log_t
        if dt < self.log_interval_s:
            return
        gen, prompt = s.generation_tokens - c.last_log_gen, s.prompt_tokens - c.last_log_prompt
        steps, seqs = s.steps - c.last_log_steps, s.step_seqs - c.last_log_seqs
        if gen or prompt or s.running or s.waiting:
            phases = dict(s.phase_seconds)
            spent = {k: v - c.last_log_phases.get(k, 0.0) for k, v in phases.items()}
            total = sum(spent.values()) or 1.0
            split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in spent.items())
            log.info("engine: running %d, waiting %d, KV %.1f%% (%d/%d blocks), prompt %.1f tok/s, "
                     "generation %.1f tok/s, %d steps, mean batch %.2f, step time: %s", s.running, s.waiting,
                     100 * s.kv_usage, s.kv_blocks_used, s.kv_blocks_total, prompt / dt, gen / dt, steps,
                     seqs / max(steps, 1), split)
            if s.spec_draft_tokens:
                log.info("speculative decoding: %d of %d guessed tokens kept (%.0f%%), mean %.2f tokens per draft",
                         s.spec_accepted_tokens, s.spec_draft_tokens,
                         100 * s.spec_accepted_tokens / s.spec_draft_tokens,
                         1 + s.spec_accepted_tokens / max(s.spec_drafts, 1))
        c.last_log_t, c.last_log_gen, c.last_log_prompt = now, s.generation_tokens, s.prompt_tokens
        c.last_log_steps, c.last_log_seqs = s.steps, s.step_seqs
        c.last_log_phases = dict(s.phase_seconds)
