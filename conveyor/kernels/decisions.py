"""Choices measured once per machine kind and remembered: which of two kernels runs a hot path.

A choice made by timing two kernels at every start flips when one start happens to run beside a busy
process (seen: oneDNN "1 row 3607 vs 77 us" at one start of a server, ours "12 vs 27 us" at the next),
and one noisy moment then decides the whole run's speed. So a choice is measured once for a key that
names what it depends on (the CPU model and its instruction-set flags, torch's version, the kernels'
build), written to `~/.cache/conveyor/decisions.json` (or `$CONVEYOR_CACHE`), and every later start on
the same kind of machine reads it back. `CONVEYOR_REMEASURE=1` measures again and replaces it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from conveyor.kernels.variants import cpu_info

log = logging.getLogger("conveyor.kernels")

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_int8")


def cpu_facts() -> dict[str, object]:
    """The CPU's model name and the instruction-set flags that decide which kernels run fast here."""
    info = cpu_info()
    return {"model": info.model, "flags": sorted(f for f in FLAGS_OF_INTEREST if f in info.flags)}


def _path() -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor")
    return Path(root) / "decisions.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def decide(name: str, key: dict, measure: Callable[[], tuple[str, dict]]) -> str:
    """The remembered choice `name` for `key` (plus this CPU's facts), or `measure()`'s, which is then
    remembered. `measure` returns (choice, what it measured), the latter kept for the log and the file."""
    full_key = {"cpu": cpu_facts(), **key}
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:16]
    path = _path()
    try:
        with _locked(path):  # one measurement at a time: two processes starting at once must agree
            table = json.loads(path.read_text()) if path.exists() else {}
            entry = table.get(name, {}).get(digest)
            if entry is not None and os.environ.get("CONVEYOR_REMEASURE", "0") != "1":
                log.info("%s: %s (measured on this kind of machine at %s: %s; CONVEYOR_REMEASURE=1 measures again)",
                         name, entry["choice"], entry.get("when", "?"), entry.get("measured"))
                return entry["choice"]
            choice, measured = measure()
            import time

            table.setdefault(name, {})[digest] = {"choice": choice, "measured": measured, "key": full_key,
                                                  "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
            return choice
    except (OSError, ValueError) as e:  # an unwritable or corrupt cache: measure, remember nothing
        log.warning("%s: the decision cache %s is unusable (%s); measuring", name, path, e)
        return measure()[0]
