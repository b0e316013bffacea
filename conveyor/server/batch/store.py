"""Where the Batch API keeps its state: one SQLite database (WAL) for files' metadata, batches and each line's
result, and one directory for the files' contents, both under `--batch-dir`.

The rule that makes a restart safe: a line counts as done only once its result row is committed, in the same
transaction that counts it in its batch's `request_counts`. A server killed at any moment (SIGKILL included)
restarts with every committed result and reruns only the lines without one, so no line is lost and none is
answered twice; the output and error files are written from the result rows at the end, in input order, each
line once. WAL with `synchronous=NORMAL` survives a killed process; a power cut may lose the last commits, which
then only means those lines run again. Output files are written under a temporary name and renamed, so a file
that exists is whole.

Bounded: the server checks each upload against `--batch-max-file-bytes` and `--batch-max-lines`, and the whole
directory (contents, results and the database) against `--batch-max-disk-bytes` (`disk_bytes`).
Everything here is synchronous and quick (one small transaction per call); the server calls it on its event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    lines INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0   -- deleted by its owner; the content stays while a batch still reads it
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    tenant TEXT,                          -- the tenant its lines run for, where the rule is not the body's `user`
    model TEXT NOT NULL,                  -- the served model it was made on: only a server of it runs the batch
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,                          -- JSON list of {code, message, param, line}
    total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,               -- 1-based, over the file's non-blank lines
    custom_id TEXT,
    ok INTEGER NOT NULL,                 -- 1: goes to the output file, 0: to the error file
    text TEXT NOT NULL,                  -- the whole output line (JSON)
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_ERRORS = 100  # batch-level error entries kept (`Batch.errors`); every line's own error is in the error file


@dataclass
class FileRecord:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    created_at: int

    def to_api(self) -> dict[str, Any]:
        """OpenAI's `FileObject`."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass
class BatchRecord:
    id: str
    owner: str
    tenant: str | None
    model: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict | None
    status: str
    created_at: int
    expires_at: int
    total: int
    completed: int = 0
    failed: int = 0
    times: dict[str, int | None] = field(default_factory=dict)  # in_progress_at ... cancelled_at
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    def to_api(self) -> dict[str, Any]:
        """OpenAI's `Batch`."""
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": {
                    "object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{k: self.times.get(k) for k in _TIMES},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "usage": {"input_tokens": self.input_tokens,
                          "input_tokens_details": {"cached_tokens": self.cached_tokens},
                          "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": self.input_tokens + self.output_tokens},
                "metadata": self.metadata, "model": self.model}


_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
          "cancelled_at")
_BATCH_COLS = ("id", "owner", "tenant", "model", "endpoint", "input_file_id", "completion_window", "metadata", "status",
               "created_at", "expires_at", "total", "completed", "failed", *_TIMES, "output_file_id",
               "error_file_id", "errors", "input_tokens", "cached_tokens", "output_tokens")
_FILE_COLS = ("id", "owner", "purpose", "filename", "bytes", "lines", "created_at")


