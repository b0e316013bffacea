"""Runs the batches: checks every line, feeds the engine a bounded number of lines at a time, commits each answer,
writes the output and error files.

A batch moves `validating` -> `in_progress` -> `finalizing` -> `completed` (or `cancelling` -> `cancelled`, or
`expired` once its 24-hour window has passed; `failed` if its input file is gone). While validating, every line
is checked through its endpoint (`BatchLines.check`) and each refused one is committed to the error file at once;
the lines that pass run afterwards. The runner keeps at most `max_inflight` lines in the engine, across all
batches, taking them from each running batch in turn (so the strategy's tenant shares see every batch), which
keeps the engine's waiting queue short: a cancel is prompt, and interactive requests never meet a queue of batch
lines (they are not counted against the 429 limits either: `AsyncEngine.submit`). Lines run in the batch tier of
the scheduler, which only takes what interactive work leaves.

A restart resumes every unfinished batch made on the same served model where it stood (`BatchStore`: results are
committed per line): a validating batch is checked again from its first unchecked line, a running one runs the lines
without a result, a finalizing one writes its files again. A line whose engine went away (a 503) is not answered: it
is retried a second later, and after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.server.batch.lines import BatchLines, Deferred, Line, error_line, parse_line
from conveyor.server.batch.store import BatchRecord, BatchStore, LineResult
from conveyor.server.http import bad_request

log = logging.getLogger("conveyor.server.batch")

RETRY_S = 1.0  # a line whose engine went away runs again after this long
FINISH_RETRY_S = 30.0  # a batch whose files could not be written tries again after this long
# lines are checked in slices of this long on the event loop: one line a slice cost ~13 ms a line beside a busy engine
# (every yield hands the GIL to the engine's thread, and getting it back waits out its switch interval)
CHECK_SLICE_S = 0.005


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line of a JSONL file; numbers count every line, blank ones too."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


@dataclass
class Job:
    """A batch the runner is working on."""

    rec: BatchRecord
    path: Path
    cancel: asyncio.Event = field(default_factory=asyncio.Event)  # set: its lines in flight are aborted
    pending: Iterator[Line] | None = None  # lines still to run, once checked
    retry: deque[Line] = field(default_factory=deque)  # lines whose engine went away
    inflight: int = 0
    checking: bool = False
    exhausted: bool = False  # every line has been handed out
    ending: str | None = None  # "cancelled" | "expired": no more lines; final once none is in flight
    finishing: bool = False

    @property
    def id(self) -> str:
        return self.rec.id


class BatchRunner:
    def __init__(self, store: BatchStore, lines: BatchLines, model: str, max_inflight: int,
                 on_lines: Callable[[str, int], None] | None = None) -> None:
        """`model`: the served model (this runner takes on the batches made on it); `on_lines(status, n)`: n lines
        got their final answer (completed | failed | expired), for /metrics."""
        self.store = store
        self.model = model
        self.lines = lines
        self.max_inflight = max(1, max_inflight)
        self.on_lines = on_lines
        self.jobs: dict[str, Job] = {}
        self.order: deque[str] = deque()  # running jobs, taken in turn
        self.inflight = 0
        self.paused_until = 0.0
        self.refill_due = False  # a `_fill` is scheduled for when the pause ends
        self.tasks: set[asyncio.Task] = set()
        self.started = False

    # --- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume every batch a previous run of the server left unfinished."""
        self.started = True
        for rec in self.store.unfinished_batches(self.model):
            log.info("resuming batch %s (%s, %d of %d lines answered)", rec.id, rec.status,
                     rec.completed + rec.failed, rec.total)
            self.add(rec)

    async def stop(self) -> None:
        """Stop working (server shutdown): lines in flight are aborted, uncommitted, and run after a restart."""
        self.started = False
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for job in self.jobs.values():
            if job.pending is not None:
                job.pending.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def add(self, rec: BatchRecord) -> None:
        """Take on a batch (just created, or left unfinished by a previous run)."""
        path = self.store.content_path(rec.input_file_id)
        job = self.jobs[rec.id] = Job(rec, path)
        if rec.status in ("validating", "in_progress") and not path.exists():
            self.store.add_errors(rec.id, [{"code": "file_not_found", "message": f"the input file {rec.input_file_id}"
                                            " is gone", "param": "input_file_id", "line": None}])
            self.store.set_status(rec.id, "failed")
            del self.jobs[rec.id]
            return
        loop = asyncio.get_running_loop()
        loop.call_later(max(rec.expires_at - time.time(), 0.0), self.expire, rec.id)
        if rec.status == "validating":
            job.checking = True
            self._spawn(self._check(job))
        elif rec.status == "in_progress":
            self._run(job)
        elif rec.status == "cancelling":
            job.ending = "cancelled"
            self._maybe_finish(job)
        else:  # finalizing: every line has its answer; the files are (re)written
            job.exhausted = True
            self._maybe_finish(job)

    def cancel(self, batch_id: str) -> None:
        """Cancel a batch: no more lines start, those in flight are aborted, the answers so far are written out."""
        job = self.jobs.get(batch_id)
        if job is None or job.ending is not None:
            return
        self.store.set_status(batch_id, "cancelling")
        job.ending = "cancelled"
        job.cancel.set()
        self._maybe_finish(job)

    def expire(self, batch_id: str) -> None:
        """End a batch whose window has passed: what never ran goes to the error file as `batch_expired`."""
        job = self.jobs.get(batch_id)
        if job is None or job.ending is not None or job.finishing:
            return
        log.warning("batch %s expired with lines unanswered", batch_id)
        job.ending = "expired"
        job.cancel.set()
        self._maybe_finish(job)

    # --- checking ---------------------------------------------------------------------------------------
    async def _check(self, job: Job) -> None:
        """Check every line through its endpoint; commit each refused one (error file) before any line runs."""
        rec = job.rec
        try:
            done = self.store.done_lines(rec.id)
            first_use: dict[str, int] = {}
            errors: list[dict] = []
            slice_start = time.monotonic()
            for number, raw in iter_lines(job.path):
                if job.ending is not None:
                    break
                line = parse_line(number, raw, rec.endpoint)
                cid = line.custom_id
                if cid is not None and cid in first_use and line.error is None:
                    line.error = bad_request(f"custom_id {cid!r} is used by line {first_use[cid]} already: each "
                                             "line needs its own", "custom_id")
                if cid is not None:
                    first_use.setdefault(cid, number)
                if number in done:
                    continue
                result = await self.lines.check(rec.endpoint, line, rec.tenant)
                if result is not None:
                    self._commit(job, result)
                    if line.error is not None:  # not a request at all: also in the batch's own errors
                        errors.append({"code": "invalid_request", "message": line.error.message,
                                       "param": line.error.param, "line": number})
                if time.monotonic() - slice_start > CHECK_SLICE_S:  # the event loop serves everything else between
                    await asyncio.sleep(0)
                    slice_start = time.monotonic()
            if errors:
                self.store.add_errors(rec.id, errors)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the file could not be read: the batch fails, saying why
            log.exception("checking batch %s failed", rec.id)
            self.store.add_errors(rec.id, [{"code": "internal_error", "message": f"the input file could not be read: "
                                            f"{type(e).__name__}: {e}", "param": "input_file_id", "line": None}])
            self.store.set_status(rec.id, "failed")
            self.jobs.pop(rec.id, None)
            return
        finally:
            job.checking = False
        if job.ending is None:
            self.store.set_status(rec.id, "in_progress")
            self._run(job)
        else:
            self._maybe_finish(job)

    # --- running ----------------------------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        done = self.store.done_lines(job.id)
        job.pending = (parse_line(n, raw, job.rec.endpoint) for n, raw in iter_lines(job.path) if n not in done)
        self.order.append(job.id)
        self._fill()

    def _next_line(self) -> tuple[Job, Line] | None:
        """The next line to run, taking running batches in turn."""
        for _ in range(len(self.order)):
            job = self.jobs.get(self.order[0])
            self.order.rotate(-1)
            if job is None or job.ending is not None or job.exhausted:
                continue
            line = job.retry.popleft() if job.retry else next(job.pending, None)
            if line is not None:
                return job, line
            job.exhausted = True
            self._maybe_finish(job)
        return None

    def _fill(self) -> None:
        """Hand lines to the engine up to `max_inflight`."""
        if not self.started:
            return
        wait = self.paused_until - time.monotonic()
        if wait > 0:
            if not self.refill_due:
                self.refill_due = True
                asyncio.get_running_loop().call_later(wait, self._refill)
            return
        while self.inflight < self.max_inflight:
            nxt = self._next_line()
            if nxt is None:
                break
            job, line = nxt
            self.inflight += 1
            job.inflight += 1
            self._spawn(self._run_line(job, line))
        self.order = deque(j for j in self.order if j in self.jobs and not self.jobs[j].exhausted)

    def _refill(self) -> None:
        self.refill_due = False
        self._fill()

    async def _run_line(self, job: Job, line: Line) -> None:
        result: LineResult | None = None
        try:
            result = await self.lines.run(job.rec.endpoint, line, job.rec.tenant, job.cancel)
        except Deferred as e:
            if job.ending is None:  # the engine went away: this line runs again a little later
                log.warning("batch %s line %d deferred: %s", job.id, line.number, e)
                job.retry.append(line)
                job.exhausted = False
                if job.id not in self.order:
                    self.order.append(job.id)
                self.paused_until = time.monotonic() + RETRY_S
        finally:
            self.inflight -= 1
            job.inflight -= 1
        if result is not None:
            self._commit(job, result)
        self._maybe_finish(job)
        self._fill()

    def _commit(self, job: Job, result: LineResult) -> None:
        if self.store.add_result(job.id, result) and self.on_lines is not None:
            self.on_lines("completed" if result.ok else "failed", 1)

    # --- the end ----------------------------------------------------------------------------------------
    def _maybe_finish(self, job: Job) -> None:
        if job.finishing or job.checking or job.inflight:
            return
        if job.ending is None and not (job.exhausted and not job.retry):
            return
        job.finishing = True
        self._spawn(self._finish(job, job.ending or "completed"))

    async def _finish(self, job: Job, status: str) -> None:
        rec = job.rec
        if job.pending is not None:
            job.pending.close()
        if status == "completed":
            self.store.set_status(rec.id, "finalizing")
        elif status == "expired":  # what never ran goes to the error file as OpenAI's batch_expired
            done = self.store.done_lines(rec.id)
            n = 0
            for number, raw in iter_lines(job.path):
                if number not in done:
                    cid = parse_line(number, raw, rec.endpoint).custom_id
                    self.store.add_result(rec.id, LineResult(number, cid, False, error_line(
                        cid, "batch_expired", "This request could not be executed before the completion window "
                        "expired.")))
                    n += 1
            if n and self.on_lines is not None:
                self.on_lines("expired", n)
        try:
            written = await asyncio.to_thread(self.store.write_outputs, rec)
            final = self.store.complete(rec, status, written)
        except asyncio.CancelledError:
            raise
        except Exception:  # e.g. the disk is full: the results stay committed; tried again in a while
            log.exception("writing the files of batch %s failed; trying again in %.0f s", rec.id, FINISH_RETRY_S)
            job.finishing = False
            asyncio.get_running_loop().call_later(FINISH_RETRY_S, self._maybe_finish, job)
            return
        self.jobs.pop(rec.id, None)
        log.info("batch %s %s: %d completed, %d failed of %d", rec.id, status, final.completed, final.failed,
                 final.total)

    # --- views --------------------------------------------------------------------------------------------
    def queue_depth(self) -> int:
        """Lines of unfinished batches without an answer yet."""
        return sum(max(r.total - r.completed - r.failed, 0) for r in self.store.unfinished_batches(self.model))

    def progress(self, limit: int = 8) -> list[dict]:
        """The unfinished batches (then the latest finished ones): what the dashboard shows."""
        recs, _ = self.store.list_all(limit)
        return [{"id": r.id, "status": r.status, "endpoint": r.endpoint, "total": r.total, "completed": r.completed,
                 "failed": r.failed} for r in recs]
