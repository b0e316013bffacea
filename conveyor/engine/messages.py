"""The engine loop's typed messages: commands in, outputs out (`loop.py` runs them, `clients.py` carries them).

Commands: `EngineRequest` (`conveyor/request.py`: the one request record, added as it is), `AbortRequest`,
`EndInput`, `SnapshotKV`, `SetScheduler`, `UnloadLoRA`, `Stop`.
After each step (and after commands that change the engine while it is idle) the loop emits one `LoopOutput`:
the step's deltas and stats, a snapshot of the engine's counters, and any failed adds. An engine process
says `EnginePhase` as it loads, then `EngineReady` (or `EngineFailed`). Every message is a plain record
that pickles: the same ones go to a thread's queue or over a process's pipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.llm_engine import EngineInfo, EngineSnapshot, StepStats
from conveyor.kv_cache.kv_map import KVMap
from conveyor.outputs import StepDelta
from conveyor.request import EngineRequest


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


Command = EngineRequest | AbortRequest | EndInput | SnapshotKV | SetScheduler | Stop | UnloadLoRA


@dataclass(frozen=True)
class FailedAdd:
    """An `EngineRequest` the engine refused (validated by the caller first, so a bug or a race)."""

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
    added_batch: int = 0  # ... of which batch-tier sequences (outside the interactive queue limits)
    error: str | None = None  # the engine died with this; nothing more will come
    # with `error`: what killed it, in a few fixed words fit for a metric label: "exception" (a step raised),
    # a signal's name ("SIGKILL", "SIGSEGV": the engine process was killed) or "exit" (it exited by itself)
    cause: str | None = None
    # with `error`: the groups the failed step was running, where the loop could still tell (in-process);
    # a request that was only scheduled into the fatal step is otherwise indistinguishable from a waiting one
    started: list[str] = field(default_factory=list)
    final: bool = False  # the loop has ended
    kv_map: KVMap | None = None  # when a `SnapshotKV` asked for one
    switched: list[SchedulerSwitch] = field(default_factory=list)  # `SetScheduler` commands handled


@dataclass(frozen=True)
class EnginePhase:
    """A loading engine process entered a startup phase (`conveyor/startup.py`): the server's `/health` shows
    it, as it does for an engine loading in its own process."""

    name: str
    detail: str = ""


@dataclass(frozen=True)
class EngineReady:
    """The engine process's first message: the engine is built, and this is what it was built with."""

    info: EngineInfo


@dataclass(frozen=True)
class EngineFailed:
    """The engine process's first message when building the engine raised: why ("TypeName: message")."""

    message: str