@dataclass(frozen=True)
class LineResult:
    """One line's answer, as it goes into the output (ok) or error file; usage counts towards the batch's."""

    line: int
    custom_id: str | None
    ok: bool
    text: str
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        self.files_dir = self.root / "files"
        self.tmp_dir = self.root / "tmp"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp_dir.iterdir():  # uploads and outputs a killed server left half-written
            leftover.unlink(missing_ok=True)
        self.db_path = self.root / "batches.sqlite3"
        self.db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        # results of batches that reached a final state belong in their output files (a kill between the two)
        self.db.execute(f"DELETE FROM results WHERE batch_id IN (SELECT id FROM batches WHERE status IN "
                        f"({','.join('?' * len(FINAL))}))", FINAL)
        self._content_bytes = sum(p.stat().st_size for p in self.files_dir.iterdir())

    def close(self) -> None:
        self.db.close()

    # --- disk -------------------------------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes the store takes on disk: file contents, the database and its write-ahead log."""
        db = sum(p.stat().st_size for p in (self.db_path, Path(f"{self.db_path}-wal")) if p.exists())
        return self._content_bytes + db

    def content_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def temp_path(self) -> Path:
        return self.tmp_dir / uuid.uuid4().hex

    # --- files ------------------------------------------------------------------------------------------
    def add_file(self, owner: str, purpose: str, filename: str, temp: Path, lines: int,
                 file_id: str | None = None) -> FileRecord:
        """Move an uploaded (or written) file `temp` into the store and record it."""
        rec = FileRecord(file_id or new_id("file-"), owner, purpose, filename, temp.stat().st_size, lines,
                         int(time.time()))
        os.replace(temp, self.content_path(rec.id))
        self._content_bytes += rec.bytes
        self.db.execute("INSERT OR REPLACE INTO files (id, owner, purpose, filename, bytes, lines, created_at) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)", (rec.id, owner, purpose, filename, rec.bytes, lines,
                                                        rec.created_at))
        return rec

    def get_file(self, owner: str | None, file_id: str) -> FileRecord | None:
        """The file, if it exists, is not deleted and (unless `owner` is None) belongs to `owner`."""
        row = self.db.execute(f"SELECT {', '.join(_FILE_COLS)} FROM files WHERE id = ? AND deleted = 0",
                              (file_id,)).fetchone()
        rec = FileRecord(*row) if row else None
        return rec if rec is not None and (owner is None or rec.owner == owner) else None

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                   order: str = "desc") -> tuple[list[FileRecord], bool]:
        return self._page("files", _FILE_COLS, lambda row: FileRecord(*row), owner, after, limit, order,
                          ("AND purpose = ?", (purpose,)) if purpose else ("", ()), "AND deleted = 0")

    def delete_file(self, owner: str, file_id: str) -> bool:
        rec = self.get_file(owner, file_id)
        if rec is None:
            return False
        self.db.execute("UPDATE files SET deleted = 1 WHERE id = ?", (file_id,))
        self.purge_deleted()
        return True

    def purge_deleted(self) -> None:
        """Remove the contents of deleted files that no unfinished batch reads any more."""
        rows = self.db.execute(f"SELECT id FROM files WHERE deleted = 1 AND id NOT IN (SELECT input_file_id FROM "
                               f"batches WHERE status IN ({','.join('?' * len(UNFINISHED))}))", UNFINISHED).fetchall()
        for (fid,) in rows:
            path = self.content_path(fid)
            if path.exists():
                self._content_bytes -= path.stat().st_size
                path.unlink()
            self.db.execute("DELETE FROM files WHERE id = ?", (fid,))

    # --- batches ----------------------------------------------------------------------------------------
    def create_batch(self, owner: str, tenant: str | None, model: str, endpoint: str, input_file: FileRecord,
                     completion_window: str, window_s: int, metadata: dict | None) -> BatchRecord:
        now = int(time.time())
        rec = BatchRecord(new_id("batch_"), owner, tenant, model, endpoint, input_file.id, completion_window, metadata,
                          "validating", now, now + window_s, input_file.lines)
        self.db.execute("INSERT INTO batches (id, owner, tenant, model, endpoint, input_file_id, completion_window, "
                        "metadata, status, created_at, expires_at, total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (rec.id, owner, tenant, model, endpoint, input_file.id, completion_window,
                         json.dumps(metadata) if metadata is not None else None, rec.status, now, rec.expires_at,
                         rec.total))
        return rec

    def _batch(self, row: tuple) -> BatchRecord:
        d = dict(zip(_BATCH_COLS, row))
        return BatchRecord(d["id"], d["owner"], d["tenant"], d["model"], d["endpoint"], d["input_file_id"],
                           d["completion_window"], json.loads(d["metadata"]) if d["metadata"] else None,
                           d["status"], d["created_at"], d["expires_at"], d["total"], d["completed"], d["failed"],
                           {k: d[k] for k in _TIMES}, d["output_file_id"], d["error_file_id"],
                           json.loads(d["errors"]) if d["errors"] else [], d["input_tokens"], d["cached_tokens"],
                           d["output_tokens"])

    def get_batch(self, owner: str | None, batch_id: str) -> BatchRecord | None:
        row = self.db.execute(f"SELECT {', '.join(_BATCH_COLS)} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        rec = self._batch(row) if row else None
        return rec if rec is not None and (owner is None or rec.owner == owner) else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        return self._page("batches", _BATCH_COLS, self._batch, owner, after, limit, "desc", ("", ()), "")

    def unfinished_batches(self, model: str | None = None) -> list[BatchRecord]:
        """Unfinished batches, oldest first; those made on `model` alone, if given (what a server of it runs: a
        server of another model, on the same directory, leaves them be)."""
        rows = self.db.execute(f"SELECT {', '.join(_BATCH_COLS)} FROM batches WHERE status IN "
                               f"({','.join('?' * len(UNFINISHED))}) AND (? IS NULL OR model = ?) ORDER BY seq",
                               (*UNFINISHED, model, model)).fetchall()
        return [self._batch(r) for r in rows]

    def count_batches(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())

    def set_status(self, batch_id: str, status: str, **fields: Any) -> None:
        """Move a batch to `status`, stamping `<status>_at` (now) and setting `fields` (columns)."""
        stamp = f"{status}_at"
        values = {"status": status, **({stamp: int(time.time())} if stamp in _TIMES else {}), **fields}
        cols = ", ".join(f"{k} = ?" for k in values)
        self.db.execute(f"UPDATE batches SET {cols} WHERE id = ?", (*values.values(), batch_id))

    def add_errors(self, batch_id: str, errors: list[dict]) -> None:
        """Append batch-level errors (`Batch.errors`: a line's code, message, param and number), up to MAX_ERRORS."""
        row = self.db.execute("SELECT errors FROM batches WHERE id = ?", (batch_id,)).fetchone()
        have = json.loads(row[0]) if row and row[0] else []
        if len(have) < MAX_ERRORS:
            self.db.execute("UPDATE batches SET errors = ? WHERE id = ?",
                            (json.dumps((have + errors)[:MAX_ERRORS]), batch_id))

    # --- results ----------------------------------------------------------------------------------------
    def add_result(self, batch_id: str, r: LineResult) -> bool:
        """Commit one line's result and count it, atomically. False (nothing changed) if that line already has
        one: a line is answered once."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            cur = self.db.execute("INSERT OR IGNORE INTO results (batch_id, line, custom_id, ok, text) "
                                  "VALUES (?, ?, ?, ?, ?)", (batch_id, r.line, r.custom_id, int(r.ok), r.text))
            if cur.rowcount == 0:
                return False
            self.db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, input_tokens = "
                            "input_tokens + ?, cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? "
                            "WHERE id = ?", (int(r.ok), int(not r.ok), r.input_tokens, r.cached_tokens,
                                             r.output_tokens, batch_id))
        return True

    def done_lines(self, batch_id: str) -> set[int]:
        return {n for (n,) in self.db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def write_outputs(self, rec: BatchRecord) -> dict[str, tuple[Path, int]]:
        """Write the output and error files of `rec` from its committed results, in input order, under temporary
        names: {"output" | "error": (path, lines)}. Reads through a connection of its own, so it may run in a
        worker thread while the event loop goes on committing other batches' lines."""
        db = sqlite3.connect(self.db_path)
        try:
            out = {}
            for ok, kind in ((True, "output"), (False, "error")):
                temp, n = self.temp_path(), 0
                with open(temp, "w", encoding="utf-8") as f:
                    for (text,) in db.execute("SELECT text FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                                              (rec.id, int(ok))):
                        f.write(text + "\n")
                        n += 1
                out[kind] = (temp, n)
            return out
        finally:
            db.close()

    def complete(self, rec: BatchRecord, status: str, written: dict[str, tuple[Path, int]]) -> BatchRecord:
        """Record the files `write_outputs` wrote, move the batch to its final `status` and drop its result rows
        (now in the files). Safe to repeat after a kill at any point: the files' ids come from the batch's, and a
        file is renamed into place only once written. An output file always (possibly empty); an error file only
        when a line failed."""
        made: dict[str, str | None] = {}
        for kind, (temp, n) in written.items():
            if kind == "error" and not n:
                temp.unlink()
                made["error_file_id"] = None
                continue
            fid = f"file-{kind}-{rec.id.removeprefix('batch_')}"
            old = self.content_path(fid)
            if old.exists():  # a repeat after a kill: replaced, not counted twice
                self._content_bytes -= old.stat().st_size
            self.add_file(rec.owner, "batch_output", f"{rec.id}_{kind}.jsonl", temp, n, file_id=fid)
            made[f"{kind}_file_id"] = fid
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.set_status(rec.id, status, **made)
            self.db.execute("DELETE FROM results WHERE batch_id = ?", (rec.id,))
        self.purge_deleted()
        return self.get_batch(None, rec.id)

    def list_all(self, limit: int) -> tuple[list[BatchRecord], bool]:
        """Every owner's batches, the unfinished ones first, then the latest (the dashboard's view)."""
        rows = self.db.execute(f"SELECT {', '.join(_BATCH_COLS)} FROM batches ORDER BY status IN "
                               f"({','.join('?' * len(UNFINISHED))}) DESC, seq DESC LIMIT ?",
                               (*UNFINISHED, limit + 1)).fetchall()
        return [self._batch(r) for r in rows[:limit]], len(rows) > limit

    # --- pages ------------------------------------------------------------------------------------------
    def _page(self, table: str, cols: tuple[str, ...], make, owner: str, after: str | None, limit: int, order: str,
              extra: tuple[str, tuple], also: str) -> tuple[list, bool]:
        """One page of `table`'s rows of `owner`, newest first (or oldest, `order="asc"`), after the row with id
        `after` (OpenAI's cursor); and whether more follow."""
        desc = order != "asc"
        where, args = f"owner = ? {extra[0]} {also}", [owner, *extra[1]]
        if after:
            row = self.db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
            if row is not None:
                where += f" AND seq {'<' if desc else '>'} ?"
                args.append(row[0])
        rows = self.db.execute(f"SELECT {', '.join(cols)} FROM {table} WHERE {where} ORDER BY seq "
                               f"{'DESC' if desc else 'ASC'} LIMIT ?", (*args, limit + 1)).fetchall()
        items = [make(r) for r in rows[:limit]]
        return items, len(rows) > limit
