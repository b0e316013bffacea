"""The one loop that drives an `LLMEngine`: typed commands in (`messages.py`), typed outputs out.

The server (`AsyncEngine`) and the lab (`EngineBackend`) both talk to the engine only through this
loop, wherever it runs (`clients.py`: a thread, a process, or the event loop itself). If a step
raises, the loop emits a last output carrying the error (and the groups it was running) and ends: the
engine is dead, and the client says so; the server then starts a new one (`server/async_engine.py`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from enum import StrEnum

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.messages import (
    AbortRequest,
    Command,
    EndInput,
    FailedAdd,
    LoopOutput,
    SchedulerSwitch,
    SetScheduler,
    SnapshotKV,
    Stop,
    UnloadLoRA,
)
from conveyor.kv_cache.kv_map import kv_map
from conveyor.request import EngineRequest, Tier
from conveyor.scheduler.policies import policy_options

log = logging.getLogger("conveyor.engine")

IDLE_POLL_S = 0.001  # a step scheduled nothing (a batcher holds a partial batch): wait this long for news


class LoopState(StrEnum):
    """What one `EngineLoop.tick()` did."""

    RAN = "ran"  # a step ran
    HELD = "held"  # there is work, but the policy scheduled nothing (a batcher holds a partial batch)
    IDLE = "idle"  # no work
    STOPPED = "stopped"  # a `Stop` came: the loop has ended


class EngineLoop:
    """Runs `engine` until told to stop. `get(timeout)` returns the next command or None after
    `timeout` seconds (None: wait forever); `emit` receives every `LoopOutput`."""

    def __init__(self, engine: LLMEngine, get: Callable[[float | None], Command | None],
                 emit: Callable[[LoopOutput], None]) -> None:
        self.engine = engine
        self.get = get
        self.emit = emit
        self._nap = False  # the last step scheduled nothing: wait a little for news before the next

    def _handle(self, cmd: Command, out: LoopOutput) -> bool:
        """Apply one command; False when it is `Stop`."""
        e = self.engine
        if isinstance(cmd, EngineRequest):
            out.added += cmd.num_sequences
            if cmd.tier is Tier.BATCH:
                out.added_batch += cmd.num_sequences
            try:
                e.add_request(cmd)
            except Exception as exc:  # validated by the caller, so a bug or a race: keep the engine alive
                out.failed.append(FailedAdd(cmd.request_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(cmd, AbortRequest):
            out.deltas.extend(e.abort_request(cmd.request_id))
        elif isinstance(cmd, EndInput):
            e.end_input()
        elif isinstance(cmd, UnloadLoRA):
            e.remove_lora(cmd.lora_int_id)
        elif isinstance(cmd, SnapshotKV):
            out.kv_map = kv_map(e.kv.pool, cmd.max_cells)
        elif isinstance(cmd, SetScheduler):
            try:
                cfg = e.set_scheduler(cmd.name, cmd.options)
                out.switched.append(SchedulerSwitch(cmd.token, cmd.name, policy_options(cfg)))
            except Exception as exc:  # a bad name or option: refused, the engine carries on unchanged
                out.switched.append(SchedulerSwitch(cmd.token, cmd.name, {}, f"{type(exc).__name__}: {exc}"))
        elif isinstance(cmd, Stop):
            out.deltas.extend(e.abort_all())
            return False
        return True

    def _drain(self, out: LoopOutput, timeout: float | None) -> tuple[bool, int]:
        """Handle every queued command, waiting up to `timeout` for the first: (not stopped, handled)."""
        handled = 0
        cmd = self.get(timeout)
        while cmd is not None:
            handled += 1
            if not self._handle(cmd, out):
                return False, handled
            cmd = self.get(0)
        return True, handled

    def _send(self, out: LoopOutput) -> None:
        out.snapshot = self.engine.snapshot()
        out.time = time.monotonic()
        self.emit(out)

    def tick(self, wait: bool = True) -> LoopState:
        """Take commands and run one step if there is work. `wait`: block for commands while idle
        (False: never block)."""
        e = self.engine
        out = LoopOutput([], None, None, 0.0)
        if not wait:
            timeout = 0
        elif self._nap:
            timeout = IDLE_POLL_S
        else:
            timeout = 0 if e.has_unfinished_requests() else None
        self._nap = False
        going, handled = self._drain(out, timeout)
        if not going:
            out.final = True
            self._send(out)
            return LoopState.STOPPED
        if not e.has_unfinished_requests():
            if handled:
                self._send(out)  # commands changed the idle engine (or an add failed): say so
            return LoopState.IDLE
        step = e.step()
        out.deltas.extend(step.deltas)
        out.stats = step.stats
        going, _ = self._drain(out, 0)  # aborts that came during the step free their blocks now
        out.final = not going
        self._send(out)
        if not going:
            return LoopState.STOPPED
        self._nap = step.stats is None
        return LoopState.RAN if step.stats is not None else LoopState.HELD

    def fail(self, exc: BaseException) -> None:
        """Report the engine dead (a step raised): a last output carrying the error and what was running.

        The traceback is logged as text, never as the exception: a log record that kept `exc` (a test's
        log capture does) would keep every frame of the failed step, and with them the engine and its KV
        pool, which the server drops to build a new one."""
        log.error("engine step failed; the engine is dead:\n%s", "".join(traceback.format_exception(exc)).rstrip())
        try:
            snap = self.engine.snapshot()
        except Exception:
            snap = None
        try:
            started = self.engine.running_group_ids()
        except Exception:
            started = []
        self.emit(LoopOutput([], None, snap, time.monotonic(), error=f"{type(exc).__name__}: {exc}",
                             cause="exception", started=started, final=True))

    def run(self) -> None:
        try:
            while self.tick() is not LoopState.STOPPED:
                pass
        except BaseException as exc:  # noqa: BLE001 - anything that escapes a step kills the engine
            self.fail(exc)
