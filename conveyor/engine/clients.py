"""Where the engine loop runs, and the caller's handle on it (`EngineClient`: `send` commands, `on_output`).

- `ThreadEngineClient`: the loop in a thread of this process (the thread that loaded the model:
  OpenMP keeps one team of workers per thread that runs parallel regions, and a second team on
  the same cores made every step ~35% slower);
- `ProcessEngineClient`: the loop in its own process, commands and outputs pickled over a pipe, as
  vLLM runs its engine core: the HTTP side's Python (JSON, SSE, tokenization) no longer shares a
  GIL with the engine's. Engine processes are forked from a forkserver that has imported what an
  engine build imports (`preload.py`), so a restarted engine skips the interpreter's start;
- `InlineEngineClient`: the loop as a task on the asyncio event loop (the naive design, kept to be measured).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

from conveyor import startup
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import EngineInfo, LLMEngine
from conveyor.engine.loop import IDLE_POLL_S, EngineLoop, LoopState
from conveyor.engine.messages import Command, EngineFailed, EnginePhase, EngineReady, LoopOutput, Stop
from conveyor.startup import dump_stacks_on_sigusr1, freeze_startup_heap

log = logging.getLogger("conveyor.engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); nothing more will be generated."""


class EngineClient:
    """The caller's handle on a running loop: `send` commands; outputs arrive at `on_output`, called
    on the loop's thread (thread client) or on a reader thread (process client)."""

    info: EngineInfo
    tokenizer: object
    in_process = False  # the engine lives in this process (its memory is ours to free when it ends)

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

    def release(self) -> None:
        """Drop what this handle holds of an engine that has ended (its model and KV pool, its pipe), so
        that a new engine can take the memory."""
        self.on_output = lambda out: None


class ThreadEngineClient(EngineClient):
    """The loop in a thread of this process. `build` runs in that thread too (see the module doc).

    `start()` starts the thread; `start(on_this_thread=True)` instead runs the loop on the calling
    thread until `Stop` (the lab: the thread that loaded the model keeps the compute)."""

    in_process = True

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
        finally:
            if self.built_on is not None and self.engine is not None:
                # an engine this client built ends with its loop (a server that stops, or one whose engine
                # failed and is rebuilt): the disk tier writes what it queued and lets its directory go
                try:
                    self.engine.close()
                except Exception:  # noqa: BLE001 - closing must not hide why the loop ended
                    log.exception("closing the engine failed")
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

    def release(self) -> None:
        super().release()
        self.engine = None
        self._build = None


def describe_exit(code: int | None) -> tuple[str, str]:
    """An engine process's exit code (negative: the signal that killed it) as (cause, words): the cause is
    a short label ("SIGKILL", "SIGSEGV", "exit"), the words go into the error clients see."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return name, f"was killed by {name}"
    return "exit", f"exited with code {code}"


def process_context() -> mp.context.BaseContext:
    """Where engine processes come from: a forkserver that has imported torch, transformers and the
    engine (`conveyor/engine/preload.py`), where the platform has one; else a spawned interpreter.

    Why: a spawned engine process spends most of its start importing (torch, then transformers and
    torch._dynamo lazily inside the first build: 4-10 s on 2 busy cores, against ~0.5 s for a second
    build of the tiny test model in one process). A restart after the engine process died should cost
    the model's load, not the interpreter's. The forkserver is a clean single-threaded process that
    only imported modules (no OpenMP team, no tokenizer threads yet), so forking from it is safe; each
    engine process is a fresh fork of it, sharing nothing with the one that died."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["conveyor.engine.preload"])
        return ctx
    return mp.get_context("spawn")


