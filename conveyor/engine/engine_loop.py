"""The one loop that drives an `LLMEngine`: typed commands in, typed outputs out.

The server (`AsyncEngine`) and the lab (`EngineBackend`) both talk to the engine only through this
loop, wherever it runs:
- `ThreadEngineClient`: the loop in a thread of this process (the thread that loaded the model:
  OpenMP keeps one team of workers per thread that runs parallel regions, and a second team on
  the same cores made every step ~35% slower);
- `ProcessEngineClient`: the loop in its own process, commands and outputs pickled over a pipe, as
  vLLM runs its engine core: the HTTP side's Python (JSON, SSE, tokenization) no longer shares a
  GIL with the engine's.

Commands: `AddRequest`, `AbortRequest`, `EndInput`, `SnapshotKV`, `SetScheduler`, `UnloadLoRA`, `Stop`.
After each step (and after commands that change the engine while it is idle) the loop emits one `LoopOutput`:
the step's deltas and stats, a snapshot of the engine's counters, and any failed adds. If a step raises, the loop emits
a last output carrying the error and ends: the engine is dead, and the client says so.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import EngineInfo, EngineSnapshot, KVMap, LLMEngine, StepStats
from conveyor.lora.request import LoRARequest
from conveyor.outputs import StepDelta
from conveyor.pooling import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.policies import policy_options

log = logging.getLogger("conveyor.engine")

IDLE_POLL_S = 0.001  # a step scheduled nothing (a batcher holds a partial batch): wait this long for news


# --- messages -------------------------------------------------------------------------------------
@dataclass
class AddRequest:
    """One engine request, the same record from the HTTP layer (`AsyncEngine.submit`) or the lab to the
    engine loop: a prompt's token ids and how to sample `params.n` continuations of it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    pooling: PoolingParams | None = None  # an embedding request: pooled, not sampled (conveyor/pooling.py)
    tenant: str | None = None  # who it is served for (None: the default tenant)
    slo_ttft_s: float | None = None  # latency targets (None: the engine's defaults, if any)
    slo_tpot_s: float | None = None
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names (None: the base model)
    # time.monotonic() (the same clock in every process on Linux); None: when the engine takes it in
    arrival_time: float | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class UnloadLoRA:
    """Unload a LoRA adapter (requests still running under it finish first)."""

    lora_int_id: int


@dataclass
class EndInput:
    """No more requests are coming (offline-style runs): a static batcher may run its partial batch."""


@dataclass
class SnapshotKV:
    """Attach a `KVMap` of the pool to the next output (the dashboard asks a few times a second)."""

    max_cells: int = 4096


@dataclass
class SetScheduler:
    """Switch the batching strategy between steps (`LLMEngine.set_scheduler`); the outcome comes back in
    the next output's `switched`, tagged with `token`."""

    name: str
    options: dict = field(default_factory=dict)
    token: int = 0


@dataclass(frozen=True)
class SchedulerSwitch:
    token: int
    name: str
    options: dict  # the new strategy's options, with their values
    error: str | None = None  # refused: nothing changed


@dataclass
class Stop:
    """Abort what is left (each sequence gets a final "abort" delta) and end the loop."""


Command = AddRequest | AbortRequest | EndInput | SnapshotKV | SetScheduler | Stop | UnloadLoRA


@dataclass(frozen=True)
class FailedAdd:
    """An `AddRequest` the engine refused (validated by the caller first, so a bug or a race)."""

    request_id: str
    message: str  # "TypeName: message"


@dataclass
class LoopOutput:
    deltas: list[StepDelta]
    stats: StepStats | None  # the step's, if one ran
    snapshot: EngineSnapshot
    time: float  # time.monotonic() when the step returned: when its tokens exist
    failed: list[FailedAdd] = field(default_factory=list)  # adds refused
    added: int = 0  # sequences whose add command the engine took in (counted for queue limits)
    error: str | None = None  # the engine died with this; nothing more will come
    final: bool = False  # the loop has ended
    kv_map: KVMap | None = None  # when a `SnapshotKV` asked for one
    switched: list[SchedulerSwitch] = field(default_factory=list)  # `SetScheduler` commands handled


@dataclass(frozen=True)
class EngineReady:
    """The engine process's first message: the engine is built, and this is what it was built with."""

    info: EngineInfo


@dataclass(frozen=True)
class EngineFailed:
    """The engine process's first message when building the engine raised: why ("TypeName: message")."""

    message: str


class LoopState(StrEnum):
    """What one `EngineLoop.tick()` did."""

    RAN = "ran"  # a step ran
    HELD = "held"  # there is work, but the policy scheduled nothing (a batcher holds a partial batch)
    IDLE = "idle"  # no work
    STOPPED = "stopped"  # a `Stop` came: the loop has ended


