"""The live dashboard's data: the engine's steps, queue and KV pool, streamed to browsers at a bounded rate.

`GET /dashboard` serves one static page (`static/dashboard.html`, no build step, no CDN).
`GET /dashboard/events` is a server-sent-events stream, checked like the API when `--api-key` is
set. The page reads it with `fetch`, so the key travels in a header, not in the URL.

The hub sits on the server's event loop beside `AsyncEngine`, and it only reads what the engine
loop already emits:
- Every `LoopOutput` carries the step's stats and a snapshot of the counters. The hub keeps a
  compact record of each step, but only while someone watches.
- At most `max_rate_hz` times a second, the records gathered since the last send go out as one
  event. Each viewer has a small queue; when it is full the event is dropped for that viewer and
  counted, never queued, so a slow browser costs the engine nothing.
- A few times a second, while someone watches, the hub asks the loop for a `KVMap`, which is
  computed between steps on the engine's side.
- TTFT, ITL and finishes are observed on the HTTP side (`ServerMetrics` listeners). Together
  with the token counters they make one-second buckets for the last minute, kept whether or not
  anyone watches, so a new viewer sees the recent past.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from conveyor.engine.llm_engine import EngineSnapshot
from conveyor.engine.messages import LoopOutput, SnapshotKV

log = logging.getLogger("conveyor.server")

WINDOW_S = 60  # the minute of history the page shows
TENANT_ROWS = 8  # tenant rows an event carries (the page shows them all)


def dashboard_html() -> str:
    return resources.files("conveyor.server").joinpath("static/dashboard.html").read_text()


_BASE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching")


def dashboard_setup(config, info) -> dict:
    """What the page shows as the setup: the strategy, its knobs, the pool (sent once per viewer)."""
    from conveyor.scheduler.policies import POLICIES, policy_options

    knobs = {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
             "block_size": info.block_size, "enable_prefix_caching": config.enable_prefix_caching,
             **policy_options(config)}
    return {"model": info.model_name, "strategy": config.scheduler, "summary": POLICIES[config.scheduler].summary,
            "knobs": knobs,
            "kv_blocks": info.num_kv_blocks, "kv_tokens": info.kv_cache_tokens, "dtype": info.weight_dtype,
            "kv_dtype": info.kv_cache_dtype, **({"max_loras": info.max_loras} if info.max_loras else {})}


def kv_disk_view(d) -> dict:
    """The disk tier's numbers as the page shows them (`DiskTierStats`)."""
    return {"blocks": d.blocks, "bytes": d.bytes, "capacity": d.capacity_bytes, "hits": d.hits, "loads": d.loads,
            "load_ms": round(1e3 * d.load_seconds / d.loads, 3) if d.loads else None, "recomputed": d.recomputed,
            "writes": d.writes, "write_drops": d.write_drops, "evictions": d.evictions, "corrupt": d.corrupt,
            "writing": d.writing}


