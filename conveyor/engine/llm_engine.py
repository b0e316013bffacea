"""The engine: one `step()` is schedule -> run -> update; everything else is bookkeeping.

It is synchronous and single-threaded on purpose. The offline `LLM` drives it in a loop; the
server's `AsyncEngine` drives it from its own thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from conveyor.config import EngineConfig
from conveyor.engine.output_processor import Detokenizer, check_stop, make_delta
from conveyor.kv_cache import KVCacheManager
from conveyor.model.loader import load_checkpoint
from conveyor.outputs import StepDelta
from conveyor.request import Request
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler, Step
from conveyor.scheduler.policies import make_policy

log = logging.getLogger("conveyor.engine")


STEP_PHASES = ("schedule", "prepare", "forward", "lm_head", "sample", "update")


@dataclass
class StepStats:
    """What one step did, for metrics and the batching lab's occupancy timeline."""

    index: int
    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    request_ids: list[str]
    num_preempted: int
    kv_used_blocks: int
    kv_used_slots: int  # slots of used blocks that hold a token (the rest is waste)
    num_running: int = 0  # after the step (finished requests already left)
    num_waiting: int = 0
    logical_tokens: int = 0  # running requests' context tokens, a shared prefix counted per request
    phases: dict[str, float] | None = None  # seconds in each of STEP_PHASES

    @property
    def end(self) -> float:
        return self.start + self.duration


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        ckpt = load_checkpoint(config.model, config.tokenizer, config.quantization)
        self.tokenizer = ckpt.tokenizer
        self.model_config = ckpt.config
        self.model_name = config.served_model_name or config.model
        self.runner = ModelRunner(ckpt.config, ckpt.tensors, config, ckpt.quantized)
        pool_tokens = self.runner.num_blocks * config.block_size
        model_ctx = ckpt.config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > pool_tokens:
                raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                                 f"({pool_tokens} tokens); raise kv_cache_memory")
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(model_ctx, pool_tokens)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, make_policy(config), self.max_model_len)
        self.detok = Detokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(ckpt.config.eos_token_ids)
        self._ids = itertools.count()
        self.step_stats: list[StepStats] = []
        self.record_steps = False
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)  # cumulative, for the log, /metrics and the lab
        log.info("model %s on %s/%s: KV cache %d blocks x %d tokens = %d tokens (%.2f GiB), max_model_len %d, "
                 "scheduler %s, loaded in %.1fs", config.model, self.runner.device, self.runner.dtype,
                 self.runner.num_blocks, config.block_size, pool_tokens,
                 self.runner.num_blocks * self.runner.bytes_per_block / 2**30, self.max_model_len,
                 config.scheduler, time.perf_counter() - t0)

    # --- requests -----------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens long, which leaves no room to generate "
                             f"within max_model_len ({self.max_model_len})")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> list[Request]:
        """Queue a request (n > 1 fans out into n sequences sharing the prompt). Validates first."""
        self.validate_prompt(prompt_token_ids, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        reqs = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, list(prompt_token_ids), params.for_sample(i) if params.n > 1 else params,
                          eos_token_ids=self.eos_token_ids, parent_id=request_id if params.n > 1 else None,
                          index=i, priority=priority, arrival_time=arrival, cache_salt=cache_salt,
                          fork_from=reqs[0] if reqs else None)
            self.scheduler.add(req)
            reqs.append(req)
        return reqs

    def abort_request(self, request_id: str) -> list[Request]:
        """Abort a request (all n of its sequences); frees their KV blocks at once."""
        ids = [rid for rid in list(self.scheduler.requests)
               if rid == request_id or rid.startswith(request_id + "#")]
        out = []
        for rid in ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                self.detok.release(rid)
                out.append(req)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -----------------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        start = time.monotonic()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        tables = [self.kv.block_tables[it.request.request_id] for it in plan.items]
        t1 = time.perf_counter()
        result = self.runner.execute(plan.items, tables, self.kv.take_copies())
        t2 = time.perf_counter()
        deltas = self._update(plan, result)
        prepare, forward, lm_head, sample = self.runner.last_phases
        phases = {"schedule": t1 - t0, "prepare": prepare, "forward": forward, "lm_head": lm_head, "sample": sample,
                  "update": time.perf_counter() - t2 + max(t2 - t1 - prepare - forward - lm_head - sample, 0.0)}
        for k, v in phases.items():
            self.phase_seconds[k] += v
        if self.record_steps:
            self._record(plan, start, phases)
        return deltas

    def _update(self, plan: Step, result) -> list[StepDelta]:
        token_ids = result.token_ids if result else []
        sampled = self.scheduler.update(plan, token_ids)
        self.total_prompt_tokens += sum(len(r.prompt_token_ids) for r in plan.admitted if r.num_preemptions == 0)
        deltas = []
        lp_iter = iter(result.logprobs if result else [])
        sp_iter = iter(result.sampled_logprobs if result else [])
        for req, tok in sampled:
            lp, slp = next(lp_iter), next(sp_iter)
            if lp is not None:
                req.logprobs.append(lp)
                req.cumulative_logprob += slp
            self.total_generation_tokens += 1
            piece = self.detok.decode_token(req, tok)
            req.output_text += piece
            stop = check_stop(req, tok, piece, self.max_model_len)
            if stop is not None:
                if stop[0] == "stop" and not isinstance(stop[1], str) and piece \
                        and not req.params.include_stop_str_in_output:
                    # as vLLM: a stop token (EOS or stop_token_ids) adds no text
                    req.output_text = req.output_text[: len(req.output_text) - len(piece)]
                self.scheduler.finish(req, stop[0], stop[1])
            text = self.detok.take_new_text(req, final=stop is not None)
            deltas.append(make_delta(req, [tok], text, lp))
            if stop is not None:
                self.detok.release(req.request_id)
        return deltas

    def _record(self, plan: Step, start: float, phases: dict[str, float]) -> None:
        bs = self.config.block_size
        tables = self.kv.block_tables
        # empty slots = the unfilled tail of each request's last block; shared full blocks waste nothing
        empty = sum(max(len(tables.get(r.request_id, ())) * bs - r.num_computed_tokens, 0)
                    for r in self.scheduler.running)
        used_blocks = self.kv.pool.num_used
        self.step_stats.append(StepStats(
            index=self.scheduler.step_count, start=start, duration=time.monotonic() - start,
            num_seqs=len(plan.items), num_tokens=plan.num_tokens,
            num_prefill_tokens=sum(it.num_tokens for it in plan.items if it.num_tokens > 1),
            request_ids=[it.request.group_id for it in plan.items], num_preempted=len(plan.preempted),
            kv_used_blocks=used_blocks, kv_used_slots=used_blocks * bs - empty,
            num_running=self.num_running, num_waiting=self.num_waiting,
            logical_tokens=sum(r.num_computed_tokens for r in self.scheduler.running), phases=phases,
        ))

    # --- introspection for metrics ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, including n > 1 siblings held until their prompt is computed."""
        return len(self.scheduler.waiting) + sum(len(v) for v in self.scheduler.held.values())
