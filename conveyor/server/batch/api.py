"""OpenAI's Files and Batches endpoints, on the server's own engine: `/v1/files` (upload with `purpose: "batch"`,
list, metadata, content, delete) and `/v1/batches` (create, retrieve, list, cancel), as the `openai` client calls
them (`client.files.create(file=..., purpose="batch")`, `client.batches.create(...)`).

- an upload streams to disk (`read_upload`), and is refused past `--batch-max-file-bytes` (413) or
  `--batch-max-disk-bytes` for the whole store (413), past `--batch-max-lines` lines (400), or when it is not
  JSONL at all (400: not UTF-8 text, or no line a JSON object); a malformed line in a JSONL file is that line's
  error, found when the batch checks its lines (`runner.py`);
- every route is checked like the API (`--api-key`), and files and batches belong to who made them: the API key
  presented (as its hash) and the server's tenant rule (`--tenant-key`); nobody else sees them (404);
- the store opens on first use, or at startup when `--batch-dir` already holds one (then the unfinished batches
  made on this served model resume; another model's are left as they are); a lock file keeps a second server off
  the same directory.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from conveyor.server.batch.lines import ENDPOINTS, BatchLines
from conveyor.server.batch.runner import BatchRunner
from conveyor.server.batch.store import UNFINISHED, BatchStore
from conveyor.server.http import ApiError, bad_request, bearer_token, read_json
from conveyor.server.serving import ServingContext

log = logging.getLogger("conveyor.server.batch")

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_FIELD_BYTES = 64 * 1024  # a form field other than the file (purpose, expires_after)


def default_batch_dir() -> Path:
    """Where a user expects an application's data: ~/.local/share/conveyor/batches on Linux (XDG_DATA_HOME),
    the platform's own data directory elsewhere."""
    import platformdirs

    return Path(platformdirs.user_data_dir("conveyor")) / "batches"


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No such {what}: {ident}", param=param, code="not_found")


