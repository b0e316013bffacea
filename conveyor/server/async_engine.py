"""`AsyncEngine`: the synchronous `LLMEngine` driven from one dedicated thread, fed by asyncio.

Why a thread: a step is mostly torch work that releases the GIL, and the HTTP side (JSON,
tokenization, SSE framing for many clients) is pure Python. Running steps on the event loop
would stall every socket for a whole step and stall the engine while a big body is parsed; with
the engine in its own thread the two overlap. `--engine-loop inline` keeps the naive design for
the comparison in `benchmarks/serve_load.py`.

The engine is not thread-safe, so every engine call happens on the engine thread:
- the HTTP side appends `add` / `abort` commands to a deque and sets an Event; the engine thread
  drains the deque between steps (so an abort lands within one step and frees its blocks);
- after each step the engine thread hands that step's deltas to the event loop in one
  `call_soon_threadsafe`, which routes them to per-call asyncio queues;
- with nothing to do the thread sleeps on the Event; when a static/dynamic policy holds a partial
  batch back (an empty step) it naps `idle_poll_s` or until the next command;
- if a step raises, the engine is marked dead: health turns 503, new calls get `EngineDeadError`
  and every open call receives it too.
Validation (sampling params, tokenization, chat templates, `validate_prompt`) is the HTTP side's
job, so bad input never reaches this thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from conveyor.engine.llm_engine import LLMEngine
from conveyor.outputs import StepDelta
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.server.metrics import EngineStats, ServerMetrics

log = logging.getLogger("conveyor.server")
request_log = logging.getLogger("conveyor.server.requests")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); nothing more will be generated."""


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests` sequences already."""


@dataclass
class EngineInput:
    """One engine request: a prompt's token ids and how to sample `params.n` continuations."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class _Seq:
    """Loop-side timing of one sequence, for metrics and the request log."""

    arrival: float
    first_t: float | None = None
    last_t: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None


class Submission:
    """One API call: its engine requests feed one asyncio queue; `close()` aborts what is unfinished.

    Iterate it (`async for delta in sub`) to receive `StepDelta`s; iteration ends once every
    sequence has finished and raises `EngineDeadError` if the engine dies meanwhile.
    """

    def __init__(self, engine: AsyncEngine, api_id: str, inputs: list[EngineInput], arrival: float) -> None:
        self.engine = engine
        self.api_id = api_id
        self.inputs = inputs
        self.arrival = arrival
        self.queue: asyncio.Queue[StepDelta | BaseException] = asyncio.Queue()
        self.seqs: dict[str, _Seq] = {}
        self.requests: dict[str, Request] = {}  # sequence id -> Request, filled in by the engine thread
        self.remaining = sum(inp.params.n for inp in inputs)
        self.closed = False

    # --- called on the event loop -----------------------------------------------------------------
    def _on_delta(self, d: StepDelta, t: float) -> None:
        seq = self.seqs.get(d.request_id)
        if seq is None:
            seq = self.seqs[d.request_id] = _Seq(self.arrival)
        metrics = self.engine.metrics
        if d.new_token_ids:
            if seq.first_t is None:
                seq.first_t = t
            elif metrics is not None:
                metrics.observe_itl(t - seq.last_t)
            seq.last_t = t
            seq.num_tokens += len(d.new_token_ids)
        if d.finished:
            seq.finish_reason = d.finish_reason
            self.remaining -= 1
            if metrics is not None:
                req = self.requests.get(d.request_id)
                queued = (req.first_scheduled_time - self.arrival
                          if req is not None and req.first_scheduled_time is not None else None)
                metrics.observe_finish(d.finish_reason, None if seq.first_t is None else seq.first_t - self.arrival,
                                       t - self.arrival, queued)
        self.queue.put_nowait(d)

    def _fail(self, exc: BaseException) -> None:
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
        self.engine._subs.pop(self.api_id, None)
        for inp in self.inputs:
            self.engine._group_to_sub.pop(inp.request_id, None)
        if self.remaining > 0:
            for inp in self.inputs:
                self.engine._abort(inp.request_id)
            for inp in self.inputs:
                for sid in _seq_ids(inp):
                    seq = self.seqs.setdefault(sid, _Seq(self.arrival))
                    if seq.finish_reason is None:
                        seq.finish_reason = "abort"
                        if self.engine.metrics is not None:
                            self.engine.metrics.observe_finish("abort", None, None, None)
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


def _seq_ids(inp: EngineInput) -> list[str]:
    n = inp.params.n
    return [inp.request_id] if n == 1 else [f"{inp.request_id}#{i}" for i in range(n)]


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


class EngineThread:
    """The thread that owns the engine's torch work from loading to the last step.

    OpenMP gives every thread that opens parallel regions its own team of workers. If the model is
    loaded in the main thread and stepped in another, the main thread's idle team slows every step
    of the other: single-stream decode of SmolLM2 took 27-29 ms a step instead of 20-21 ms (AMD
    EPYC, 2 cores, `benchmarks/step_profile.py`-style loop, min of 6 runs). So `conveyor serve`
    builds the engine here, and `AsyncEngine` then runs its loop in this same thread.
    """

    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        self._build = build
        self._loop_fn: Callable[[], None] | None = None
        self._go = threading.Event()
        self._built = threading.Event()
        self._error: BaseException | None = None
        self.engine: LLMEngine | None = None
        self.thread = threading.Thread(target=self._main, name="conveyor-engine", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as e:  # noqa: BLE001 - reported to the caller of wait_built()
            self._error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        if self._loop_fn is not None:
            self._loop_fn()

    def wait_built(self) -> LLMEngine:
        self._built.wait()
        if self._error is not None:
            raise self._error
        return self.engine

    def run(self, fn: Callable[[], None]) -> threading.Thread:
        """Run `fn` (the engine loop) in this thread; returns the thread, to join."""
        self._loop_fn = fn
        self._go.set()
        return self.thread

    def close(self) -> None:
        """Let the thread end without running a loop (the app never started)."""
        self._go.set()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, max_queued_requests: int | None = None,
                 mode: str = "thread", log_interval_s: float = 10.0, idle_poll_s: float = 0.001,
                 owner: EngineThread | None = None) -> None:
        if mode not in ("thread", "inline"):
            raise ValueError(f"engine loop mode must be 'thread' or 'inline', got {mode!r}")
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.mode = mode
        self.log_interval_s = log_interval_s
        self.idle_poll_s = idle_poll_s
        self.owner = owner  # the thread that built the engine: the loop runs there (thread mode)
        self.engine.record_steps = True  # we read (and clear) the last StepStats after each step
        self._commands: deque[tuple] = deque()
        self._num_pending_adds = 0  # sequences submitted but not yet drained
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._async_wake: asyncio.Event | None = None
        self._subs: dict[str, Submission] = {}
        self._group_to_sub: dict[str, Submission] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._c = _Counters()
        self._stats = EngineStats(kv_blocks_total=engine.kv.pool.num_blocks)

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.mode == "thread" and self.owner is not None:
            self._thread = self.owner.run(self._thread_main)
        elif self.mode == "thread":
            self._thread = threading.Thread(target=self._thread_main, name="conveyor-engine", daemon=True)
            self._thread.start()
        else:
            if self.owner is not None:
                self.owner.close()
            self._async_wake = asyncio.Event()
            self._task = asyncio.create_task(self._inline_main())

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping, abort whatever is left (freeing its blocks) and fail open calls."""
        self._stopping = True
        self._notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout)
        for sub in list(self._subs.values()):
            sub._fail(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        running = ((self._thread is not None and self._thread.is_alive())
                   or (self._task is not None and not self._task.done()))
        return self.error is None and not self._stopping and running

    def stats(self) -> EngineStats:
        return self._stats

    # --- the HTTP side's API --------------------------------------------------------------------------
    def submit(self, api_id: str, inputs: list[EngineInput]) -> Submission:
        """Queue one API call's requests. Raises EngineDeadError or QueueFullError (nothing queued then)."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running{f': {self.error!r}' if self.error else ''}")
        num = sum(inp.params.n for inp in inputs)
        if self.max_queued_requests is not None:
            queued = self._num_pending_adds + self._stats.waiting
            if queued + num > self.max_queued_requests:
                raise QueueFullError(f"the waiting queue is full ({queued} queued, limit "
                                     f"{self.max_queued_requests}); retry later")
        sub = Submission(self, api_id, inputs, time.monotonic())
        self._subs[api_id] = sub
        for inp in inputs:
            self._group_to_sub[inp.request_id] = sub
        with self._pending_lock:
            self._num_pending_adds += num
        self._commands.append(("add", sub))
        self._notify()
        return sub

    async def abort_all_after(self, grace_s: float) -> None:
        """Shutdown: give open calls `grace_s` seconds, then abort the rest *cleanly*: each
        unfinished sequence gets a final delta with finish_reason "abort", so streams still end
        with a last chunk and [DONE] instead of a cut connection."""
        deadline = time.monotonic() + grace_s
        while self._subs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._subs:
            log.warning("aborting %d in-flight request(s) at shutdown", len(self._subs))
            self._commands.append(("abort_all",))
            self._notify()

    def _abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        if self._async_wake is not None:
            self._async_wake.set()

    # --- event-loop callbacks -----------------------------------------------------------------------
    def _deliver(self, deltas: list[StepDelta], t: float) -> None:
        for d in deltas:
            sub = self._group_to_sub.get(d.group_id)
            if sub is not None and not sub.closed:
                sub._on_delta(d, t)

    def _fail_all(self, exc: BaseException) -> None:
        for sub in list(self._subs.values()):
            sub._fail(exc)

    def _post(self, fn, *args) -> None:
        if self.mode == "inline":
            fn(*args)
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    # --- engine-side work (engine thread, or the loop in inline mode) -------------------------------
    def _drain(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self._add(cmd[1])
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            else:
                self._abort_all()

    def _abort_all(self) -> None:
        deltas = [StepDelta(req.request_id, req.group_id, req.index, [], "", None, "abort", None)
                  for rid in list(self.engine.scheduler.requests) for req in self.engine.abort_request(rid)]
        if deltas:
            self._post(self._deliver, deltas, time.monotonic())

    def _add(self, sub: Submission) -> None:
        with self._pending_lock:
            self._num_pending_adds -= sum(inp.params.n for inp in sub.inputs)
        if sub.closed:
            return
        for inp in sub.inputs:
            try:
                reqs = self.engine.add_request(inp.prompt_token_ids, inp.params, request_id=inp.request_id,
                                               priority=inp.priority, arrival_time=sub.arrival)
            except Exception as e:  # validated on the HTTP side, so this is a bug; keep the engine alive
                log.exception("add_request(%s) failed", inp.request_id)
                self.engine.abort_request(inp.request_id)
                self._post(sub._fail, e)
                return
            for r in reqs:
                sub.requests[r.request_id] = r

    def _step(self) -> bool:
        """Run one step; False when the policy scheduled nothing (holding a partial batch back)."""
        deltas = self.engine.step()
        stats = self.engine.step_stats[-1] if self.engine.step_stats else None
        self.engine.step_stats.clear()
        ran = stats is not None and stats.num_seqs > 0
        if ran:
            self._c.steps += 1
            self._c.step_seqs += stats.num_seqs
        if deltas:
            self._post(self._deliver, deltas, time.monotonic())
        return ran

    def _publish(self, alive: bool = True) -> None:
        e = self.engine
        self._stats = EngineStats(
            alive=alive, running=e.num_running, waiting=e.num_waiting, kv_blocks_used=e.kv.pool.num_used,
            kv_blocks_total=e.kv.pool.num_blocks, prompt_tokens=e.total_prompt_tokens,
            generation_tokens=e.total_generation_tokens, preemptions=e.scheduler.num_preemptions,
            prefix_queries=e.kv.prefix_queries, prefix_hits=e.kv.prefix_hits, steps=self._c.steps,
            step_seqs=self._c.step_seqs, phase_seconds=tuple(e.phase_seconds.items()))

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
        c.last_log_t, c.last_log_gen, c.last_log_prompt = now, s.generation_tokens, s.prompt_tokens
        c.last_log_steps, c.last_log_seqs = s.steps, s.step_seqs
        c.last_log_phases = dict(s.phase_seconds)

    def _tick(self) -> str:
        """Drain commands and run a step if there is work: 'ran', 'held' (empty step) or 'idle'."""
        self._drain()
        if not self.engine.has_unfinished_requests():
            self._publish()
            return "idle"
        ran = self._step()
        self._drain()  # aborts that came in during the step free their blocks before stats are taken
        self._publish()
        self._maybe_log()
        return "ran" if ran else "held"

    def _shutdown_engine(self) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        self._publish(alive=False)

    def _die(self, exc: BaseException) -> None:
        log.error("engine step failed; the engine is dead", exc_info=exc)
        self.error = exc
        try:
            self._publish(alive=False)
        except Exception:
            self._stats = EngineStats(alive=False)
        self._post(self._fail_all, EngineDeadError(f"the engine died: {exc!r}"))

    def _thread_main(self) -> None:
        try:
            while not self._stopping:
                state = self._tick()
                if state == "ran":
                    continue
                self._wake.wait(self.idle_poll_s if state == "held" else 1.0)
                self._wake.clear()
            self._shutdown_engine()
        except BaseException as e:  # noqa: BLE001 - anything that escapes a step kills the engine
            self._die(e)

    async def _inline_main(self) -> None:
        """The naive design, for comparison only: steps run on the event loop itself."""
        try:
            while not self._stopping:
                state = self._tick()
                if state == "ran":
                    await asyncio.sleep(0)  # let the HTTP side run between steps
                    continue
                self._async_wake.clear()
                try:
                    await asyncio.wait_for(self._async_wake.wait(), self.idle_poll_s if state == "held" else 1.0)
                except asyncio.TimeoutError:
                    pass
            self._shutdown_engine()
        except Exception as e:
            self._die(e)
