"""An in-process backend: the lab drives an `LLMEngine` on one thread while asyncio drives the load.

The engine is not thread-safe, so every engine call happens on that one thread; the asyncio side
only posts commands to an inbox. `run_on_this_thread` makes that thread the one that loaded the
model (the lab's main thread), with the load generator's event loop on a helper thread: see its
docstring for why. A request reaches the engine when the load generator sends it
(never earlier), and each of its tokens is stamped the moment the step that produced it returns:
what a streaming client would see, minus the network. Because it runs in-process it also sees
every step exactly (who was in the batch, KV blocks and slots in use), which the occupancy
timeline and the KV-waste numbers need.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from conveyor.bench.loadgen import RequestRecord
from conveyor.bench.stats import contiguous_waste, paged_waste
from conveyor.bench.workloads import BenchRequest
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import STEP_PHASES, LLMEngine, StepStats
from conveyor.kv_cache import KVCacheManager
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler
from conveyor.scheduler.policies import make_policy

T = TypeVar("T")
_IDLE_WAIT_S = 0.001  # a step scheduled nothing (a batcher is waiting): wait this long for news


def reset_engine(engine: LLMEngine, config: EngineConfig) -> None:
    """Give a loaded engine a fresh scheduler, policy and (empty) KV manager for `config`.

    The weights and KV tensors stay; the tensors need no clearing since every slot is written
    before it is read. This lets one model load serve every strategy of a comparison.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("cannot reset an engine that still has requests")
    engine.config = config
    engine.kv = KVCacheManager(engine.runner.num_blocks, config.block_size, config.enable_prefix_caching)
    engine.scheduler = Scheduler(config, engine.kv, make_policy(config), engine.max_model_len)
    engine.step_stats.clear()
    engine.total_prompt_tokens = 0
    engine.total_generation_tokens = 0


def strategy_config(base: EngineConfig, scheduler: str, **overrides) -> EngineConfig:
    return dataclasses.replace(base, scheduler=scheduler, **overrides)


