"""Prometheus metrics, named like vLLM's with a `conveyor:` prefix.

Engine-wide numbers (queue sizes, KV usage, token counters, step counters) are read at scrape
time from the latest `EngineStats` snapshot that the engine thread publishes after each step, so
the engine never touches a metric object and a scrape never touches the engine. Per-request
numbers (latency histograms, finish reasons) are observed on the HTTP side as streams finish.
Each server owns a `CollectorRegistry`, so several servers can live in one process (tests).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import EngineInfo
from conveyor.kv_cache.disk_tier import DiskTierStats
from conveyor.outputs import FinishReason
from conveyor.request import tenant_name
from conveyor.scheduler.policies import POLICIES

disable_created_metrics()  # no `_created` series, as in vLLM: they double the output for nothing

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, taken on the engine thread between steps."""

    alive: bool = True
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0  # steps that ran at least one sequence
    step_seqs: int = 0  # sum of sequences over those steps
    phase_seconds: tuple[tuple[str, float], ...] = ()  # cumulative seconds per step phase
    scheduler: str = ""  # the batching strategy running now
    scheduler_switches: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    lora_running: tuple[tuple[str, int], ...] = ()  # sequences per LoRA adapter name
    lora_waiting: tuple[tuple[str, int], ...] = ()
    kv_disk: DiskTierStats | None = None  # the prefix cache's disk tier (--kv-disk-dir), if any
    batch_running: int = 0  # batch-tier sequences (Batch API lines) among `running` and `waiting`
    batch_waiting: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats], model_name: str, max_loras: int = 0) -> None:
        self.snapshot = snapshot
        self.model_name = model_name
        self.max_loras = max_loras  # 0: LoRA is off, no LoRA series

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"conveyor:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"conveyor:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("engine_alive", "1 while the engine serves; 0 while it restarts, or once it died for good.",
                    float(s.alive))
        yield gauge("num_requests_running", "Sequences in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting)
        yield gauge("batch_tier_seats", "Batch-tier sequences (Batch API lines) in the running batch: seats "
                    "interactive requests left them.", s.batch_running)
        yield gauge("batch_tier_waiting", "Batch-tier sequences the engine holds waiting (the server feeds it a "
                    "bounded number at a time).", s.batch_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_usage)
        yield gauge("kv_cache_blocks_used", "KV blocks referenced by live sequences.", s.kv_blocks_used)
        yield gauge("kv_cache_blocks_total", "KV blocks in the pool.", s.kv_blocks_total)
        yield counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Preemptions (recompute).", s.preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.prefix_hits)
        yield counter("engine_steps", "Engine steps that ran at least one sequence.", s.steps)
        yield counter("engine_step_seqs", "Sequences summed over engine steps (mean batch = seqs / steps).",
                      s.step_seqs)
        if s.scheduler:  # which strategy runs: 1 on its series, 0 on every other registered one
            info = GaugeMetricFamily("conveyor:scheduler_info", "The batching strategy running now (value 1; the "
                                     "others 0).", labels=["model_name", "scheduler"])
            for name in POLICIES:
                info.add_metric([self.model_name, name], float(name == s.scheduler))
            yield info
        yield counter("scheduler_switches", "Batching-strategy switches (POST /admin/scheduler).",
                      s.scheduler_switches)
        phases = CounterMetricFamily("conveyor:engine_step_phase_seconds",
                                     "Seconds the engine spent in each part of its steps (schedule, prepare "
                                     "inputs, forward, LM head, sampling, output update).",
                                     labels=["model_name", "phase"])
        for phase, seconds in s.phase_seconds:
            phases.add_metric([self.model_name, phase], seconds)
        yield phases
        # speculative decoding, as vLLM's spec_decode_* series
        yield counter("spec_decode_num_drafts", "Drafts (guessed token runs) verified.", s.spec_drafts)
        yield counter("spec_decode_num_draft_tokens", "Tokens guessed.", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Guessed tokens the model kept.", s.spec_accepted_tokens)
        per_pos = CounterMetricFamily("conveyor:spec_decode_num_accepted_tokens_per_pos",
                                      "Guessed tokens kept, by position in the draft (0 = first guess).",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        yield gauge("spec_decode_acceptance_rate", "Accepted / guessed tokens so far.",
                    s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)
        yield gauge("spec_decode_mean_acceptance_length", "Tokens per verified draft, the model's own included.",
                    1 + s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else 0.0)
        if self.max_loras:
            yield from self._lora(s)
        if s.kv_disk is not None:
            yield from self._kv_disk(s.kv_disk, gauge, counter)

    @staticmethod
    def _kv_disk(d: DiskTierStats, gauge, counter) -> Iterator[Metric]:
        """The disk tier beside the pool (docs/memory.md): what it holds, what it served, what it cost."""
        yield gauge("kv_disk_blocks", "KV blocks in the disk tier.", d.blocks)
        yield gauge("kv_disk_bytes", "Bytes of KV blocks in the disk tier.", d.bytes)
        yield gauge("kv_disk_capacity_bytes", "The disk tier's cap (--kv-disk-gib).", d.capacity_bytes)
        yield gauge("kv_disk_writing", "1 while the disk tier writes, 0 once a write failed (disk full).",
                    float(d.writing))
        yield counter("kv_disk_hits", "Prompt blocks found in the disk tier past the pool's hits.", d.hits)
        yield counter("kv_disk_loads", "Blocks read back from the disk tier into the pool.", d.loads)
        yield counter("kv_disk_load_seconds", "Seconds spent reading blocks back from the disk tier.",
                      d.load_seconds)
        yield counter("kv_disk_recomputed", "Blocks found on disk that the load policy chose to recompute.",
                      d.recomputed)
        yield counter("kv_disk_writes", "Blocks written to the disk tier.", d.writes)
        yield counter("kv_disk_write_bytes", "Bytes written to the disk tier.", d.write_bytes)
        yield counter("kv_disk_write_cpu_seconds", "CPU seconds the disk tier's writer thread used.", d.write_cpu_s)
        yield counter("kv_disk_write_drops", "Blocks not written (queue full, reused first, or writes off).",
                      d.write_drops)
        yield counter("kv_disk_evictions", "Files removed from the disk tier to stay under its cap.", d.evictions)
        yield counter("kv_disk_corrupt", "Files dropped as truncated, corrupted or foreign (their tokens "
                      "recomputed).", d.corrupt)

    def _lora(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's lora_requests_info (adapters as comma-separated label values, the value a timestamp),
        and the same per adapter as plain gauges, which are easier to graph."""
        info = GaugeMetricFamily("conveyor:lora_requests_info", "Running and waiting LoRA adapters (as vLLM's).",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(self.max_loras), ",".join(n for n, _ in s.lora_waiting),
                         ",".join(n for n, _ in s.lora_running)], time.time())
        yield info
        for which, pairs in (("running", s.lora_running), ("waiting", s.lora_waiting)):
            g = GaugeMetricFamily(f"conveyor:lora_num_requests_{which}", f"Sequences {which} per LoRA adapter.",
                                  labels=["model_name", "lora_name"])
            for name, n in pairs:
                g.add_metric([self.model_name, name], n)
            yield g


OTHER_TENANT = "other"


class TenantLabels:
    """Bounded label values for tenants: the first `max_tenants` distinct tenants keep their own name, every
    later one is counted under "other". First come rather than re-ranked by volume, because a series must
    never move: a counter that passed from a tenant's series to "other" would read as a reset and a jump."""

    def __init__(self, max_tenants: int = 16) -> None:
        self.max_tenants = max_tenants
        self.named: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        t = tenant_name(tenant)
        if t in self.named:
            return t
        if len(self.named) < self.max_tenants and t != OTHER_TENANT:
            self.named.add(t)
            return t
        return OTHER_TENANT


def config_labels(config: EngineConfig) -> dict[str, str]:
    """Every scalar option of `config` (str, number, bool or unset) as a label value, in declaration
    order; dicts, lists and paths to the model are left out (they are not facts to group series by)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in ("model", "tokenizer") or not (value is None or isinstance(value, (str, int, float, bool))):
            continue
        out[f.name] = "" if value is None else str(value)
    return out


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineStats], info: EngineInfo | None = None,
                 max_tenants: int = 16, config: EngineConfig | None = None) -> None:
        """`info`: what the engine was built with (weight and KV dtypes, KV capacity), shown as gauges.
        `max_tenants`: tenants with series of their own in the per-tenant metrics (the rest: "other").
        `config`: the engine's options, every scalar one a label of `conveyor:engine_config_info`."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.listeners: list = []  # objects with observe_finish / observe_itl (the dashboard), told the same
        self.registry.register(_EngineCollector(snapshot, model_name, info.max_loras if info is not None else 0))
        labels = ["model_name"]
        self.model_name = model_name
        if info is not None:  # as vLLM's cache_config_info: the labels carry the facts, the value is 1
            Gauge("conveyor:model_config_info", "How the model and its KV cache are stored.",
                  labels + ["weight_dtype", "kv_cache_dtype", "block_size"], registry=self.registry).labels(
                model_name, info.weight_dtype, info.kv_cache_dtype, str(info.block_size)).set(1)
            Gauge("conveyor:kv_cache_capacity_tokens", "Tokens the KV pool holds when full.", labels,
                  registry=self.registry).labels(model_name).set(info.kv_cache_tokens)
        if config is not None:  # generated from EngineConfig's declaration: a new option shows up by itself
            facts = config_labels(config)
            Gauge("conveyor:engine_config_info", "The engine's options as started (one label each; value 1).",
                  labels + list(facts), registry=self.registry).labels(model_name, *facts.values()).set(1)
        self.request_success = Counter("conveyor:request_success", "Finished sequences by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("conveyor:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("conveyor:inter_token_latency_seconds", "Time between a sequence's tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("conveyor:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("conveyor:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=self.registry)
        # tool calling and embeddings (conveyor/server/tools.py, embeddings.py)
        self.tool_call_responses = Counter("conveyor:tool_call_responses", "Chat choices answered with tool calls, "
                                           "by tool_choice (auto, required, named).", labels + ["tool_choice"],
                                           registry=self.registry)
        self.tool_calls = Counter("conveyor:tool_calls", "Tool calls returned, by tool_choice.",
                                  labels + ["tool_choice"], registry=self.registry)
        self.embedding_requests = Counter("conveyor:embedding_requests", "/v1/embeddings requests answered.",
                                          labels, registry=self.registry)
        self.embedding_inputs = Counter("conveyor:embedding_inputs", "Inputs embedded (a request may hold many).",
                                        labels, registry=self.registry)
        self.embedding_prompt_tokens = Counter("conveyor:embedding_prompt_tokens", "Tokens of embedded inputs.",
                                               labels, registry=self.registry)
        # per tenant (bounded: `TenantLabels`): service received, and how long it waited for it
        self.tenant_label = TenantLabels(max_tenants)
        tl = labels + ["tenant"]
        self.tenant_prompt_tokens = Counter("conveyor:tenant_prompt_tokens", "Prompt tokens of finished requests, "
                                            "per tenant.", tl, registry=self.registry)
        self.tenant_generation_tokens = Counter("conveyor:tenant_generation_tokens", "Tokens generated, per tenant.",
                                                tl, registry=self.registry)
        self.tenant_ttft = Histogram("conveyor:tenant_time_to_first_token_seconds", "Arrival to first token, per "
                                     "tenant.", tl, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tenant_queue_time = Histogram("conveyor:tenant_request_queue_time_seconds", "Arrival to first "
                                           "scheduled, per tenant.", tl, buckets=_LATENCY_BUCKETS,
                                           registry=self.registry)
        self.lora_requests = Counter("conveyor:lora_requests", "Requests received per LoRA adapter.",
                                     labels + ["lora_name"], registry=self.registry)
        # supervision (server/async_engine.py): the engine died and a new one was started
        self.engine_restarts = Counter("conveyor:engine_restarts", "New engines started after the engine died, by "
                                       "cause: the signal that killed the engine process (SIGKILL, SIGSEGV...), "
                                       "exit (it exited by itself), exception (a step raised), start_failed (the "
                                       "previous new engine did not start).", labels + ["cause"],
                                       registry=self.registry)
        self.engine_restart_requests = Counter("conveyor:engine_restart_requests", "Requests open when the engine "
                                               "died: failed (they were running: 500 engine_restarted) or requeued "
                                               "(not started yet: sent to the new engine).", labels + ["outcome"],
                                               registry=self.registry)
        # Pre-create the common label sets so they show up (as 0) before the first request.
        for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
            self.request_success.labels(model_name, reason)
        for mode in ("auto", "required", "named"):
            self.tool_call_responses.labels(model_name, mode)
            self.tool_calls.labels(model_name, mode)
        for c in (self.embedding_requests, self.embedding_inputs, self.embedding_prompt_tokens):
            c.labels(model_name)
        for outcome in ("failed", "requeued"):
            self.engine_restart_requests.labels(model_name, outcome)

    def observe_restart(self, cause: str, failed: int, requeued: int) -> None:
        """A new engine is being started after the engine died of `cause`; `failed` requests were lost with
        it, `requeued` will run on the new one."""
        self.engine_restarts.labels(self.model_name, cause).inc()
        self.engine_restart_requests.labels(self.model_name, "failed").inc(failed)
        self.engine_restart_requests.labels(self.model_name, "requeued").inc(requeued)

    def observe_tool_calls(self, mode: str, num_calls: int) -> None:
        """One chat choice answered with `num_calls` tool calls."""
        self.tool_call_responses.labels(self.model_name, mode).inc()
        self.tool_calls.labels(self.model_name, mode).inc(num_calls)

    def observe_embeddings(self, num_inputs: int, num_tokens: int) -> None:
        """One /v1/embeddings request answered."""
        self.embedding_requests.labels(self.model_name).inc()
        self.embedding_inputs.labels(self.model_name).inc(num_inputs)
        self.embedding_prompt_tokens.labels(self.model_name).inc(num_tokens)

    def observe_finish(self, reason: str, ttft: float | None, e2e: float | None, queue: float | None) -> None:
        for listener in self.listeners:
            try:
                listener.observe_finish(reason, ttft, e2e, queue)
            except Exception:  # a viewer's bookkeeping must never break a request's
                pass
        self.request_success.labels(self.model_name, reason).inc()
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)
        if e2e is not None:
            self.e2e.labels(self.model_name).observe(e2e)
        if queue is not None:
            self.queue_time.labels(self.model_name).observe(queue)

    def observe_tenant_tokens(self, tenant: str | None, n: int) -> None:
        self.tenant_generation_tokens.labels(self.model_name, self.tenant_label(tenant)).inc(n)

    def observe_tenant_finish(self, tenant: str | None, prompt_tokens: int, ttft: float | None,
                              queue: float | None) -> None:
        label = self.tenant_label(tenant)
        self.tenant_prompt_tokens.labels(self.model_name, label).inc(prompt_tokens)
        if ttft is not None:
            self.tenant_ttft.labels(self.model_name, label).observe(ttft)
        if queue is not None:
            self.tenant_queue_time.labels(self.model_name, label).observe(queue)

    def observe_itl(self, seconds: float) -> None:
        for listener in self.listeners:
            try:
                listener.observe_itl(seconds)
            except Exception:
                pass
        self.itl.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
