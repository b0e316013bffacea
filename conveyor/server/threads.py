"""Blocking work the event loop awaits without the loop's executor."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str) -> asyncio.Future:
    """`fn(*args)` in a daemon thread of its own, awaitable from the running loop.

    Not the loop's executor: `asyncio.run` joins the executor's threads on exit, so a server told to exit
    while an engine is being built (at start or after a crash) would wait for the build to end. A daemon
    thread dies with the process; its result is dropped if the loop has closed meanwhile."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server has exited
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