class Upload:
    """A multipart upload: its small fields, and its file part streamed to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.over = False  # the file part went past the limit (the rest is read and dropped)


async def read_upload(request: Request, path: Path, limit: int) -> Upload:
    """Parse a multipart/form-data body as it arrives: the part named `file` goes to `path` (at most `limit`
    bytes: `over` says it had more), the other fields are kept (each at most MAX_FIELD_BYTES). A body past
    16 x the limit is cut short, as `read_body` does."""
    ctype, opts = parse_options_header(request.headers.get("content-type", ""))
    boundary = opts.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise bad_request("upload a file as multipart/form-data (fields 'file' and 'purpose')")
    up = Upload(path)
    part: dict[str, Any] = {}
    headers: dict[bytes, bytes] = {}
    field_name: list[bytes] = []
    field_value: list[bytes] = []
    out = open(path, "wb")  # noqa: SIM115 - closed in the finally below

    def on_part_begin() -> None:
        part.clear()
        headers.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field_name.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        field_value.append(data[start:end])

    def on_header_end() -> None:
        headers[b"".join(field_name).strip().lower()] = b"".join(field_value).strip()
        field_name.clear()
        field_value.clear()

    def on_headers_finished() -> None:
        _, disp = parse_options_header(headers.get(b"content-disposition", b""))
        part["name"] = disp.get(b"name", b"").decode(errors="replace")
        part["file"] = part["name"] == "file"
        if part["file"]:
            up.filename = disp.get(b"filename", b"upload.jsonl").decode(errors="replace")
        part["data"] = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        n = end - start
        if part.get("file"):
            if up.size + n > limit:
                up.over = True
            elif not up.over:
                out.write(data[start:end])
            up.size += n
        elif len(part["data"]) + n <= MAX_FIELD_BYTES:
            part["data"] += data[start:end]

    def on_part_end() -> None:
        if not part.get("file") and part.get("name"):
            up.fields[part["name"]] = bytes(part["data"]).decode(errors="replace")

    parser = MultipartParser(boundary, {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                                        "on_header_value": on_header_value, "on_header_end": on_header_end,
                                        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
                                        "on_part_end": on_part_end})
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > 16 * limit + 2 * MAX_FIELD_BYTES:
                up.over = True
                break
            parser.write(chunk)
        parser.finalize()
    except ValueError as e:  # python-multipart's parse errors
        raise bad_request(f"the multipart body could not be read: {e}") from None
    finally:
        out.close()
    return up


def scan_jsonl(path: Path, max_lines: int) -> int:
    """The number of non-blank lines of an uploaded batch file; a ValueError if it is not JSONL at all (not UTF-8
    text, or not one line a JSON object) or has more than `max_lines` lines. Each line's own shape is checked when
    a batch runs it (a malformed line is that line's error, not the file's)."""
    n, objects = 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            n += 1
            if n > max_lines:
                raise OverflowError(f"the file has more than {max_lines} lines (--batch-max-lines)")
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"the file is not UTF-8 text (line {number})") from None
            if not objects:
                try:
                    objects += isinstance(json.loads(text), dict)
                except ValueError:
                    pass
    if not n:
        raise ValueError("the file is empty")
    if not objects:
        raise ValueError("the file is not JSONL: no line is a JSON object (a batch file holds one request per line)")
    return n


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer", name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def _check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in metadata.items())):
        raise bad_request("metadata must be an object of at most 16 string pairs (keys up to 64 characters, values "
                          "up to 512)", "metadata")
    return metadata


class _BatchCollector(Collector):
    """The Batch API's gauges, read at scrape time."""

    def __init__(self, service: BatchService, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    def collect(self):
        depth = GaugeMetricFamily("conveyor:batch_queue_depth", "Lines of unfinished batches not answered yet.",
                                  labels=["model_name"])
        inflight = GaugeMetricFamily("conveyor:batch_lines_in_flight", "Batch lines handed to the engine now "
                                     "(--batch-max-inflight at most).", labels=["model_name"])
        jobs = GaugeMetricFamily("conveyor:batch_jobs", "Batches by status.", labels=["model_name", "status"])
        runner = self.service.runner
        depth.add_metric([self.model_name], runner.queue_depth() if runner is not None else 0)
        inflight.add_metric([self.model_name], runner.inflight if runner is not None else 0)
        counts = self.service.store.count_batches() if self.service.store is not None else {}
        for status in (*UNFINISHED, "completed", "failed", "expired", "cancelled"):
            jobs.add_metric([self.model_name, status], counts.get(status, 0))
        yield depth
        yield inflight
        yield jobs


class BatchService:
    """The Batch API of one server: its store (opened on first use), its runner, its routes and metrics."""

    def __init__(self, ctx: ServingContext, batch_dir: str | None, max_file_bytes: int, max_lines: int,
                 max_disk_bytes: int, max_inflight: int, registry=None) -> None:
        self.ctx = ctx
        self.root = Path(batch_dir).expanduser() if batch_dir else default_batch_dir()
        self.max_file_bytes = max_file_bytes
        self.max_lines = max_lines
        self.max_disk_bytes = max_disk_bytes
        self.max_inflight = max_inflight
        self.lines = BatchLines(ctx)
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self._lock_fd: int | None = None
        self._running = False
        model = ctx.model_names[0]
        self.lines_total = None
        if registry is not None:
            self.lines_total = Counter("conveyor:batch_lines", "Batch lines answered, by outcome (completed: the "
                                       "endpoint answered 200; failed: refused or failed; expired: never ran).",
                                       ["model_name", "status"], registry=registry)
            for status in ("completed", "failed", "expired"):
                self.lines_total.labels(model, status)
            registry.register(_BatchCollector(self, model))

    # --- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume what a previous server left in `--batch-dir` (if it holds a store)."""
        self._running = True
        if (self.root / "batches.sqlite3").exists():
            try:
                await self._open()
            except ApiError as e:
                log.error("the Batch API is off: %s", e.message)

    async def stop(self) -> None:
        self._running = False
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _open(self) -> BatchStore:
        if self.store is not None:
            return self.store
        if not self._running:
            raise ApiError(503, "the server is not serving", "service_unavailable", code="loading")
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ApiError(503, f"the batch directory {self.root} is in use by another server; give this one its "
                                "own --batch-dir", "service_unavailable", code="batch_dir_in_use") from None
        self._lock_fd = fd
        self.store = BatchStore(self.root)
        self.runner = BatchRunner(self.store, self.lines, self.ctx.model_names[0], self.max_inflight,
                                  on_lines=self._count_lines)
        await self.runner.start()
        log.info("Batch API: store in %s (%d bytes)", self.root, self.store.disk_bytes())
        return self.store

    def _count_lines(self, status: str, n: int) -> None:
        if self.lines_total is not None:
            self.lines_total.labels(self.ctx.model_names[0], status).inc(n)

    def owner(self, request: Request) -> str:
        """Who files and batches belong to: the API key presented (hashed) and the tenant by the server's rule
        (from headers; a body's `user` names no owner)."""
        key = bearer_token(request.headers)
        kid = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12] if key else "-"
        return f"{kid}/{self.tenant(request) or '-'}"

    def tenant(self, request: Request) -> str | None:
        """The tenant a batch's lines run for, where the rule does not read each body's `user`."""
        rule = self.ctx.options.tenant_rule
        return None if rule.source == "user" else rule.resolve(None, request.headers)

    def dashboard_view(self) -> dict | None:
        if self.runner is None:
            return None
        return {"batches": self.runner.progress(), "in_flight": self.runner.inflight,
                "max_in_flight": self.runner.max_inflight}

    # --- files ----------------------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        store = await self._open()
        room = self.max_disk_bytes - store.disk_bytes()
        limit = max(min(self.max_file_bytes, room), 0)
        cl = request.headers.get("content-length", "")
        temp = store.temp_path()
        try:
            if cl.isdigit() and int(cl) > 16 * max(limit, 1) + 2 * MAX_FIELD_BYTES:
                up = None
            else:
                up = await read_upload(request, temp, limit)
            if up is None or up.over:
                if limit < self.max_file_bytes:
                    raise ApiError(413, f"the batch store is full: --batch-max-disk-bytes is {self.max_disk_bytes} "
                                        f"bytes and {self.max_disk_bytes - room} are used; delete files you no longer"
                                        " need", param="file", code="storage_limit_exceeded")
                raise ApiError(413, f"the file is larger than --batch-max-file-bytes ({self.max_file_bytes} bytes)",
                               param="file", code="file_too_large")
            purpose = up.fields.get("purpose")
            if purpose != "batch":
                raise bad_request(f"purpose must be 'batch' (this server keeps files for the Batch API), got "
                                  f"{purpose!r}", "purpose")
            if up.filename is None:
                raise bad_request("the upload has no 'file' part", "file")
            try:
                lines = await asyncio.to_thread(scan_jsonl, temp, self.max_lines)
            except OverflowError as e:
                raise bad_request(str(e), "file") from None
            except ValueError as e:
                raise bad_request(str(e), "file") from None
            rec = store.add_file(self.owner(request), purpose, Path(up.filename).name or "upload.jsonl", temp, lines)
        finally:
            temp.unlink(missing_ok=True)
        return JSONResponse(rec.to_api())

    async def list_files(self, request: Request) -> Response:
        store = await self._open()
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        items, more = store.list_files(self.owner(request), request.query_params.get("purpose"),
                                       request.query_params.get("after"),
                                       _int_param(request, "limit", 10000, 1, 10000), order)
        return JSONResponse(_page([f.to_api() for f in items], more))

    async def get_file(self, request: Request, file_id: str) -> Response:
        rec = (await self._open()).get_file(self.owner(request), file_id)
        if rec is None:
            raise not_found("File object", file_id)
        return JSONResponse(rec.to_api())

    async def file_content(self, request: Request, file_id: str) -> Response:
        store = await self._open()
        rec = store.get_file(self.owner(request), file_id)
        if rec is None:
            raise not_found("File object", file_id)
        return FileResponse(store.content_path(file_id), media_type="application/octet-stream",
                            filename=rec.filename)

    async def delete_file(self, request: Request, file_id: str) -> Response:
        if not (await self._open()).delete_file(self.owner(request), file_id):
            raise not_found("File object", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # --- batches --------------------------------------------------------------------------------------------
    async def create_batch(self, request: Request, data: dict) -> Response:
        store = await self._open()
        owner = self.owner(request)
        fid = data.get("input_file_id")
        if not isinstance(fid, str):
            raise bad_request("input_file_id must name an uploaded file", "input_file_id")
        endpoint = data.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        window = data.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be '24h', got {window!r}", "completion_window")
        metadata = _check_metadata(data.get("metadata"))
        file = store.get_file(owner, fid)
        if file is None:
            raise not_found("File object", fid, "input_file_id")
        if file.purpose != "batch":
            raise bad_request(f"the input file must be uploaded with purpose 'batch', not {file.purpose!r}",
                              "input_file_id")
        rec = store.create_batch(owner, self.tenant(request), self.ctx.model_names[0], endpoint, file, window,
                                 COMPLETION_WINDOWS[window], metadata)
        self.runner.add(rec)
        return JSONResponse(store.get_batch(None, rec.id).to_api())

    async def get_batch(self, request: Request, batch_id: str) -> Response:
        rec = (await self._open()).get_batch(self.owner(request), batch_id)
        if rec is None:
            raise not_found("batch", batch_id)
        return JSONResponse(rec.to_api())

    async def list_batches(self, request: Request) -> Response:
        store = await self._open()
        items, more = store.list_batches(self.owner(request), request.query_params.get("after"),
                                         _int_param(request, "limit", 20, 1, 100))
        return JSONResponse(_page([b.to_api() for b in items], more))

    async def cancel_batch(self, request: Request, batch_id: str) -> Response:
        store = await self._open()
        rec = store.get_batch(self.owner(request), batch_id)
        if rec is None:
            raise not_found("batch", batch_id)
        if rec.status in ("validating", "in_progress"):
            self.runner.cancel(batch_id)
        elif rec.status not in ("cancelling", "cancelled"):
            raise ApiError(409, f"Cannot cancel a batch with status '{rec.status}'.", code="batch_not_cancellable")
        return JSONResponse(store.get_batch(None, batch_id).to_api())

    # --- routes ---------------------------------------------------------------------------------------------
    def install(self, router: APIRouter, max_request_bytes: int) -> None:
        """Mount the routes on `router`, which checks the API key."""

        @router.post("/v1/files")
        async def upload(request: Request) -> Response:
            return await self.upload(request)

        @router.get("/v1/files")
        async def list_files(request: Request) -> Response:
            return await self.list_files(request)

        @router.get("/v1/files/{file_id}")
        async def get_file(request: Request, file_id: str) -> Response:
            return await self.get_file(request, file_id)

        @router.get("/v1/files/{file_id}/content")
        async def file_content(request: Request, file_id: str) -> Response:
            return await self.file_content(request, file_id)

        @router.delete("/v1/files/{file_id}")
        async def delete_file(request: Request, file_id: str) -> Response:
            return await self.delete_file(request, file_id)

        @router.post("/v1/batches")
        async def create_batch(request: Request) -> Response:
            return await self.create_batch(request, await read_json(request, max_request_bytes))

        @router.get("/v1/batches")
        async def list_batches(request: Request) -> Response:
            return await self.list_batches(request)

        @router.get("/v1/batches/{batch_id}")
        async def get_batch(request: Request, batch_id: str) -> Response:
            return await self.get_batch(request, batch_id)

        @router.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(request: Request, batch_id: str) -> Response:
            return await self.cancel_batch(request, batch_id)


def _page(data: list[dict], more: bool) -> dict:
    """OpenAI's cursor page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
