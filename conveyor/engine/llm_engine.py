"""The engine: one `step()` is schedule -> run -> update; everything else is bookkeeping.

It is synchronous and single-threaded on purpose, and a closed box: callers add and abort requests,
call `step()` (which returns a typed `StepOutput`), and read `snapshot()` / `info`; nothing outside
`conveyor/engine/` touches the scheduler or the KV manager. The offline `LLM` steps it in a loop;
the server and the lab drive it through `EngineLoop` (`loop.py`), in a thread or a process (`clients.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor import startup
from conveyor.config import EngineConfig
from conveyor.engine.draft import DraftProposer
from conveyor.engine.kv_disk import open_kv_disk, tier_key
from conveyor.engine.output_processor import Detokenizer, apply_stop, make_delta
from conveyor.engine.speculative import (
    SpecBackoff,
    SpecStats,
    SpeculativeConfig,
    can_speculate,
    measure_forward_costs,
    ngram_propose,
)
from conveyor.engine.structured_output import StructuredOutputManager
from conveyor.kv_cache import KVCacheManager
from conveyor.kv_cache.disk_tier import DiskTier, DiskTierStats, weights_digest
from conveyor.lora.adapter import LoRASpec
from conveyor.lora.request import LoRARequest
from conveyor.model.loader import default_sampling, load_checkpoint
from conveyor.outputs import FinishReason, StepDelta
from conveyor.pooling import PooledOutput
from conveyor.request import EngineRequest, Request, RequestDefaults, Tier, sequence_ids
from conveyor.runner.model_runner import ModelRunner
from conveyor.runner.sampler import SampleResult
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler, Step
from conveyor.scheduler.policies import POLICIES, check_scheduler, coerce_options, make_policy

log = logging.getLogger("conveyor.engine")


MAX_TENANT_ROWS = 64  # tenants whose generated tokens the engine counts for the dashboard (first come)

STEP_PHASES = ("schedule", "grammar", "prepare", "forward", "lm_head", "sample", "update")


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
    request_tokens: list[int] = field(default_factory=list)  # tokens each of `request_ids` got in this step
    request_prefill: list[bool] = field(default_factory=list)  # whether that was prompt (a chunk) or a decode
    preempted_ids: list[str] = field(default_factory=list)  # requests this step pushed back to the queue
    lora_ids: list[int] = field(default_factory=list)  # the distinct adapters (int ids) this step ran

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class StepOutput:
    """What one `step()` produced: each sequence's new tokens and text, and the step's stats
    (None when the policy scheduled nothing, e.g. a static batcher holding a partial batch back)."""

    deltas: list[StepDelta]
    stats: StepStats | None


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters and queue sizes at one moment, read between steps (metrics, the lab, the log)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    phase_seconds: tuple[tuple[str, float], ...]
    scheduler: str = ""  # the batching strategy running now
    scheduler_switches: int = 0  # strategy switches on this engine (`set_scheduler`)
    spec_drafts: int = 0  # speculative decoding: drafts verified, tokens guessed and kept, kept per position
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA: sequences per adapter name, running and waiting (vLLM's lora_requests_info)
    lora_running: tuple[tuple[str, int], ...] = ()
    lora_waiting: tuple[tuple[str, int], ...] = ()
    # per tenant (with requests now, or counted): (tenant, running, waiting, tokens generated since the start)
    tenants: tuple[tuple[str, int, int, int], ...] = ()
    lora_loaded: tuple[str, ...] = ()  # adapters loaded in the model's layers, least recently used first
    steps: int = 0  # steps the scheduler has planned on this engine (since the last `reset`)
    lora_deferrals: int = 0  # steps where requests for resident adapters went first (--max-loras was the limit)
    kv_disk: DiskTierStats | None = None  # the prefix cache's disk tier (--kv-disk-dir), if any
    batch_running: int = 0  # batch-tier sequences (Batch API lines) among `running` and `waiting`
    batch_waiting: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What the engine was built with; fixed for its life, and small enough to send between processes."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    weight_dtype: str
    kv_cache_dtype: str
    block_size: int
    num_kv_blocks: int
    bytes_per_block: int
    batch_invariant: bool
    attention_backend: str
    # for requests that leave fields unset: the model's sampling (--generation-config), the latency targets
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)
    hidden_size: int = 0  # the width of an embedding (/v1/embeddings `dimensions` may not exceed it)
    lora: LoRASpec | None = None  # what adapters must fit, when LoRA is enabled (checked on the HTTP side)
    max_loras: int = 0  # distinct adapters per step (0: LoRA off)
    weight_bytes: int = 0  # the model's parameters and buffers: what every step reads once (the lab's MBU)
    lora_kernel: bool = False  # adapters' deltas run the compiled kernel (else torch's matmuls)
    quantized_linears: int = 0  # linear layers held in int8/int4 (--quantization or a quantized checkpoint)

    @property
    def default_sampling(self) -> dict:
        """The model's recommended sampling, for requests that set none (--generation-config)."""
        return dict(self.request_defaults.sampling)

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def validate_prompt(token_ids: list[int], info: EngineInfo) -> None:
    """Raise ValueError if the engine `info` describes cannot take this prompt (also used by the
    HTTP side, so that bad input never reaches the engine, wherever it runs)."""
    if not token_ids:
        raise ValueError("prompt must not be empty")
    vocab = info.vocab_size
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if len(token_ids) >= info.max_model_len:
        raise ValueError(f"prompt is {len(token_ids)} tokens long, which leaves no room to generate "
                         f"within max_model_len ({info.max_model_len})")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        check_scheduler(config.scheduler)  # before the weights load: a bad name fails at once
        self.config = config
        t0 = time.perf_counter()
        startup.phase(startup.LOADING_WEIGHTS, config.model)
        ckpt = load_checkpoint(config.model, config.tokenizer)
        self.tokenizer = ckpt.tokenizer
        self.model_config = ckpt.config
        self.model_name = config.served_model_name or config.model
        # the disk tier's namespace names the weights by their values (read before the runner takes them)
        self._weights_id = weights_digest(ckpt.tensors) if config.kv_disk_dir else None
        self.runner = ModelRunner(ckpt.config, ckpt.tensors, config)
        pool_tokens = self.runner.num_blocks * config.block_size
        model_ctx = ckpt.config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > model_ctx:  # past the RoPE table: the engine thread died on the first long step
                raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's context "
                                 f"(max_position_embeddings {model_ctx})")
            if config.max_model_len > pool_tokens:
                raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                                 f"({pool_tokens} tokens); raise kv_cache_memory")
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(model_ctx, pool_tokens)
        self.detok = Detokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(ckpt.config.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, ckpt.config.vocab_size, self.eos_token_ids)
        self.spec = SpeculativeConfig.parse(config.speculative_config)
        self.spec_backoff: SpecBackoff | None = None
        self.draft: DraftProposer | None = None
        self.draft_costs: SpecBackoff | None = None  # the draft's forward cost per row count
        if self.spec is not None and self.spec.method == "draft":
            model = config.model if self.spec.model == "self" else self.spec.model
            self.draft = DraftProposer(config, model, self.spec.quantization, self.runner.num_blocks,
                                       ckpt.config.vocab_size, self.spec.num_layers)
        if self.spec is not None and self.spec.backoff:
            rows = min(config.max_num_seqs * (self.spec.num_speculative_tokens + 1), 512)
            costs = measure_forward_costs(self.runner, rows)
            self.spec_backoff = SpecBackoff(costs)
            if self.draft is not None:
                self.draft_costs = SpecBackoff(measure_forward_costs(self.draft.runner, min(config.max_num_seqs, 512)))
            log.info("speculative decoding (%s, up to %d tokens): forward cost per row count %s", self.spec.method,
                     self.spec.num_speculative_tokens, {n: f"{1e3 * t:.1f}ms" for n, t in costs.items()})
        self._ids = itertools.count()
        self.scheduler_switches = 0
        self.kv_disk: DiskTier | None = None
        self._kv_disk_key: tuple | None = None
        self.reset(config)
        r = self.runner
        self.info = EngineInfo(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=ckpt.config.vocab_size,
            eos_token_ids=tuple(ckpt.config.eos_token_ids), device=str(r.device),
            dtype=str(r.dtype).removeprefix("torch."), weight_dtype=r.weight_dtype, kv_cache_dtype=r.kv_dtype_name,
            block_size=config.block_size, num_kv_blocks=r.num_blocks, bytes_per_block=r.bytes_per_block,
            batch_invariant=r.batch_invariant, attention_backend=r.attention_backend,
            request_defaults=RequestDefaults(default_sampling(config.model, config.generation_config),
                                             config.slo_ttft_ms, config.slo_tpot_ms),
            hidden_size=ckpt.config.hidden_size,
            lora=r.lora.spec if r.lora is not None else None, max_loras=config.max_loras if r.lora is not None else 0,
            weight_bytes=r.weight_bytes, lora_kernel=r.lora is not None and r.lora.kernel is not None,
            quantized_linears=r.quantized_linears)
        self.lora_to_remove: set[int] = set()  # unloaded while requests still ran under them
        if self.info.default_sampling:
            log.info("sampling defaults for requests that set none (--generation-config %s): %s",
                     config.generation_config, self.info.default_sampling)
        log.info("model %s on %s/%s: KV cache %d blocks x %d tokens = %d tokens (%.2f GiB), max_model_len %d, "
                 "scheduler %s, loaded in %.1fs", config.model, self.runner.device, self.runner.dtype,
                 self.runner.num_blocks, config.block_size, pool_tokens,
                 self.runner.num_blocks * self.runner.bytes_per_block / 2**30, self.max_model_len,
                 config.scheduler, time.perf_counter() - t0)

    def reset(self, config: EngineConfig | None = None) -> None:
        """A fresh scheduler, policy and (empty) KV manager, optionally for another `config` with the
        same model and pool (the lab runs every strategy on one model load). The KV tensors need no
        clearing: every slot is written before it is read. Counters start from zero."""
        if getattr(self, "scheduler", None) is not None and self.has_unfinished_requests():
            raise RuntimeError("cannot reset an engine that still has requests")
        config = config if config is not None else self.config
        if self.runner.pool_key != self.runner.kv_pool_key(config):  # the knob lab: another block size or budget
            if self.draft is not None:
                raise ValueError("a speculative draft's KV pool cannot be resized: keep block_size and memory fixed")
            self.runner.allocate_kv_cache(config)  # raises (leaving no pool, rebuilt next time) if it cannot
            r = self.runner
            self.info = dataclasses.replace(self.info, block_size=r.block_size, num_kv_blocks=r.num_blocks,
                                            bytes_per_block=r.bytes_per_block)
        if self.runner.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(f"this KV pool ({self.runner.num_blocks} blocks of {config.block_size}) cannot hold "
                             f"one max_model_len ({self.max_model_len}) sequence")
        self.config = config
        if getattr(self, "info", None) is not None:  # the lab's next config may bring other latency targets
            self.info = dataclasses.replace(self.info, request_defaults=dataclasses.replace(
                self.info.request_defaults, slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms))
        if self._kv_disk_key != tier_key(config, self.runner):  # disk tier: opened once, again for another pool
            if self.kv_disk is not None:
                self.kv_disk.close()
            self.kv_disk = open_kv_disk(config, self.runner, self._weights_id)
            self._kv_disk_key = tier_key(config, self.runner)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 self.kv_disk)
        self.scheduler = Scheduler(config, self.kv, make_policy(config), self.max_model_len)
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        # generated tokens per tenant, the first MAX_TENANT_ROWS (the snapshot's tenant rows: Scheduler.tenant_rows)
        self.tenant_tokens: dict[str, int] = {}
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)  # cumulative, for the log, /metrics and the lab
        self.spec_stats = SpecStats()
        self.held_deltas: dict[str, StepDelta] = {}  # batch lines' output so far, sent whole at their end (`_whole`)
        self.spec_skipped_steps = 0  # steps where guesses were ready but the back-off said they would not pay
        if config.seed is not None:  # as vLLM's --seed: requests without a seed draw from this generator
            torch.manual_seed(config.seed)

    # --- requests -----------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams | None = None) -> None:
        validate_prompt(token_ids, self.info)

    def add_request(self, request: EngineRequest) -> list[Request]:
        """Queue `request` (built by `conveyor.request.make_request`; n > 1 fans out into n sequences sharing
        the prompt); returns its sequences. Checks what depends on this engine first (the prompt against the
        vocabulary and the context, the adapter, which is loaded from disk on first use); the record itself
        is valid by construction. With `pooling` it is an embedding request: prefill only, finished with its
        vector."""
        if not isinstance(request, EngineRequest):
            raise TypeError(f"add_request takes an EngineRequest (conveyor.request.make_request), "
                            f"got {type(request).__name__}")
        params = request.params
        self.validate_prompt(request.prompt_token_ids, params)
        lora_key = self.load_lora(request.lora_request) if request.lora_request is not None else None
        params.check_vocab(self.model_config.vocab_size)
        group_id = request.request_id or f"req-{next(self._ids)}"
        ids = sequence_ids(group_id, params.n)
        if any(rid in self.scheduler.requests for rid in ids):
            raise ValueError(f"request_id {group_id!r} is already in use")
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        so = params.structured_outputs
        matchers = [self.structured.matcher(so) for _ in ids] if so is not None else [None] * len(ids)
        self.scheduler.input_ended = False  # more input came: `end_input()` must be said again
        reqs = []
        for i in range(len(ids)):
            req = Request.from_engine_request(request, group_id, i, arrival_time=arrival,
                                              eos_token_ids=self.eos_token_ids, fork_from=reqs[0] if reqs else None,
                                              lora_key=lora_key)
            req.matcher = matchers[i]
            self.scheduler.add(req)
            reqs.append(req)
        return reqs

    # --- LoRA adapters ---------------------------------------------------------------------------------
    def _loras_in_use(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}

    def load_lora(self, lora_request: LoRARequest) -> str:
        """Load the adapter if it is not loaded; its digest (the KV hash's adapter identity)."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("this engine was started without LoRA: pass enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        self.lora_to_remove.discard(lora_request.lora_int_id)
        return lora.get(lora_request, self._loras_in_use()).key

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter: at once if no request runs under it, else once the last one finishes
        (requests already running keep their adapter). False if it was not loaded."""
        lora = self.runner.lora
        if lora is None or lora_int_id not in lora.adapters:
            return False
        if lora_int_id in self._loras_in_use():
            self.lora_to_remove.add(lora_int_id)
        else:
            lora.remove(lora_int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return self.runner.lora.loaded if self.runner.lora is not None else []

    def _reap_loras(self) -> None:
        in_use = self._loras_in_use()
        for lid in [x for x in self.lora_to_remove if x not in in_use]:
            self.runner.lora.remove(lid)
            self.lora_to_remove.discard(lid)
        self.runner.lora.trim(in_use)

    def abort_request(self, request_id: str) -> list[StepDelta]:
        """Abort a request (all n of its sequences); frees their KV blocks at once. Returns a final
        delta (finish_reason "abort") for each sequence that was still unfinished."""
        out = []
        for rid in [r.request_id for r in self.scheduler.requests.values() if r.group_id == request_id]:
            req = self.scheduler.abort(rid)
            if req is not None:
                self.detok.release(rid)
                out.append(self._whole(req, make_delta(req, [], "", None)))
        return out

    def abort_all(self) -> list[StepDelta]:
        """Abort every request (shutdown, or a lab run that ends): their final "abort" deltas."""
        return [d for gid in {r.group_id for r in self.scheduler.requests.values()} for d in self.abort_request(gid)]

    def set_scheduler(self, name: str, options: dict | None = None) -> EngineConfig:
        """Switch the batching strategy now, between steps, keeping every request where it is (waiting,
        running, their KV blocks): only the policy deciding the next steps changes. `options`: the new
        strategy's own knobs (the rest keep their values). Raises ValueError, changing nothing, if the
        name or an option is bad. Returns the new config."""
        cfg = dataclasses.replace(self.config, scheduler=name, **coerce_options(name, options or {}))
        policy = make_policy(cfg)  # may refuse an option's value (before anything changed)
        policy.adopt(self.scheduler)
        self.scheduler.policy = policy
        self.scheduler.config = cfg
        self.config = cfg
        self.scheduler_switches += 1
        log.info("scheduler switched to %s (%s)", name,
                 POLICIES[name].describe(dataclasses.asdict(cfg)) or "no options")
        return cfg

    def end_input(self) -> None:
        """No more requests are coming (offline): a static batcher without a flush timer may run its
        last, partial batch. Cleared by the next `add_request`."""
        self.scheduler.input_ended = True

    @property
    def waits_for_end_of_input(self) -> bool:
        """True for a policy that only flushes a partial batch once told `end_input()` (static, no timer)."""
        return POLICIES[self.config.scheduler].waits_for_end_of_input(self.config)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def running_group_ids(self) -> list[str]:
        """The groups in the running batch (scheduled, prefilling or decoding): what a failed step was working on."""
        return sorted({r.group_id for r in self.scheduler.running})

    # --- the step -----------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        start = time.monotonic()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        lora = self.runner.lora
        if lora is not None and plan.lora_ids:  # each adapter's rows in one segment (conveyor/lora/layers.py)
            plan.items.sort(key=lambda it: it.request.lora_int_id or 0)
        tables = [self.kv.block_tables[it.request.request_id] for it in plan.items]
        t1 = time.perf_counter()
        # one entry per sampled row, in the runner's order (a sequence with guesses has a row per guess)
        grammar = self.structured.bitmask([it.request for it in plan.items if it.samples
                                           for _ in range(1 + it.num_draft)])
        tg = time.perf_counter()
        result = self.runner.execute(plan.items, tables, self.kv.take_copies(), grammar)
        t2 = time.perf_counter()
        # prompt or decode, read before the update gives a finished prompt its first output token
        prefill = [it.num_tokens - it.num_draft > 1 or not it.request.output_token_ids for it in plan.items]
        deltas = self._update(plan, result)
        if lora is not None and (self.lora_to_remove or len(lora.adapters) > lora.max_cpu_loras):
            self._reap_loras()
        t3 = time.perf_counter()
        prepare, forward, lm_head, sample = result.phases
        phases = {"schedule": t1 - t0, "grammar": tg - t1 + self._grammar_update_s, "prepare": prepare,
                  "forward": forward, "lm_head": lm_head, "sample": sample,
                  "update": t3 - t2 - self._grammar_update_s + max(t2 - tg - prepare - forward - lm_head - sample, 0.0)}
        for k, v in phases.items():
            self.phase_seconds[k] += v
        stats = self._stats(plan, start, phases, prefill) if plan.items else None
        if self.kv.tier is not None:  # the disk tier's policy weighs reads against measured prefill costs
            self.kv.tier.observe_compute(plan.num_tokens, forward)
            if stats is None and self.kv.loads_in_flight:
                self.kv.wait_for_loads(0.005)  # nothing to run until a read is in: wait for it, not spin
        return StepOutput(deltas, stats)

    def _update(self, plan: Step, result: SampleResult) -> list[StepDelta]:
        self._grammar_update_s = 0.0  # time spent advancing grammar matchers (a "grammar" phase cost)
        if result.prompt_logprobs:  # prompt logprobs computed this step (rarely any)
            for it in plan.items:
                entries = result.prompt_logprobs.get(it.request.request_id)
                if entries:
                    it.request.prompt_logprobs.extend(entries)
        deltas = []
        if result.bad:  # non-finite logits: those requests fail, the batch goes on
            deltas += self._drop_broken(plan, result)
        sampled = self.scheduler.update(plan, result.token_ids)
        for p in result.pooled:  # embeddings: done, blocks freed now
            if p.request_id in self.scheduler.requests:
                deltas.append(self._finish_pooled(p))
        self.total_prompt_tokens += sum(len(r.prompt_token_ids) for r in plan.admitted if r.num_preemptions == 0)
        lp_iter = iter(result.logprobs)
        sp_iter = iter(result.sampled_logprobs)
        drafts = {it.request.request_id: it.num_draft for it in plan.items if it.num_draft}
        for req, toks in sampled:
            lps, slps = next(lp_iter), next(sp_iter)
            try:
                d = self._emit(req, toks, lps, slps, drafts)
            except Exception as exc:  # noqa: BLE001 - tied to this request (its text, stop, grammar): fail it alone
                d = self._fail(req, exc)
            if (d := self._whole(req, d)) is not None:
                deltas.append(d)
        if self.spec is not None:
            self._propose()
        return deltas

    def _whole(self, req: Request, d: StepDelta) -> StepDelta | None:
        """Batch lines (`Tier.BATCH`) are answered whole, never streamed: their deltas are merged here and go out
        once, with the last (finished, failed or aborted), so a batch line costs the server's event loop one
        delta, not one per token. Other requests' deltas pass as they are."""
        held = self.held_deltas.pop(req.request_id, None)
        if req.tier is not Tier.BATCH:
            return d
        if held is not None:
            held.new_token_ids += d.new_token_ids
            held.new_text += d.new_text
            if d.new_logprobs:
                held.new_logprobs = (held.new_logprobs or []) + d.new_logprobs
            held.prompt_logprobs = held.prompt_logprobs or d.prompt_logprobs
            for name in ("finish_reason", "stop_reason", "embedding", "error", "num_cached_tokens",
                         "first_scheduled_time", "num_preemptions"):
                setattr(held, name, getattr(d, name))
            d = held
        if d.finished:
            return d
        self.held_deltas[req.request_id] = d
        return None

    def _finish_pooled(self, p: PooledOutput) -> StepDelta:
        req = self.scheduler.requests[p.request_id]
        self.scheduler.finish(req, FinishReason.STOP, None)
        delta = make_delta(req, [], "", None)
        delta.embedding = p.embedding
        return delta

    def _fail(self, req: Request, exc: BaseException) -> StepDelta:
        """Finish one request with an error (finish_reason ERROR, the message in `StepDelta.error`) and free
        its blocks; the engine and every other request carry on."""
        log.error("request %s failed; it alone is finished: %r", req.request_id, exc, exc_info=exc)
        if not req.finished:
            self.scheduler.finish(req, FinishReason.ERROR, None)
        self.detok.release(req.request_id)
        delta = make_delta(req, [], "", None)
        delta.error = f"{type(exc).__name__}: {exc}"
        return delta

    def _drop_broken(self, plan: Step, result: SampleResult) -> list[StepDelta]:
        """Take the items whose logits were not finite out of the step before it is committed (so
        nothing they computed this step is counted or cached) and fail their requests."""
        broken = set(result.bad)
        sampling = [it for it in plan.items if it.samples]
        dead = [sampling[i] for i in sorted(broken)]
        keep = [k for k in range(len(sampling)) if k not in broken]
        result.token_ids = [result.token_ids[k] for k in keep]
        result.logprobs = [result.logprobs[k] for k in keep]
        result.sampled_logprobs = [result.sampled_logprobs[k] for k in keep]
        result.bad = []
        plan.items = [it for it in plan.items if all(it is not d for d in dead)]
        return [self._whole(it.request, self._fail(it.request, FloatingPointError(
            "the model produced non-finite logits for this request"))) for it in dead]

    def _emit(self, req: Request, toks: list[int], lps: list, slps: list, drafts: dict[str, int]) -> StepDelta:
        """Read one request's new tokens one at a time (text, stop checks, grammar), and return its delta.

        The scheduler committed them (`Scheduler.update`: the sequence's tokens have one owner); the stop
        checks (max_tokens, EOS, stop strings) see each prefix in turn, and the first stop wins: a
        sequence that stops before its last new token (speculative decoding) drops the tokens after it."""
        stop, kept_lps = None, []
        base = len(req.output_token_ids) - len(toks)  # output tokens before this step's
        for j, tok in enumerate(toks):
            if lps[j] is not None:
                req.logprobs.append(lps[j])
                req.cumulative_logprob += slps[j]
                kept_lps.append(lps[j])
            self.total_generation_tokens += 1
            if req.tenant_id in self.tenant_tokens or len(self.tenant_tokens) < MAX_TENANT_ROWS:
                self.tenant_tokens[req.tenant_id] = self.tenant_tokens.get(req.tenant_id, 0) + 1
            piece = self.detok.decode_token(req, tok)
            stop = apply_stop(req, tok, piece, self.max_model_len, base + j + 1)
            if req.matcher is not None:
                tg = time.perf_counter()
                if self.structured.accept(req, tok) and stop is None:
                    stop = (FinishReason.STOP, None)  # the grammar is complete
                self._grammar_update_s += time.perf_counter() - tg
            if stop is not None:
                if j + 1 < len(toks):  # stopped within the step's tokens: the rest were never output
                    toks = toks[:j + 1]
                    del req.output_token_ids[base + j + 1:]
                self.scheduler.finish(req, stop[0], stop[1])
                break
        if stop is not None and not isinstance(stop[1], str):  # not cut at a stop string: flush held text
            self.detok.flush(req, drop_last=stop[0] is FinishReason.STOP)
        if req.request_id in drafts:  # guesses kept, up to where the sequence stopped
            self._record_spec(drafts[req.request_id], len(toks) - 1)
        text = self.detok.take_new_text(req, final=stop is not None)
        delta = make_delta(req, list(toks), text, kept_lps)
        if req.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            delta.prompt_logprobs = list(req.prompt_logprobs)  # with the first token, as vLLM
        if stop is not None:
            self.detok.release(req.request_id)
        return delta

    # --- speculative decoding -------------------------------------------------------------------------
    def _record_spec(self, proposed: int, accepted: int) -> None:
        self.spec_stats.record(proposed, accepted)
        if self.spec_backoff is not None:
            self.spec_backoff.observe(proposed, accepted)

    def _propose(self) -> None:
        """Guess the next tokens of every decoding sequence that may speculate (ngram prompt lookup),
        unless the batch is past the point where extra rows pay (`SpecBackoff`)."""
        cfg = self.spec
        running = self.scheduler.running
        decoding = [r for r in running if r.num_remaining_work == 1 and can_speculate(r)]
        if not decoding or (cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size):
            return
        rooms: list[tuple[Request, int]] = []
        for r in decoding:
            room = min(cfg.num_speculative_tokens, r.max_tokens - len(r.output_token_ids) - 1,
                       self.max_model_len - r.num_tokens - 1)
            if room > 0:
                rooms.append((r, room))
        other = sum(r.num_remaining_work for r in running) - len(decoding)
        if self.draft is not None:
            # decide before drafting: the draft's k forwards are the cost of guessing
            total = sum(k for _, k in rooms)
            k_max = max((k for _, k in rooms), default=0)
            cost = k_max * self.draft_costs.t(len(rooms)) if self.draft_costs is not None else 0.0
            if self.spec_backoff is not None and not self.spec_backoff.worth_it(len(decoding), other, total, cost):
                self.spec_skipped_steps += 1
                return
            proposed = self.draft.propose(rooms, set(self.scheduler.requests))
            guesses = [(r, proposed[r.request_id]) for r, _ in rooms if proposed.get(r.request_id)]
        else:
            guesses = []
            for r, room in rooms:
                g = ngram_propose(np.asarray(r.all_token_ids), room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                if g:
                    guesses.append((r, g))
            total = sum(len(g) for _, g in guesses)
            if self.spec_backoff is not None and not self.spec_backoff.worth_it(len(decoding), other, total):
                self.spec_skipped_steps += 1
                return
        for r, g in guesses:
            r.spec_token_ids = g

    def _stats(self, plan: Step, start: float, phases: dict[str, float], prefill: list[bool]) -> StepStats:
        bs = self.config.block_size
        tables = self.kv.block_tables
        # empty slots = the unfilled tail of each request's last block; shared full blocks waste nothing
        empty = sum(max(len(tables.get(r.request_id, ())) * bs - r.num_computed_tokens, 0)
                    for r in self.scheduler.running)
        used_blocks = self.kv.pool.num_used
        return StepStats(
            index=self.scheduler.step_count, start=start, duration=time.monotonic() - start,
            num_seqs=len(plan.items), num_tokens=plan.num_tokens,
            num_prefill_tokens=sum(it.num_tokens for it in plan.items if it.num_tokens - it.num_draft > 1),
            request_ids=[it.request.group_id for it in plan.items],
            num_preempted=len(plan.preempted) + len(plan.reclaimed),
            request_tokens=[it.num_tokens for it in plan.items],
            request_prefill=prefill,
            preempted_ids=[r.group_id for r in plan.preempted + plan.reclaimed], lora_ids=sorted(plan.lora_ids),
            kv_used_blocks=used_blocks, kv_used_slots=used_blocks * bs - empty,
            num_running=self.num_running, num_waiting=self.num_waiting,
            logical_tokens=sum(r.num_computed_tokens for r in self.scheduler.running), phases=phases,
        )

    # --- read-only views ------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        lora_running, lora_waiting = self.scheduler.lora_counts() if self.runner.lora is not None else ((), ())
        batch_running, batch_waiting = self.scheduler.tier_counts()
        return EngineSnapshot(
            running=self.num_running, waiting=self.num_waiting, kv_blocks_used=self.kv.pool.num_used,
            kv_blocks_total=self.kv.pool.num_blocks, prompt_tokens=self.total_prompt_tokens,
            generation_tokens=self.total_generation_tokens, preemptions=self.scheduler.num_preemptions,
            prefix_queries=self.kv.prefix_queries, prefix_hits=self.kv.prefix_hits,
            phase_seconds=tuple(self.phase_seconds.items()), scheduler=self.config.scheduler,
            scheduler_switches=self.scheduler_switches, spec_drafts=self.spec_stats.num_drafts,
            spec_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
            lora_running=lora_running, lora_waiting=lora_waiting,
            lora_loaded=tuple(r.lora_name for r in self.runner.lora.loaded) if self.runner.lora is not None else (),
            steps=self.scheduler.step_count, lora_deferrals=self.scheduler.num_lora_deferrals,
            tenants=self.scheduler.tenant_rows(self.tenant_tokens), batch_running=batch_running,
            batch_waiting=batch_waiting, kv_disk=self.kv.tier.stats() if self.kv.tier is not None else None)

    def activation_headroom(self, config: EngineConfig) -> int:
        """Bytes a step's activations may take at most under `config` (kept out of the KV budget)."""
        return self.runner.activation_headroom(config)

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (read-only use: inspecting its layers, as a user of HF's model would)."""
        return self.runner.model

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len, vocab] of every position of one prompt, straight through the model and the KV pool's
        first blocks: to check the model against a reference (HF's logits) or measure perplexity. Outside the
        scheduler, so only on an idle engine; the pool's cached prefixes are forgotten afterwards, since the
        blocks it wrote were not allocated to anyone."""
        from conveyor.model.attention import build_metadata

        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logits needs an idle engine")
        r = self.runner
        if len(token_ids) > r.num_blocks * r.block_size:
            raise ValueError("the prompt does not fit in the KV pool")
        table = list(range(-(-len(token_ids) // r.block_size)))
        self.kv.pool.reset_cache()  # these blocks are written unallocated: nothing may still copy them as cached
        meta = build_metadata([len(token_ids)], [len(token_ids)], [table], r.block_size, r.device, r.attention_backend)
        hidden = r.model(torch.tensor(token_ids, device=r.device), torch.arange(len(token_ids), device=r.device),
                         r.kv_caches, meta)
        self.kv.pool.reset_cache()
        return r.model.compute_logits(hidden)

    def close(self) -> None:
        """Finish the disk tier's queued writes and release its directory (the engine process calls this as
        it exits; a thread's engine is closed at interpreter exit). The engine serves on without a tier."""
        if self.kv_disk is not None:
            self.kv_disk.close()
            self.kv_disk = None
            self.kv.tier = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (a cold start for tests and benchmarks)."""
        self.kv.pool.reset_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, including n > 1 siblings held until their prompt is computed."""
        return len(self.scheduler.waiting) + sum(len(v) for v in self.scheduler.held.values())
