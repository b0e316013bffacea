"""`AsyncEngine`: the asyncio face of the engine loop, for the HTTP side, and the engine's supervisor.

The engine itself runs in an `EngineLoop` (`conveyor/engine/loop.py`), in a thread of this
process or in its own process (`--engine-loop thread|process`); this class only speaks the loop's
typed messages:
- `submit` sends an `EngineRequest` (`conveyor/request.py`) per prompt and returns a `Submission`, an
  async iterator of that call's `StepDelta`s; closing it (client gone, error, shutdown) sends `AbortRequest`s;
- every `LoopOutput` the loop emits is handed to the event loop in one `call_soon_threadsafe`, which
  routes its deltas to their submissions and publishes its snapshot for `/metrics` and the log.

When the engine dies (a step raised; the engine process was killed or crashed) it is restarted, as
a supervisor would, but without losing the server: the calls that were running (they had tokens, or
were being prefilled) fail with `EngineRestartedError` (500 `engine_restarted`, naming the cause);
the calls that had not started are kept and sent to the new engine; new calls get 503 `loading`
meanwhile; the new engine is built from the same configuration, with the batching strategy switched
live if it was (`respawn`). More than `max_restarts` losses within `restart_window_s` is a crash loop:
the engine stays dead, every call fails, and `on_give_up` tells the server to exit non-zero.
`drain()` refuses new calls (503 `draining`) while the open ones finish (SIGTERM, `launch.py`).
Validation (sampling params, tokenization, chat templates, prompt length) is the HTTP side's job,
done with the engine's `EngineInfo`, so bad input never reaches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor import startup
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
from conveyor.server.args import RETRY_AFTER_S
from conveyor.server.metrics import EngineStats, ServerMetrics
from conveyor.server.threads import in_daemon_thread

log = logging.getLogger("conveyor.server")
request_log = logging.getLogger("conveyor.server.requests")

__all__ = ["EngineRequest", "AsyncEngine", "EngineDeadError", "EngineRestartedError", "EngineRestartingError",
           "EngineUnavailableError", "QueueFullError", "ServerDrainingError", "ServerShutdownError", "Submission"]


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests` sequences, or `max_queued_tokens` prompt tokens, already."""


class EngineUnavailableError(EngineDeadError):
    """The engine cannot serve this call, and how the HTTP answer says so (`conveyor/server/http.py`'s
    `engine_error`): `status`, OpenAI's error `type` and `code`, and `retry_after` seconds (a `Retry-After`
    header) where asking again soon can succeed."""

    status = 503
    error_type = "service_unavailable"
    code = "engine_dead"
    retry_after: int | None = None


class EngineRestartingError(EngineUnavailableError):
    """A new call while the engine restarts: ask again in a moment (as while the server first loads)."""

    code = "loading"
    retry_after = RETRY_AFTER_S


class EngineRestartedError(EngineUnavailableError):
    """The call was running when the engine died: its tokens so far are lost (500; a stream's error event)."""

    status = 500
    error_type = "internal_error"
    code = "engine_restarted"


class ServerDrainingError(EngineUnavailableError):
    """A new call while the server drains before it exits: send it to another server."""

    code = "draining"
    retry_after = RETRY_AFTER_S


class ServerShutdownError(EngineUnavailableError):
    """The call was still running when the drain's time (`--shutdown-timeout`) was up: it was ended."""

    code = "server_shutdown"


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
        self.started = False  # some request of it produced output or was scheduled: lost if the engine dies
        self.failed = False
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
        self.started = True
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
        self.failed = True
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


SERVING, RESTARTING, DEAD = "ok", "restarting", "dead"  # AsyncEngine.state

# engine counters that start from zero in a new engine: carried over a restart so /metrics stays monotonic
_CARRIED = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries", "prefix_hits", "scheduler_switches",
            "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