class _Second:
    """One second of history."""

    __slots__ = ("t", "gen_tokens", "prompt_tokens", "ttft", "itl", "finished", "running", "waiting", "kv_used",
                 "steps")

    def __init__(self, t: int) -> None:
        self.t = t
        self.gen_tokens = 0
        self.prompt_tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.finished = 0
        self.running = 0
        self.waiting = 0
        self.kv_used = 0
        self.steps = 0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class DashboardHub:
    """Fans the engine's per-step view out to dashboard viewers (see the module docstring)."""

    def __init__(self, client: Any, setup: dict, max_rate_hz: float = 20.0, kv_rate_hz: float = 4.0,
                 queue_size: int = 8) -> None:
        self.client = client  # asked for KV maps: `.alive`, `.send(cmd)` (the AsyncEngine: whichever engine runs)
        self.setup = setup  # strategy, knobs, pool size: sent once to each new viewer
        self.period = 1.0 / max_rate_hz
        self.kv_period = 1.0 / kv_rate_hz
        self.queue_size = queue_size
        self.viewers: dict[asyncio.Queue, int] = {}  # queue -> events dropped for it
        self.t0 = time.monotonic()
        self._steps: list[list] = []
        self._ids: OrderedDict[str, int] = OrderedDict()  # request id -> small number (the page's colour)
        self._next_id = 0
        self._snapshot: EngineSnapshot | None = None
        self._kv: dict | None = None
        self._last_gen = self._last_prompt = None
        self._seconds: deque[_Second] = deque(maxlen=WINDOW_S + 1)
        self._task: asyncio.Task | None = None
        self._last_kv_ask = 0.0
        self.sent_events = 0
        self._switches: deque[tuple[float, str]] = deque(maxlen=64)  # (seconds since t0, strategy) of switches
        self._mark: str | None = None  # a switch not yet drawn on a step (the engine was idle)
        self._setup_changed = False
        # other parts of the server with a view to show (the Batch API: its batches' progress), sent once a second
        # under their name: name -> a function returning a JSON-able value (None: nothing to show)
        self.sources: dict[str, Callable[[], object]] = {}

    # --- inputs (all on the event loop) --------------------------------------------------------------
    def _second(self, now: float) -> _Second:
        t = int(now - self.t0)
        if self._seconds and t <= self._seconds[-1].t:  # two clocks feed this (step times, arrivals): never go back
            return self._seconds[-1]
        self._seconds.append(_Second(t))
        return self._seconds[-1]

    def _rid(self, rid: str) -> int:
        n = self._ids.get(rid)
        if n is None:
            n = self._ids[rid] = self._next_id
            self._next_id += 1
            if len(self._ids) > 4096:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(rid)
        return n

    def observe(self, out: LoopOutput) -> None:
        """Every output of the engine loop (cheap when nobody watches: counters only)."""
        s = out.snapshot
        if s is None:
            return
        sec = self._second(out.time)
        if self._last_gen is not None:  # (a restarted engine counts from zero again: never a negative second)
            sec.gen_tokens += max(0, s.generation_tokens - self._last_gen)
            sec.prompt_tokens += max(0, s.prompt_tokens - self._last_prompt)
        self._last_gen, self._last_prompt = s.generation_tokens, s.prompt_tokens
        sec.running, sec.waiting, sec.kv_used = s.running, s.waiting, s.kv_blocks_used
        st = out.stats
        if st is not None and st.num_seqs:
            sec.steps += 1
        self._snapshot = s  # the latest, kept even while nobody watches: a new viewer starts from it
        for sw in out.switched:  # a strategy switch: the setup line changes, the timelines get a mark
            if sw.error is None:
                self._on_switch(sw.name, sw.options, out.time)
        if not self.viewers:
            return
        if st is not None and st.num_seqs:
            prefill = st.request_prefill or [False] * len(st.request_ids)
            tokens = st.request_tokens or [1] * len(st.request_ids)
            record = [
                st.index, round(1000 * (st.start - self.t0), 1), round(1000 * st.duration, 2), st.num_tokens,
                st.num_prefill_tokens, st.num_running, st.num_waiting, st.kv_used_blocks,
                [[self._rid(r), n, int(p)] for r, n, p in zip(st.request_ids, tokens, prefill)],
                [self._rid(r) for r in st.preempted_ids]]
            if self._mark is not None:  # the first step under a new strategy carries its name
                record.append(self._mark)
                self._mark = None
            self._steps.append(record)
        if out.kv_map is not None:
            m = out.kv_map
            self._kv = {"num_blocks": m.num_blocks, "blocks_per_cell": m.blocks_per_cell, "cells": m.cells.hex(),
                        "totals": dict(zip(("free", "cached", "used", "shared"), m.totals))}

    def _on_switch(self, name: str, options: dict, t: float) -> None:
        from conveyor.scheduler.policies import POLICIES

        self.setup = {**self.setup, "strategy": name, "summary": POLICIES[name].summary,
                      "knobs": {k: v for k, v in self.setup.get("knobs", {}).items() if k in _BASE_KNOBS} | options}
        self._switches.append((t - self.t0, name))
        self._mark = name
        self._setup_changed = True

    def observe_finish(self, reason: str, ttft: float | None, e2e: float | None, queue: float | None) -> None:
        sec = self._second(time.monotonic())
        sec.finished += 1
        if ttft is not None:
            sec.ttft.append(ttft)

    def observe_itl(self, seconds: float) -> None:
        self._second(time.monotonic()).itl.append(seconds)

    # --- viewers ------------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=self.queue_size)
        self.viewers[q] = 0
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.viewers.pop(q, None)
        if not self.viewers:
            self._steps.clear()

    def minute(self) -> dict:
        """The last minute, one point per second: throughput, queue, latency percentiles."""
        now = int(time.monotonic() - self.t0)
        secs = [s for s in self._seconds if now - WINDOW_S <= s.t < now]  # whole seconds only
        ttft = [x for s in secs for x in s.ttft]
        itl = [x for s in secs for x in s.itl]
        return {
            "t": [s.t for s in secs], "gen_tok_s": [s.gen_tokens for s in secs],
            "prompt_tok_s": [s.prompt_tokens for s in secs], "running": [s.running for s in secs],
            "waiting": [s.waiting for s in secs], "finished": [s.finished for s in secs],
            "ttft_p50": [_pct(s.ttft, 0.5) for s in secs], "ttft_p99": [_pct(s.ttft, 0.99) for s in secs],
            "itl_p50": [_pct(s.itl, 0.5) for s in secs], "itl_p99": [_pct(s.itl, 0.99) for s in secs],
            "ttft_p50_min": _pct(ttft, 0.5), "ttft_p99_min": _pct(ttft, 0.99),
            "itl_p50_min": _pct(itl, 0.5), "itl_p99_min": _pct(itl, 0.99),
            "switches": [[round(t, 2), name] for t, name in self._switches if now - WINDOW_S <= t],
        }

    def _event(self, with_minute: bool) -> dict:
        ev: dict = {"t": round(1000 * (time.monotonic() - self.t0), 1), "steps": self._steps}
        self._steps = []
        s = self._snapshot
        if s is not None:
            ev["snapshot"] = {"running": s.running, "waiting": s.waiting, "kv_used": s.kv_blocks_used,
                              "kv_total": s.kv_blocks_total, "gen_tokens": s.generation_tokens,
                              "prompt_tokens": s.prompt_tokens, "preemptions": s.preemptions,
                              "prefix_hits": s.prefix_hits, "prefix_queries": s.prefix_queries,
                              # the busiest tenants first (requests now, then tokens): what a fair strategy shares
                              "tenants": [list(row) for row in sorted(s.tenants, key=lambda r: (-r[1] - r[2], -r[3],
                                                                                               r[0]))[:TENANT_ROWS]]}
            if s.batch_running or s.batch_waiting or self.sources.get("batch"):  # the batch tier's seats
                ev["snapshot"]["batch_tier"] = {"running": s.batch_running, "waiting": s.batch_waiting}
            if self.setup.get("max_loras"):  # LoRA: who is in the batch, who waits, what is loaded
                ev["snapshot"]["lora"] = {"running": dict(s.lora_running), "waiting": dict(s.lora_waiting),
                                          "loaded": list(s.lora_loaded)}
            if s.kv_disk is not None:  # the disk tier, shown beside the pool
                ev["snapshot"]["kv_disk"] = kv_disk_view(s.kv_disk)
        if self._kv is not None:
            ev["kv"], self._kv = self._kv, None
        if self._setup_changed:
            ev["setup"], self._setup_changed = self.setup, False
        if with_minute:
            ev["minute"] = self.minute()
            for name, view in self.sources.items():
                try:
                    value = view()
                except Exception:  # a view's failure must not stop the dashboard
                    log.exception("the dashboard's %s view failed", name)
                    value = None
                if value is not None:
                    ev[name] = value
        return ev

    def close(self) -> None:
        """End every viewer's stream (server shutdown: an open page must not hold the exit up)."""
        for q in list(self.viewers):
            while q.full():
                q.get_nowait()
            q.put_nowait(None)

    async def _run(self) -> None:
        try:
            await self._send_loop()
        except Exception:
            log.exception("the dashboard's sender failed; viewers get nothing more until they reconnect")

    async def _send_loop(self) -> None:
        """Send at most `max_rate_hz` events a second while anyone watches; ask for KV maps meanwhile."""
        last_minute = 0.0
        while self.viewers:
            now = time.monotonic()
            if now - self._last_kv_ask >= self.kv_period and self.client.alive:
                self._last_kv_ask = now
                try:
                    self.client.send(SnapshotKV())
                except Exception:  # the engine is gone: the page shows what it last got
                    pass
            with_minute = now - last_minute >= 1.0
            if self._steps or self._kv is not None or with_minute or self._setup_changed:
                if with_minute:
                    last_minute = now
                ev = self._event(with_minute)
                line = f"data: {json.dumps(ev, separators=(',', ':'))}\n\n"  # encoded once for every viewer
                for q in list(self.viewers):
                    if q.full():  # a slow viewer: this event is dropped for it, and counted
                        self.viewers[q] += 1
                        continue
                    dropped = self.viewers[q]
                    if dropped:  # the first event after a loss says how many were lost (in its own copy)
                        self.viewers[q] = 0
                    q.put_nowait(line if not dropped else
                                 f"data: {json.dumps({**ev, 'dropped': dropped}, separators=(',', ':'))}\n\n")
                self.sent_events += 1
            await asyncio.sleep(self.period)

    async def stream(self) -> AsyncIterator[str]:
        """One viewer's SSE stream: the setup first, then events until the viewer leaves or the server stops.
        It subscribes on its first step, so a response cancelled before it started leaves nothing behind."""
        q = self.subscribe()
        try:
            yield f"event: setup\ndata: {json.dumps(self.setup)}\n\n"
            while (line := await q.get()) is not None:
                yield line
        finally:
            self.unsubscribe(q)
