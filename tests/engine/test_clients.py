"""The engine clients' process watching (`conveyor/engine/clients.py`); the clients end to end are in
`tests/server/test_engine_process.py` and `tests/server/test_engine_restart.py`."""

from __future__ import annotations

import os
import signal
import threading
import time

from conveyor.engine.clients import ProcessWatch, describe_exit, process_context


def _poll(watch: ProcessWatch, stop: threading.Event) -> None:
    while not stop.is_set():
        watch.ended()


def test_a_killed_process_reads_as_killed_while_another_thread_polls_it():
    """The reader thread asks why the engine process died while `/health` asks `alive` on the event loop every
    few ms. Reading the exit code from two threads at once (`Process.is_alive()` there) made about 1 kill in 5
    read as "exited with code 255" here, and once in CI a SIGKILL was counted as an exit: `ProcessWatch.ended`
    only looks, and the code is read once, so each of these kills reads as SIGKILL."""
    ctx = process_context()  # the engine's: a forkserver child, whose exit code the forkserver reports
    for _ in range(20):
        p = ctx.Process(target=time.sleep, args=(60,), daemon=True)
        p.start()
        watch = ProcessWatch(p)
        assert not watch.ended()
        stop = threading.Event()

        poller = threading.Thread(target=_poll, args=(watch, stop))
        poller.start()
        try:
            os.kill(p.pid, signal.SIGKILL)
            code = watch.exit_code(10)
        finally:
            stop.set()
            poller.join()
        assert code == -signal.SIGKILL, describe_exit(code)
        assert watch.ended() and watch.exit_code(0) == code
    assert describe_exit(code)[0] == "SIGKILL"


def test_a_running_process_has_no_exit_code_yet():
    p = process_context().Process(target=time.sleep, args=(60,), daemon=True)
    p.start()
    watch = ProcessWatch(p)
    try:
        assert watch.exit_code(0.05) is None and not watch.ended()
    finally:
        p.kill()
    assert watch.exit_code(10) == -signal.SIGKILL and watch.ended()