class AsyncEngine:
    """The HTTP side's handle on the engine loop (see the module docstring).

    `respawn(overrides)`: builds a new engine client from the server's engine configuration with
    `overrides` applied (the batching strategy and options switched live); None: a dead engine stays dead
    (503 `engine_dead`), as with `--engine-loop inline`. `max_restarts` engine losses within
    `restart_window_s` seconds are tolerated; one more and the engine is given up (`on_give_up(why)`).
    `on_restarted()` is called once a new engine serves."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics | None = None,
                 max_queued_requests: int | None = None, log_interval_s: float = 10.0,
                 max_queued_tokens: int | None = None,
                 respawn: Callable[[dict[str, Any]], EngineClient] | None = None,
                 max_restarts: int = 0, restart_window_s: float = 600.0) -> None:
        self.client: EngineClient | None = client  # None while a new engine is being built
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
        # supervision
        self.respawn = respawn
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.on_give_up: Callable[[str], None] | None = None
        self.on_restarted: Callable[[], None] | None = None
        self.state = SERVING
        self.draining = False
        self.restarts = 0  # new engines started after a loss
        self.gave_up = False
        self._error: str | None = None  # why the engine died (the last loss)
        self._lost_at = 0.0
        self._losses: deque[float] = deque()  # when the engine was lost, within the restart window
        self._gen = 0  # which engine's outputs count: a dead one's late outputs are dropped
        self._restart_task: asyncio.Task | None = None
        self._dead: EngineClient | None = None  # the lost engine's handle, until the restart lets it go
        self._strategy: dict[str, Any] = {}  # the batching strategy switched live: the next engine starts with it
        self._carried: dict[str, Any] = {}  # counters of the engines before this one
        client.on_output = functools.partial(self._on_output_threadsafe, self._gen)

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (it aborts whatever is left, freeing its blocks) and fail open calls."""
        self._stopping = True
        task = self._restart_task
        if task is not None and not task.done():  # a new engine being built is stopped once it is up
            await asyncio.wait({task}, timeout=timeout)
        client = self.client
        if client is not None:
            client.send(Stop())
            if isinstance(client, InlineEngineClient) and client.task is not None:
                await asyncio.wait({client.task}, timeout=timeout)
            else:
                await asyncio.to_thread(client.join, timeout)
        for sub in list(self._subs.values()):
            sub.fail(EngineDeadError("the server is shutting down"))

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the HTTP side runs on (None before `start`)."""
        return self._loop

    @property
    def alive(self) -> bool:
        c = self.client
        return self.state == SERVING and c is not None and c.alive and not self._stopping

    @property
    def error(self) -> str | None:
        if self._error is not None:
            return self._error
        return self.client.error if self.client is not None else None

    def stats(self) -> EngineStats:
        return self._stats

    def send(self, cmd) -> None:
        """A command for the engine running now (none while one is being built: then it is dropped)."""
        c = self.client
        if c is not None:
            c.send(cmd)

    def health(self) -> tuple[int, dict]:
        """What `/health` answers: 200 `ok`; 503 `restarting` (with the startup phase the new engine is in),
        `draining`, or the reason the engine is dead."""
        if self.draining:
            return 503, {"status": "draining", "in_flight": len(self._subs)}
        if self.state == RESTARTING:
            ph = startup.progress.current()
            now = time.monotonic()
            return 503, {"status": "restarting", "phase": ph.name, "detail": ph.detail, "cause": self._error,
                         "restarts": self.restarts, "phase_elapsed_s": round(now - max(ph.started, self._lost_at), 3),
                         "elapsed_s": round(now - self._lost_at, 3)}
        if self.alive:
            return 200, {"status": "ok"}
        why = f"the engine is dead: {self.error}" if self.error else "the engine is not running"
        return 503, {"status": DEAD, "error": {"message": why, "type": "service_unavailable", "param": None,
                                               "code": "engine_dead"}}

    def _refusal(self) -> EngineDeadError | None:
        """Why a new call cannot be taken now (None: it can)."""
        if self.draining:
            return ServerDrainingError("the server is shutting down and takes no new requests")
        if self.state == RESTARTING:
            return EngineRestartingError(f"the engine is restarting after it died ({self._error}); retry in a "
                                         "few seconds")
        if not self.alive and self._restart_due():
            # the engine has just died and the event loop has not heard yet: a restart is what comes next
            return EngineRestartingError(f"the engine is restarting after it died ({self.error}); retry in a "
                                         "few seconds")
        if not self.alive:
            return EngineDeadError(f"the engine is not running{f': {self.error}' if self.error else ''}")
        return None

    # --- the HTTP side's API --------------------------------------------------------------------------
    def submit(self, api_id: str, inputs: list[EngineRequest]) -> Submission:
        """Queue one API call's requests. Raises EngineDeadError (or a subclass saying why: restarting,
        draining) or QueueFullError; nothing is queued then.

        Batch lines (`Tier.BATCH`: one call's inputs are all of one tier) are not held to the queue limits, and
        do not count against them: the batch runner feeds the engine a bounded number at a time."""
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
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
        the engine refused). Requests in flight keep going under the new strategy, and an engine started
        after a restart starts with it."""
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        self._switch_token += 1
        token = self._switch_token
        fut = self._loop.create_future()
        self._switches[token] = fut
        self.client.send(SetScheduler(name, dict(options), token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._switches.pop(token, None)

    # --- draining (SIGTERM) ------------------------------------------------------------------------------
    def drain(self) -> None:
        """Take no new calls (503 `draining`, `/health` 503 `draining`); the open ones go on."""
        if not self.draining:
            self.draining = True
            log.info("draining: no new requests; %d in flight", len(self._subs))

    @property
    def in_flight(self) -> int:
        """Open calls (queued, running, or still streaming their answer)."""
        return len(self._subs)

    def end_in_flight(self, why: str) -> int:
        """End every open call with `ServerShutdownError(why)` (a stream gets an error event; closing the call
        then aborts its requests in the engine, freeing their blocks). Returns how many."""
        subs = list(self._subs.values())
        if subs:
            log.warning("ending %d in-flight request(s): %s", len(subs), why)
        for sub in subs:
            sub.fail(ServerShutdownError(why))
        return len(subs)

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
                    self.send(AbortRequest(inp.request_id))

    def unload_lora(self, lora_int_id: int) -> None:
        """Tell the engine to drop an adapter's weights once no request runs under it."""
        self.send(UnloadLoRA(lora_int_id))

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
        self.send(AbortRequest(request_id))

    # --- outputs of the loop ----------------------------------------------------------------------------
    def _on_output_threadsafe(self, gen: int, out: LoopOutput) -> None:
        """Called where the loop emits (its thread, or the engine process's reader thread)."""
        try:
            self._loop.call_soon_threadsafe(self._on_output, gen, out)
        except (RuntimeError, AttributeError):  # the event loop is closed (or never ran): the server is gone
            pass

    def _on_output(self, gen: int, out: LoopOutput) -> None:
        if gen != self._gen:  # an engine that is gone (a restart has begun since)
            return
        self._num_pending_adds = max(0, self._num_pending_adds - (out.added - out.added_batch))
        if out.stats is not None:
            if out.stats.num_seqs > 0:
                self._c.steps += 1
                self._c.step_seqs += out.stats.num_seqs
            for gid in out.stats.request_ids:  # scheduled (a prefill chunk counts): lost if the engine dies now
                sub = self._group_to_sub.get(gid)
                if sub is not None:
                    sub.started = True
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
            if sw.error is None:
                self._strategy = {"scheduler": sw.name, **sw.options}
            fut = self._switches.get(sw.token)
            if fut is not None and not fut.done():
                fut.set_result(sw)
        now = out.time
        for d in out.deltas:
            sub = self._group_to_sub.get(d.group_id)
            if sub is not None and not sub.closed:
                sub.deliver(d, now)
        if out.error is not None and not self._stopping:
            self._lost(out.error, out.cause or "exception", out.started)
        elif out.final:
            self._stats = dataclasses.replace(self._stats, alive=False)
        for observe in self.observers:  # e.g. the dashboard: after the requests got their tokens, and never fatal
            try:
                observe(out)
            except Exception:
                log.exception("an engine-output observer failed; ignoring it")
        self._maybe_log()

    def _publish(self, out: LoopOutput) -> None:
        s, base = out.snapshot, self._carried
        carried = {k: getattr(s, k) + base.get(k, 0) for k in _CARRIED}
        phases = dict(base.get("phase_seconds", {}))
        for k, v in s.phase_seconds:
            phases[k] = phases.get(k, 0.0) + v
        per_pos = list(base.get("spec_accepted_per_pos", ()))
        for i, v in enumerate(s.spec_accepted_per_pos):
            if i < len(per_pos):
                per_pos[i] += v
            else:
                per_pos.append(v)
        self._stats = EngineStats(
            alive=out.error is None and not out.final, running=s.running, waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total, steps=self._c.steps,
            step_seqs=self._c.step_seqs, phase_seconds=tuple(phases.items()), scheduler=s.scheduler,
            spec_accepted_per_pos=tuple(per_pos), lora_running=s.lora_running, lora_waiting=s.lora_waiting,
            batch_running=s.batch_running, batch_waiting=s.batch_waiting, kv_disk=s.kv_disk, **carried)

    # --- supervision: a lost engine and its restart ------------------------------------------------------
    def _restart_due(self) -> bool:
        """Whether an engine found dead while serving will be restarted (not the server stopping, a server with
        nothing to restart with, or one more loss than the crash-loop rule allows)."""
        if self.state != SERVING or self._stopping or self.respawn is None or self.client is None:
            return False
        now = time.monotonic()
        recent = sum(1 for t in self._losses if now - t <= self.restart_window_s)
        return recent + 1 <= self.max_restarts

    def _count_loss(self) -> int:
        """Record a loss now; how many fell within the restart window."""
        now = time.monotonic()
        self._losses.append(now)
        while self._losses and now - self._losses[0] > self.restart_window_s:
            self._losses.popleft()
        return len(self._losses)

    def _crash_loop(self, losses: int, last: str) -> str:
        return (f"the engine died {losses} times within {self.restart_window_s:g} s, more than "
                f"--max-engine-restarts {self.max_restarts} allows: not restarting it again. The last time: {last}")

    def _lost(self, error: str, cause: str, started: list[str]) -> None:
        """The engine died (on the event loop): fail the calls that were running, keep the ones that had not
        started, and build a new engine (or give up: no `respawn`, or a crash loop)."""
        if self.state != SERVING:
            return
        self._gen += 1  # nothing more from that engine counts
        self._error, self._lost_at = error, time.monotonic()
        s = self._stats
        self._carried = {**{k: getattr(s, k) for k in _CARRIED}, "phase_seconds": dict(s.phase_seconds),
                         "spec_accepted_per_pos": s.spec_accepted_per_pos}
        for gid in started:
            sub = self._group_to_sub.get(gid)
            if sub is not None:
                sub.started = True
        for fut in self._switches.values():
            if not fut.done():
                fut.set_exception(EngineRestartingError(f"the engine died before it answered ({error}); retry"))
        if self.respawn is None:  # nothing to restart with: dead for good, as the server has always been
            log.error("the engine died: %s", error)
            self._give_up(f"the engine died: {error}", crash_loop=False)
            return
        losses = self._count_loss()
        if losses > self.max_restarts:
            self._give_up(self._crash_loop(losses, error), crash_loop=True)
            return
        running = [sub for sub in self._subs.values() if sub.started and not sub.failed]
        for sub in running:
            sub.fail(EngineRestartedError(f"the engine died ({error}) while this request was running; the server "
                                          "is restarting it: retry the request"))
        kept = [sub for sub in self._subs.values() if not sub.failed]
        if self.metrics is not None:
            self.metrics.observe_restart(cause, len(running), len(kept))
        self.state = RESTARTING
        self.restarts += 1
        self._stats = dataclasses.replace(self._stats, alive=False, running=0, kv_blocks_used=0,
                                          waiting=sum(inp.params.n for sub in kept for inp in sub.inputs))
        log.error("engine restart %d (cause %s): %s; %d running request(s) failed, %d waiting kept for the new "
                  "engine", self.restarts, cause, error, len(running), len(kept))
        startup.phase(startup.STARTING, "a new engine")
        self._dead, self.client = self.client, None
        self._restart_task = self._loop.create_task(self._restart())

    def _give_up(self, why: str, crash_loop: bool) -> None:
        """The engine stays dead: every open call fails; after a crash loop the server is told to exit."""
        self.state = DEAD
        self.gave_up = crash_loop
        self._error = why
        self._stats = dataclasses.replace(self._stats, alive=False)
        if crash_loop:
            log.critical("%s", why)
        for sub in list(self._subs.values()):
            sub.fail(EngineDeadError(why))
        if crash_loop and self.on_give_up is not None:
            self.on_give_up(why)

    def _replace(self, overrides: dict[str, Any]) -> EngineClient:
        """In a thread of its own: let the dead engine go (its memory too), then build the next one."""
        old, self._dead = self._dead, None
        if old is not None:
            in_process = old.in_process
            try:
                old.join(10)
            except Exception:
                log.exception("joining the dead engine failed; building the new one anyway")
            old.release()
            del old
            if in_process:
                # what the startup froze out of the collector (`startup.freeze_startup_heap`) is only ever freed
                # by reference counting: unfrozen, the dead engine's cycles are collected, its model and KV pool
                # with them, before the new engine asks for the same memory (`on_restarted` freezes again)
                if gc.get_freeze_count():
                    gc.unfreeze()
                gc.collect()
        return self.respawn(overrides)

    async def _restart(self) -> None:
        """Build engines until one starts (each failed start is a loss too), then hand it the kept calls."""
        t0 = time.monotonic()
        while True:
            if self._stopping:
                return
            try:
                client = await in_daemon_thread(self._replace, dict(self._strategy), name="conveyor-engine-restart")
                break
            except Exception as e:  # the new engine did not start
                error = f"a new engine failed to start: {type(e).__name__}: {e}"
                losses = self._count_loss()
                if self._stopping:
                    return
                if losses > self.max_restarts:
                    self._give_up(self._crash_loop(losses, error), crash_loop=True)
                    return
                self._error = error
                self.restarts += 1
                if self.metrics is not None:
                    self.metrics.observe_restart("start_failed", 0, 0)
                log.error("engine restart %d (cause start_failed): %s; trying again in %g s", self.restarts, error,
                          RETRY_AFTER_S)
                await asyncio.sleep(RETRY_AFTER_S)
        if self._stopping:  # the server is stopping: this engine never serves
            client.send(Stop())
            client.start()
            await asyncio.to_thread(client.join, 10)
            return
        self._gen += 1
        client.on_output = functools.partial(self._on_output_threadsafe, self._gen)
        self.client = client
        self.info = client.info
        self._num_pending_adds = 0
        self._stats = dataclasses.replace(self._stats, alive=True, kv_blocks_total=client.info.num_kv_blocks)
        self.state = SERVING
        client.start()
        kept = sorted((sub for sub in self._subs.values() if not sub.failed), key=lambda sub: sub.arrival)
        for sub in kept:  # in the order they first came
            for inp in sub.inputs:
                self._num_pending_adds += 0 if sub.batch else inp.params.n  # batch lines: outside the queue limits
                client.send(inp)
        log.info("engine restarted in %.1f s: serving again; %d waiting request(s) sent to the new engine",
                 time.monotonic() - t0, len(kept))
        if self.on_restarted is not None:
            self.on_restarted()

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