def _process_main(config: EngineConfig, conn, log_level: int) -> None:
    """The engine process: build, say `EngineReady` with the engine's info (or `EngineFailed`), then run
    the loop on the pipe. While it builds, each startup phase goes to the parent (`EnginePhase`)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    dump_stacks_on_sigusr1()

    def tell(ph: startup.Phase) -> None:
        conn.send(EnginePhase(ph.name, ph.detail))

    startup.progress.listeners.append(tell)
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    finally:
        startup.progress.listeners.remove(tell)
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


class ProcessWatch:
    """Whether a child process has ended, and its exit code, safe to ask from several threads.

    Why not `Process.is_alive()` from any thread: a forkserver child's exit code is 8 bytes the forkserver
    writes once on the process's sentinel pipe, and `is_alive()` / `join()` / `exitcode` read them. Two threads
    reading at once leave one at end of file, which multiprocessing records as exit code 255: a SIGKILL reported
    as "exited with code 255" (1 kill in 5 with a thread polling; `tests/engine/test_clients.py`). So `ended`
    only looks (at the code once read, else at the sentinel: readable once the process is gone, but for a moment
    not, between the code's read and the forkserver closing the pipe) and one lock owns reading the code."""

    def __init__(self, process: mp.process.BaseProcess) -> None:
        self.process = process
        self._lock = threading.Lock()
        self._code: int | None = None

    def ended(self) -> bool:
        """Whether the process has ended; reads nothing."""
        return self._code is not None or bool(mp.connection.wait([self.process.sentinel], 0))

    def exit_code(self, timeout: float | None) -> int | None:
        """Wait up to `timeout` for the process to end; its exit code (negative: the signal), None if it runs."""
        with self._lock:
            if self._code is None:
                self.process.join(timeout)
                self._code = self.process.exitcode
            return self._code


class ProcessEngineClient(EngineClient):
    """The loop in a child process (`process_context`: forked from a clean forkserver, or spawned; either
    way its own interpreter state and its own OpenMP team).

    The tokenizer is loaded here as well, for the HTTP side (or handed in: a restart reuses the first
    one). The phases the child reports while it loads are set on this process's `startup.progress`. A
    reader thread turns the child's outputs into `on_output` calls; if the child dies without a final
    output (killed, crashed hard), the reader reports it as an engine error naming the exit code or
    signal. `terminate()` sends SIGTERM to the child. The process is watched through `ProcessWatch`: `/health`
    asks `alive` on the event loop while the reader thread asks why the process died."""

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0, tokenizer: object | None = None) -> None:
        super().__init__()
        ctx = process_context()
        self._conn, child = ctx.Pipe(duplex=True)
        self._send_lock = threading.Lock()
        self.process = ctx.Process(target=_process_main, args=(config, child, logging.getLogger().level),
                                   name="conveyor-engine", daemon=True)
        self.process.start()
        self.watch = ProcessWatch(self.process)
        child.close()
        if tokenizer is None:
            from conveyor.model.loader import load_tokenizer

            tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.tokenizer = tokenizer
        deadline = time.monotonic() + ready_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                self.terminate()
                raise RuntimeError(f"the engine process did not start within {ready_timeout_s:.0f}s")
            try:
                hello: EngineReady | EngineFailed | EnginePhase = self._conn.recv()
            except EOFError:
                raise RuntimeError(f"the engine process {describe_exit(self.watch.exit_code(5))[1]} while loading"
                                   ) from None
            if not isinstance(hello, EnginePhase):
                break
            startup.phase(hello.name, hello.detail)
        if isinstance(hello, EngineFailed):
            self.watch.exit_code(5)
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
            if not isinstance(out, LoopOutput):
                continue
            self._deliver(out)
            if out.final:
                return
        if not self.ended:  # the process went away without a word
            cause, words = describe_exit(self.watch.exit_code(5))
            self._deliver(LoopOutput([], None, None, time.monotonic(), error=f"the engine process {words}",
                                     cause=cause, final=True))

    def send(self, cmd: Command) -> None:
        with self._send_lock:
            try:
                self._conn.send(cmd)
            except (BrokenPipeError, OSError):
                pass

    @property
    def alive(self) -> bool:
        return self.error is None and not self.ended and not self.watch.ended()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def terminate(self) -> None:
        if not self.watch.ended():
            os.kill(self.process.pid, signal.SIGTERM)

    def join(self, timeout: float | None = None) -> None:
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        if self.watch.exit_code(timeout) is None:
            self.process.kill()
            self.watch.exit_code(5)

    def release(self) -> None:
        super().release()
        self._conn.close()


class InlineEngineClient(EngineClient):
    """The loop run as a task on the asyncio event loop itself: every step stalls every socket. The
    naive design, kept only so that it can be measured against the others (`--engine-loop inline`)."""

    in_process = True

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