# --- the loop -------------------------------------------------------------------------------------
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
        if isinstance(cmd, AddRequest):
            out.added += cmd.params.n
            try:
                e.add_request(cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id, priority=cmd.priority,
                              arrival_time=cmd.arrival_time, cache_salt=cmd.cache_salt, pooling=cmd.pooling,
                              tenant=cmd.tenant, slo_ttft_s=cmd.slo_ttft_s, slo_tpot_s=cmd.slo_tpot_s,
                              lora_request=cmd.lora_request)
            except Exception as exc:  # validated by the caller, so a bug or a race: keep the engine alive
                out.failed.append(FailedAdd(cmd.request_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(cmd, AbortRequest):
            out.deltas.extend(e.abort_request(cmd.request_id))
        elif isinstance(cmd, EndInput):
            e.end_input()
        elif isinstance(cmd, UnloadLoRA):
            e.remove_lora(cmd.lora_int_id)
        elif isinstance(cmd, SnapshotKV):
            out.kv_map = e.kv_map(cmd.max_cells)
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
        """Report the engine dead (a step raised): a last output carrying the error."""
        log.error("engine step failed; the engine is dead", exc_info=exc)
        try:
            snap = self.engine.snapshot()
        except Exception:
            snap = None
        self.emit(LoopOutput([], None, snap, time.monotonic(), error=repr(exc), final=True))

    def run(self) -> None:
        try:
            while self.tick() is not LoopState.STOPPED:
                pass
        except BaseException as exc:  # noqa: BLE001 - anything that escapes a step kills the engine
            self.fail(exc)


# --- clients: where the loop runs ---------------------------------------------------------------------
class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); nothing more will be generated."""


class EngineClient:
    """The caller's handle on a running loop: `send` commands; outputs arrive at `on_output`, called
    on the loop's thread (thread client) or on a reader thread (process client)."""

    info: EngineInfo
    tokenizer: object

    def __init__(self) -> None:
        self.on_output: Callable[[LoopOutput], None] = lambda out: None
        self.error: str | None = None
        self.ended = False

    def send(self, cmd: Command) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _deliver(self, out: LoopOutput) -> None:
        if out.error is not None:
            self.error = out.error
        if out.final:
            self.ended = True
        self.on_output(out)

    def join(self, timeout: float | None = None) -> None:
        raise NotImplementedError


class ThreadEngineClient(EngineClient):
    """The loop in a thread of this process. `build` runs in that thread too (see the module doc).

    `start()` starts the thread; `start(on_this_thread=True)` instead runs the loop on the calling
    thread until `Stop` (the lab: the thread that loaded the model keeps the compute)."""

    def __init__(self, build: Callable[[], LLMEngine] | LLMEngine) -> None:
        super().__init__()
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._build = build
        self.engine: LLMEngine | None = build if isinstance(build, LLMEngine) else None
        self._built = threading.Event()
        self._go = threading.Event()
        self._build_error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.built_on: int | None = None  # ident of the thread that built the engine (None: built elsewhere)
        self.stepped_on: int | None = None  # ident of the thread the loop runs on
        if self.engine is None:  # build in the thread that will step it, then wait for start()
            self.thread = threading.Thread(target=self._main, name="conveyor-engine", daemon=True)
            self.thread.start()
            self._built.wait()
            if self._build_error is not None:
                raise self._build_error
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer

    def _get(self, timeout: float | None) -> Command | None:
        try:
            return self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _loop(self) -> None:
        self.stepped_on = threading.get_ident()
        try:
            EngineLoop(self.engine, self._get, self._deliver).run()
            if self.built_on is not None:  # an engine this client built ends with its loop (a server that stops)
                self.engine.close()
        finally:
            self.ended = True

    def _main(self) -> None:
        try:
            self.built_on = threading.get_ident()
            self.engine = self._build()
        except BaseException as e:  # noqa: BLE001 - re-raised by the constructor
            self._build_error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        self._loop()

    def start(self, on_this_thread: bool = False) -> None:
        if on_this_thread:
            self._go.set()
            self._loop()
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
            self.thread.start()
        else:
            self._go.set()

    def send(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    @property
    def alive(self) -> bool:
        return self.error is None and not self.ended and (self.thread is None or self.thread.is_alive())

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self._go.set()
            self.thread.join(timeout)


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` writes every thread's Python stack to stderr (the log): how to see where a server
    or its engine process is stuck without stopping it."""
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)


def freeze_startup_heap() -> int:
    """Move every object alive now (the model's modules, torch, FastAPI, the tokenizer: everything a
    server builds at startup and keeps) out of the garbage collector's sight; returns how many.

    Why: a full (generation 2) collection walks every tracked object, and a loaded server holds a
    few hundred thousand; each one stopped every thread for 56-100 ms, measured from `gc.callbacks`
    in a serving process, and those pauses were the quiet tenant's worst TTFTs beside a noisy one
    (docs/fairness.md). Objects made afterwards (requests, steps) are collected as before; what is
    frozen is never freed by the collector (only by reference counting), so this is for a process
    that serves until it exits (`conveyor serve`, the engine process), not for a library caller."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _process_main(config: EngineConfig, conn, log_level: int) -> None:
    """The engine process: build, say `EngineReady` with the engine's info (or `EngineFailed`), then run
    the loop on the pipe."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    dump_stacks_on_sigusr1()
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    conn.send(EngineReady(engine.info))
    freeze_startup_heap()
    lock = threading.Lock()

    def get(timeout: float | None) -> Command | None:
        if timeout is None or conn.poll(timeout):
            try:
                return conn.recv()
            except EOFError:  # the parent is gone: stop
                return Stop()
        return None

    def emit(out: LoopOutput) -> None:
        with lock:
            try:
                conn.send(out)
            except (BrokenPipeError, OSError):
                pass

    EngineLoop(engine, get, emit).run()
    engine.close()  # the disk tier's last writes (multiprocessing ends a child without atexit handlers)


class ProcessEngineClient(EngineClient):
    """The loop in a child process (spawned: a clean interpreter and its own OpenMP team).

    The tokenizer is loaded here as well, for the HTTP side. A reader thread turns the child's
    outputs into `on_output` calls; if the child dies without a final output (killed, crashed
    hard), the reader reports it as an engine error. `terminate()` sends SIGTERM to the child."""

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._send_lock = threading.Lock()
        self.process = ctx.Process(target=_process_main, args=(config, child, logging.getLogger().level),
                                   name="conveyor-engine", daemon=True)
        self.process.start()
        child.close()
        from conveyor.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        if not self._conn.poll(ready_timeout_s):
            self.terminate()
            raise RuntimeError(f"the engine process did not start within {ready_timeout_s:.0f}s")
        try:
            hello: EngineReady | EngineFailed = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while loading") from None
        if isinstance(hello, EngineFailed):
            self.process.join(5)
            raise ValueError(hello.message)
        self.info = hello.info
        self._reader = threading.Thread(target=self._read, name="conveyor-engine-reader", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                out = self._conn.recv()
            except (EOFError, OSError):
                break
            self._deliver(out)
            if out.final:
                return
        if not self.ended:  # the process went away without a word
            self.process.join(1)
            code = self.process.exitcode
            self._deliver(LoopOutput([], None, None, time.monotonic(),
                                     error=f"the engine process exited (code {code})", final=True))

    def send(self, cmd: Command) -> None:
        with self._send_lock:
            try:
                self._conn.send(cmd)
            except (BrokenPipeError, OSError):
                pass

    @property
    def alive(self) -> bool:
        return self.error is None and not self.ended and self.process.is_alive()

    def terminate(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGTERM)

    def join(self, timeout: float | None = None) -> None:
        if self._reader.is_alive():
            self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class InlineEngineClient(EngineClient):
    """The loop run as a task on the asyncio event loop itself: every step stalls every socket. The
    naive design, kept only so that it can be measured against the others (`--engine-loop inline`)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self._inbox: deque[Command] = deque()
        self._wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._main())

    def _get(self, timeout: float | None) -> Command | None:
        return self._inbox.popleft() if self._inbox else None

    async def _main(self) -> None:
        loop = EngineLoop(self.engine, self._get, self._deliver)
        try:
            while True:
                state = loop.tick(wait=False)
                if state is LoopState.STOPPED:
                    return
                if state is LoopState.RAN:
                    await asyncio.sleep(0)  # let the HTTP side run between steps
                    continue
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S if state is LoopState.HELD else 1.0)
                except asyncio.TimeoutError:
                    pass
        except Exception as exc:
            loop.fail(exc)
        finally:
            self.ended = True

    def send(self, cmd: Command) -> None:
        self._inbox.append(cmd)
        if self._wake is not None:
            self._wake.set()

    @property
    def alive(self) -> bool:
        return self.error is None and not self.ended and self.task is not None and not self.task.done()

    def join(self, timeout: float | None = None) -> None:
        """Nothing to join: `AsyncEngine.stop` awaits `task`."""
