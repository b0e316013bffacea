"""An in-process backend: the lab drives an `LLMEngine` through its `EngineLoop` while asyncio
drives the load.

The loop runs on the thread that loaded the model (`run_on_this_thread`), the load generator's
event loop on a helper thread: see its docstring for why. A request reaches the engine when the
load generator sends it (never earlier), and each of its tokens is stamped with the time the step
that produced it returned: what a streaming client would see, minus the network. Because it runs
in-process it also receives every step's `StepStats` (who was in the batch, KV blocks and slots in
use), which the occupancy timeline and the KV-waste numbers need.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from conveyor.bench.loadgen import RequestRecord
from conveyor.bench.result import EngineRunStats
from conveyor.bench.stats import contiguous_waste, paged_waste
from conveyor.bench.workloads import BenchRequest
from conveyor.config import EngineConfig
from conveyor.engine.clients import ThreadEngineClient
from conveyor.engine.llm_engine import STEP_PHASES, LLMEngine, StepStats
from conveyor.engine.messages import AbortRequest, EndInput, LoopOutput, Stop
from conveyor.lora.request import LoRARequest
from conveyor.request import make_request
from conveyor.sampling_params import SamplingParams

T = TypeVar("T")


def strategy_config(base: EngineConfig, scheduler: str, **overrides) -> EngineConfig:
    return dataclasses.replace(base, scheduler=scheduler, **overrides)


class EngineBackend:
    def __init__(self, engine: LLMEngine, loras: dict[str, LoRARequest] | None = None) -> None:
        """Driven by `run_on_this_thread`, which runs the engine loop on the calling thread. `loras`:
        the adapters a request's `lora` names (bench/lora.py)."""
        self.engine = engine
        self.loras = loras or {}
        self.info = engine.info
        self.client = ThreadEngineClient(engine)
        self.client.on_output = self._on_output  # called on the engine thread
        self._done = threading.Event()
        self.steps: list[StepStats] = []  # the non-empty steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, tuple[RequestRecord, asyncio.Future]] = {}
        self._fatal: str | None = None
        snap = engine.snapshot()  # the loop is not running yet: safe to read here
        self._prefix0 = (snap.prefix_queries, snap.prefix_hits)
        self._last_snapshot = snap
        self._waits_for_end = engine.waits_for_end_of_input

    # --- asyncio side -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def send(self, rid: str, req: BenchRequest, rec: RequestRecord) -> None:
        fut = self._loop.create_future()
        self._live[rid] = (rec, fut)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        self.client.send(make_request(list(req.prompt_token_ids), params, defaults=self.info.request_defaults,
                                      request_id=rid, arrival_time=time.monotonic(), tenant=req.tenant,
                                      slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms,
                                      lora_request=self.loras[req.lora] if req.lora is not None else None))
        try:
            await fut
        except asyncio.CancelledError:
            self.client.send(AbortRequest(rid))
            raise

    def end_of_input(self) -> None:
        """Tell a static batcher without a flush timer that no more requests will come, as the
        offline `LLM` does; otherwise its last, partial batch would wait forever. A batcher with a
        timer (dynamic, or static with `static_flush_ms`) is not told: it flushes on its own,
        as it would in a server."""
        if self._waits_for_end:
            self.client.send(EndInput())

    async def close(self) -> None:
        self.client.send(Stop())
        await asyncio.to_thread(self._done.wait, 60)
        if self._fatal is not None:
            raise RuntimeError(f"the engine loop failed: {self._fatal}")

    def engine_stats(self) -> EngineRunStats:
        """Exact per-step numbers of this run (call after `close`)."""
        info, (q0, h0), snap = self.info, self._prefix0, self._last_snapshot
        return engine_stats_from_steps(self.steps, info.num_kv_blocks, info.block_size, info.max_model_len,
                                       snap.prefix_queries - q0, snap.prefix_hits - h0)

    # --- engine thread ------------------------------------------------------------------------------
    def _on_output(self, out: LoopOutput) -> None:
        if out.snapshot is not None:
            self._last_snapshot = out.snapshot
        for failed in out.failed:
            rid, message = failed.request_id, failed.message
            live = self._live.pop(rid, None)
            if live is not None:
                self._resolve(live[1], exc=ValueError(message))
        if out.stats is not None and out.stats.num_seqs > 0:
            self.steps.append(out.stats)
        for d in out.deltas:
            live = self._live.get(d.group_id)
            if live is None:
                continue
            rec, fut = live
            if d.new_token_ids:
                rec.token_times.append(out.time)
                rec.output_len += len(d.new_token_ids)
            if d.finished:
                rec.end = out.time
                rec.cached_tokens = d.num_cached_tokens
                if d.finish_reason == "abort":
                    rec.error = "aborted"
                del self._live[d.group_id]
                self._resolve(fut)
        if out.error is not None:
            self._fatal = out.error
            for _, fut in list(self._live.values()):
                self._resolve(fut, exc=RuntimeError(f"engine stopped: {out.error}"))
            self._live.clear()
        if out.final:
            for _, fut in self._live.values():
                self._resolve(fut)
            self._live.clear()
            self._done.set()

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None = None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(None)

        try:
            self._loop.call_soon_threadsafe(done)
        except (RuntimeError, AttributeError):  # the load's event loop is gone already
            pass


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
            backend.client.send(Stop())  # the engine loop ends even if the load never got to close()

    helper = threading.Thread(target=load_side, name="bench-load", daemon=True)
    helper.start()
    backend.client.start(on_this_thread=True)
    helper.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def engine_stats_from_steps(steps: list[StepStats], num_blocks: int, block_size: int, max_model_len: int,
                            prefix_queries: int, prefix_hits: int) -> EngineRunStats:
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
    return EngineRunStats(
        source="in-process",
        num_steps=len(steps),
        busy_s=busy,
        step_phase_s=phases,
        mean_batch_size=mean([s.num_seqs for s in steps]),
        mean_step_tokens=mean([s.num_tokens for s in steps]),
        mean_kv_usage=mean([s.kv_used_blocks / num_blocks for s in steps]),
        peak_kv_usage=max((s.kv_used_blocks / num_blocks for s in steps), default=None),
        prefix_hit_rate=prefix_hits / prefix_queries if prefix_queries else None,
        num_preemptions=sum(s.num_preempted for s in steps),
        processed_tokens=sum(s.num_tokens for s in steps),
        prefill_tokens=sum(s.num_prefill_tokens for s in steps),
        kv_waste_paged=mean(paged),
        kv_waste_contiguous=mean(contig),
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
    )