class EngineBackend:
    def __init__(self, engine: LLMEngine) -> None:
        """Driven by `run_on_this_thread`, which runs the engine loop (`_run`) on the calling thread."""
        self.engine = engine
        self._done = threading.Event()
        self.steps: list[StepStats] = []  # the non-empty steps, as the engine recorded them
        self._inbox: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, tuple[RequestRecord, asyncio.Future, Request]] = {}
        self._fatal: BaseException | None = None
        self._prefix0 = (0, 0)

    # --- asyncio side -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.record_steps = True
        self.engine.step_stats.clear()
        self.engine.scheduler.input_ended = False
        self._prefix0 = (self.engine.kv.prefix_queries, self.engine.kv.prefix_hits)

    async def send(self, rid: str, req: BenchRequest, rec: RequestRecord) -> None:
        fut = self._loop.create_future()
        self._inbox.put(("add", rid, req, rec, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self._inbox.put(("abort", rid))
            raise

    def end_of_input(self) -> None:
        """Tell a static batcher without a flush timer that no more requests will come, as the
        offline `LLM` does; otherwise its last, partial batch would wait forever. A batcher with a
        timer (dynamic, or static with `static_flush_after_s`) is not told: it flushes on its own,
        as it would in a server."""
        if getattr(self.engine.scheduler.policy, "flush_after_s", 0) is None:
            self._inbox.put(("end",))

    async def close(self) -> None:
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._done.wait, 60)
        self.engine.record_steps = False
        self.engine.scheduler.input_ended = False
        if self._fatal is not None:
            raise RuntimeError("the engine thread failed") from self._fatal

    def engine_stats(self) -> dict:
        """Exact per-step numbers of this run (call after `close`)."""
        e, (q0, h0) = self.engine, self._prefix0
        return engine_stats_from_steps(self.steps, e.runner.num_blocks, e.config.block_size, e.max_model_len,
                                       e.kv.prefix_queries - q0, e.kv.prefix_hits - h0)

    # --- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(block=not busy, timeout=None)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        self._abort_all()
                        return
                    self._handle(cmd)
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if engine.has_unfinished_requests() and not self._step():
                    try:  # nothing ran (a batcher is waiting for more requests or a timeout)
                        self._handle(self._inbox.get(timeout=_IDLE_WAIT_S))
                    except queue.Empty:
                        pass
        except BaseException as e:  # surface it to every waiter instead of hanging them
            self._fatal = e
            self._abort_all(e)
        finally:
            self._done.set()

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, req, rec, fut = cmd
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            try:
                (request,) = self.engine.add_request(list(req.prompt_token_ids), params, request_id=rid,
                                                     arrival_time=time.monotonic())
            except ValueError as e:
                self._resolve(fut, exc=e)
                return
            self._live[rid] = (rec, fut, request)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self._live.pop(cmd[1], None)
        elif kind == "end":
            self.engine.scheduler.input_ended = True
        elif kind == "stop":  # only reached from the idle wait
            self._inbox.put(cmd)

    def _step(self) -> bool:
        """Run one engine step; False if it scheduled nothing."""
        engine = self.engine
        deltas = engine.step()
        now = time.monotonic()
        st = engine.step_stats.pop() if engine.step_stats else None
        if st is None or st.num_seqs == 0:
            return False
        self.steps.append(st)
        for d in deltas:
            live = self._live.get(d.group_id)
            if live is None:
                continue
            rec, fut, request = live
            if d.new_token_ids:
                rec.token_times.append(now)
                rec.output_len += len(d.new_token_ids)
            if d.finished:
                rec.end = now
                rec.cached_tokens = request.num_cached_tokens
                if d.finish_reason == "abort":
                    rec.error = "aborted"
                del self._live[d.group_id]
                self._resolve(fut)
        return True

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None = None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(None)

        self._loop.call_soon_threadsafe(done)

    def _abort_all(self, exc: BaseException | None = None) -> None:
        for rid, (_, fut, _) in list(self._live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine may be the thing that broke; still release the waiters
                pass
            self._resolve(fut, exc=RuntimeError(f"engine stopped: {exc}") if exc else None)
        self._live.clear()


def run_on_this_thread(backend: EngineBackend, make_coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the engine loop on the calling thread and `make_coro()` (the load) in an event loop on a
    helper thread; return the coroutine's result.

    Why not the other way round: OpenMP (libgomp) gives every thread that opens parallel regions
    its own team of workers. Once the model was loaded (or the peak FLOP/s measured) on this thread
    and then stepped on another, there were more OpenMP threads than cores and every step ran ~35%
    slower (single-stream decode 27-29 ms instead of 20-21 ms on a 2-core AMD EPYC). So the thread
    that loaded the model keeps all the compute.
    """
    out: dict = {}

    def load_side() -> None:
        try:
            out["result"] = asyncio.run(make_coro())
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            out["error"] = e
        finally:
            backend._inbox.put(("stop",))  # the engine loop ends even if the load never got to close()

    helper = threading.Thread(target=load_side, name="bench-load", daemon=True)
    helper.start()
    backend._run()
    helper.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def engine_stats_from_steps(steps: list[StepStats], num_blocks: int, block_size: int, max_model_len: int,
                            prefix_queries: int, prefix_hits: int) -> dict:
    """Batch size, KV usage and KV waste over a run, each a plain mean over its non-empty steps.

    `kv_waste_paged`: slots allocated in blocks but holding no token, `1 - used_slots / (blocks *
    block_size)`. `kv_waste_contiguous`: what reserving `max_model_len` slots per running request
    would have wasted in the same steps, `1 - tokens / (running * max_model_len)`, where a prefix
    shared in the paged cache counts once per request (a contiguous layout cannot share it).
    """
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    paged = [paged_waste(s.kv_used_slots, s.kv_used_blocks, block_size) for s in steps if s.kv_used_blocks]
    contig = [contiguous_waste(s.logical_tokens, s.num_running, max_model_len) for s in steps if s.num_running]
    busy = sum(s.end - s.start for s in steps)
    phases = {k: sum((s.phases or {}).get(k, 0.0) for s in steps) for k in STEP_PHASES}
    return {
        "source": "in-process",
        "num_steps": len(steps),
        "busy_s": busy,
        "step_phase_s": phases,  # seconds per part of the step (schedule, prepare, forward, ...), summed
        "mean_batch_size": mean([s.num_seqs for s in steps]),
        "mean_step_tokens": mean([s.num_tokens for s in steps]),
        "mean_kv_usage": mean([s.kv_used_blocks / num_blocks for s in steps]),
        "peak_kv_usage": max((s.kv_used_blocks / num_blocks for s in steps), default=None),
        "prefix_hit_rate": prefix_hits / prefix_queries if prefix_queries else None,
        "num_preemptions": sum(s.num_preempted for s in steps),
        "processed_tokens": sum(s.num_tokens for s in steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "kv_waste_paged": mean(paged),
        "kv_waste_contiguous": mean(contig),
        "num_kv_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
    }
