"""One benchmark run: start a backend, drive the load with a progress bar, build the result."""

from __future__ import annotations

import asyncio
import contextlib

from tqdm.auto import tqdm

from conveyor.bench.engine_backend import EngineBackend
from conveyor.bench.loadgen import Backend, LoadPattern, drive
from conveyor.bench.result import RunResult, build_result
from conveyor.bench.stats import FlopModel
from conveyor.bench.workloads import BenchRequest
from conveyor.engine.llm_engine import StepStats


async def run_once(backend: Backend, requests: list[BenchRequest], load: LoadPattern, *,
                   flop_model: FlopModel | None, peak_flops: float | None, slo_ttft_ms: float | None = None,
                   slo_tpot_ms: float | None = None, server_pid: int | None = None, progress: bool = True,
                   keep_steps: bool = False, meta: dict | None = None) -> RunResult:
    """Run `requests` against `backend` under `load` and return the result dict.

    With `keep_steps` (in-process only) the result also holds every engine step, compactly, for
    the occupancy timeline.
    """
    meta = dict(meta or {})
    meta.setdefault("label", load.label)
    bar = tqdm(total=len(requests), desc=meta["label"], unit="req", disable=not progress, dynamic_ncols=True,
               leave=False)
    gpu_samples: list[float] = []
    await backend.start()
    sampler = asyncio.create_task(_sample_gpu(gpu_samples))
    try:
        records, timing = await drive(backend, requests, load, on_done=lambda _: bar.update(1), server_pid=server_pid)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await backend.close()
        bar.close()
    gpu = sum(gpu_samples) / len(gpu_samples) / 100 if gpu_samples else None
    res = build_result(records, timing, backend.engine_stats(), flop_model=flop_model, peak_flops=peak_flops,
                       slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, gpu_util=gpu, meta=meta)
    if keep_steps and isinstance(backend, EngineBackend):
        res.steps = compact_steps(backend.steps, timing.start)
    return res


def compact_steps(steps: list[StepStats], t0: float) -> list[dict]:
    """Each step as {t: start (s after the run began), d: duration, ids: request indices, tok, pf, ...};
    rt / rp / pre: each request's tokens, whether they were prompt, and who was preempted (the replay)."""
    return [{"t": round(s.start - t0, 6), "d": round(s.end - s.start, 6), "tok": s.num_tokens,
             "pf": s.num_prefill_tokens, "ids": [_index(r) for r in s.request_ids],
             "kv_blocks": s.kv_used_blocks, "kv_slots": s.kv_used_slots, "running": s.num_running,
             "context_tokens": s.logical_tokens, "waiting": s.num_waiting, "rt": s.request_tokens,
             "rp": [int(p) for p in s.request_prefill], "pre": [_index(r) for r in s.preempted_ids]}
            for s in steps]


def _index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[-1])


async def _sample_gpu(out: list[float], every_s: float = 0.5) -> None:
    """GPU utilization (%), sampled while the run lasts; nothing when there is no CUDA device."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
        torch.cuda.utilization()  # needs pynvml; raises when it is missing
    except Exception:
        return
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            out.append(float(torch.cuda.utilization()))
