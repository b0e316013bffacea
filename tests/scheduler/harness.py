"""A model-free driver for the scheduler: a scripted clock and a fake runner that 'samples' token 7."""

from __future__ import annotations

import itertools

from conveyor.config import EngineConfig
from conveyor.kv_cache import KVCacheManager
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler, Step
from conveyor.scheduler.policies import make_policy


def distinct_prompt(k: int, prompt_len: int) -> list[int]:
    """Request k's prompt: a first token of its own, so no two prompts share a block by chance (tokens drawn from
    str hashes, which change per process, once gave two of 16 requests the same first block, and the iteration
    family rightly held one back while the other computed that prefix: a test that failed one run in ~40)."""
    return [1000 + k] + [100 + (k * 31 + i * 7) % 50 for i in range(1, prompt_len)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, num_blocks: int = 256, **config) -> None:
        config.setdefault("block_size", 4)
        self.config = EngineConfig(model="unused", **config)
        self.clock = Clock()
        self.kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.sched = Scheduler(self.config, self.kv, make_policy(self.config), max_model_len=num_blocks *
                               self.config.block_size, clock=self.clock)
        self.ids = itertools.count()
        self.steps: list[Step] = []

    def add(self, prompt_len: int = 8, max_tokens: int = 4, priority: int = 0, prompt: list[int] | None = None,
            tenant: str | None = None, slo_ttft_s: float | None = None) -> Request:
        k = next(self.ids)
        rid = f"r{k}"
        ids = prompt if prompt is not None else distinct_prompt(k, prompt_len)
        req = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                      arrival_time=self.clock(), tenant=tenant, slo_ttft_s=slo_ttft_s)
        self.sched.add(req)
        return req

    def step(self, dt: float = 0.001) -> Step:
        self.clock.now += dt
        step = self.sched.schedule()
        n_samplers = sum(1 for it in step.items if it.samples)
        sampled = self.sched.update(step, [7] * n_samplers)
        for req, _ in sampled:
            if len(req.output_token_ids) >= req.max_tokens:
                self.sched.finish(req, "length")
        self.steps.append(step)
        return step

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler did not finish")

    @staticmethod
    def ids_in(step: Step) -> set[str]:
        return {it.request.request_id for it in step.items}
