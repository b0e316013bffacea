"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

One SQLite database (`responses.sqlite3` in `--responses-dir`), so stored answers survive a restart and
several server processes can share a directory (WAL mode: readers never wait for the writer). Each row
holds the `response` object, the conversation that led to it (its input items, earlier turns included),
and the rendered prompt with its token ids and the answer's token ids: a continuation whose prompt
starts with that text reuses those very tokens, so its prompt begins with the previous prompt + answer
and the prefix cache serves them (`usage.input_tokens_details.cached_tokens`).

A row belongs to an owner (`owner_key`: the API key presented, when the server has keys, and the tenant
by the server's `--tenant-key` rule); any other owner gets None, which the endpoint answers with a 404,
the same answer as for an id that never existed. The store is bounded: `--responses-max-stored` rows
(oldest dropped first) and `--responses-max-age-days`.

All database work runs on one worker thread that owns the connection, so the event loop only awaits it;
each write is one short transaction. A store that cannot be opened or written logs a warning and the
request still gets its answer: the store is a convenience, never a reason to lose a response.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("conveyor.server.responses")

DB_NAME = "responses.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    prompt_text TEXT NOT NULL,
    prompt_ids BLOB NOT NULL,
    output_ids BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""
T = TypeVar("T")
# what a store that cannot be used raises: the database's errors, the file system's, and the worker pool's
# refusal once the server has shut it down
_FAILURES = (sqlite3.Error, OSError, RuntimeError)


def default_dir() -> Path:
    """Where responses are stored without `--responses-dir`: the user's data directory (XDG)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "conveyor" / "responses"


def owner_key(api_key: str | None, tenant: str | None) -> str:
    """Who a stored response belongs to: the API key presented (a hash of it; None when the server has no
    keys, where a bearer token proves nothing) and the tenant (None: the default tenant)."""
    key = hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key is not None else ""
    return f"{key}/{tenant or ''}"


def _ids_blob(ids: list[int]) -> bytes:
    return array.array("i", ids).tobytes()


def _ids_list(blob: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(blob)
    return a.tolist()


@dataclass
class StoredResponse:
    id: str
    response: dict
    input_items: list[dict]  # the conversation before this response's output, earlier turns included
    prompt_text: str  # the prompt as rendered by the chat template
    prompt_ids: list[int]  # its token ids (as sent to the engine)
    output_ids: list[int]  # the answer's token ids

    @property
    def output_items(self) -> list[dict]:
        return self.response.get("output") or []


class ResponseStore:
    """The SQLite store behind `/v1/responses` (see the module's docstring)."""

    def __init__(self, directory: str | os.PathLike | None, max_stored: int = 10000,
                 max_age_s: float = 30 * 86400.0) -> None:
        self.directory = Path(directory).expanduser() if directory else default_dir()
        self.max_stored = max_stored
        self.max_age_s = max_age_s
        self._conn: sqlite3.Connection | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")  # owns the connection

    @property
    def enabled(self) -> bool:
        return self.max_stored > 0

    @property
    def path(self) -> Path:
        return self.directory / DB_NAME

    # --- on the worker thread ---------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        """The connection, opened on first use (a server that never sees /v1/responses creates nothing)."""
        if self._conn is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
                conn.executescript(_SCHEMA)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _cutoff(self) -> float:
        return time.time() - self.max_age_s

    def _put(self, owner: str, row: StoredResponse, created_at: float) -> None:
        conn = self._connect()
        with conn:  # one transaction: the row, then what falls outside the bounds
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (row.id, owner, created_at, json.dumps(row.response), json.dumps(row.input_items),
                          row.prompt_text, _ids_blob(row.prompt_ids), _ids_blob(row.output_ids)))
            conn.execute("DELETE FROM responses WHERE created_at < ?", (self._cutoff(),))
            conn.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                         "rowid DESC LIMIT -1 OFFSET ?)", (self.max_stored,))

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._connect().execute(
            "SELECT response, input_items, prompt_text, prompt_ids, output_ids FROM responses "
            "WHERE id = ? AND owner = ? AND created_at >= ?", (response_id, owner, self._cutoff())).fetchone()
        if row is None:
            return None
        return StoredResponse(response_id, json.loads(row[0]), json.loads(row[1]), row[2], _ids_list(row[3]),
                              _ids_list(row[4]))

    def _delete(self, owner: str, response_id: str) -> bool:
        conn = self._connect()
        with conn:
            cur = conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cur.rowcount > 0

    # --- from the event loop ----------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def put(self, owner: str, row: StoredResponse) -> bool:
        """Store `row` for `owner`; False (with a warning logged) if it could not be written."""
        if not self.enabled:
            return False
        try:
            await self._run(self._put, owner, row, time.time())
            return True
        except _FAILURES as e:
            log.warning("response %s was answered but not stored (%s: %s): %s", row.id, type(e).__name__, e,
                        self.path)
            return False

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """`owner`'s response `response_id`, or None (unknown, someone else's, expired, or the store is
        unreadable: logged)."""
        if not self.enabled:
            return None
        try:
            return await self._run(self._get, owner, response_id)
        except _FAILURES as e:
            log.warning("the response store could not be read (%s: %s): %s", type(e).__name__, e, self.path)
            return None

    async def delete(self, owner: str, response_id: str) -> bool:
        if not self.enabled:
            return False
        try:
            return await self._run(self._delete, owner, response_id)
        except _FAILURES as e:
            log.warning("the response store could not be written (%s: %s): %s", type(e).__name__, e, self.path)
            return False

    def close(self) -> None:
        """Finish the queued work and close the database (the server's shutdown)."""
        self._pool.shutdown(wait=True)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
