"""One batch line, from its JSON to its answer, through the very endpoint it names.

A line is `{"custom_id", "method": "POST", "url", "body"}`; its `url` must be the batch's endpoint. Its body goes
through that endpoint's own `create` (`completions.py`, `chat.py`, `embeddings.py`): the same parsing,
validation, tokenization, record building (`engine_requests`) and response formatting as a request over HTTP, so
a line answers exactly what the same request sent alone would, errors included. Two things differ, in a mixin
over each endpoint (`BatchLineServing`):
- its records go to the engine in the batch tier (`Tier.BATCH`), without latency targets (a batch has a 24-hour
  window), for the batch's tenant where the server's tenant rule does not read the body's `user` (the rule is
  applied once, to the call that created the batch: its API key is never stored);
- in a check (`BatchLines.check`) the line stops where it would be submitted: everything a request can be refused
  for has been checked by then (its model or adapter, its sampling values, its length against the context), and
  nothing reaches the engine. The runner checks every line of a batch this way before any runs.
A line is run with a synthetic HTTP request whose client "disconnects" when the batch is cancelled, so the
endpoint aborts it as it would a client that left; `--request-timeout` does not apply to batch lines.

Output lines are OpenAI's: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, a
failed request's `response` holding the endpoint's error body with its status; `error` is for lines that never
ran (`batch_expired`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from conveyor.outputs import FinishReason
from conveyor.request import EngineRequest, Tier
from conveyor.server.batch.store import LineResult
from conveyor.server.chat import OpenAIServingChat
from conveyor.server.completions import OpenAIServingCompletion
from conveyor.server.embeddings import OpenAIServingEmbedding
from conveyor.server.http import ApiError, bad_request
from conveyor.server.serving import ServingContext

log = logging.getLogger("conveyor.server.batch")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass
class Line:
    """A line of an input file: its number (1-based, over non-blank lines), its custom_id and body, or the
    reason it cannot be a request at all (`error`)."""

    number: int
    custom_id: str | None
    body: dict | None
    error: ApiError | None = None
    url: str | None = None  # the endpoint it names (checked)


def parse_line(number: int, raw: str, endpoint: str | None) -> Line:
    """A line's fields, checked: JSON, an object, a string `custom_id`, `method` POST, `url` the batch's endpoint
    (`endpoint` None: any endpoint batches serve, as `conveyor batch run` takes them; `Line.url` says which),
    an object `body` that does not ask to stream."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return Line(number, None, None, bad_request(f"line {number} is not valid JSON: {str(e)[:200]}"))
    if not isinstance(obj, dict):
        return Line(number, None, None, bad_request(f"line {number} must be a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Line(number, None, None,
                    bad_request(f"line {number}: custom_id must be a non-empty string", "custom_id"))

    def bad(message: str, param: str) -> Line:
        return Line(number, cid, None, bad_request(message, param))

    if obj.get("method", "POST") != "POST":
        return bad(f"method must be POST, got {obj.get('method')!r}", "method")
    url = obj.get("url")
    if endpoint is None and url not in ENDPOINTS:
        return bad(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        known = url in ENDPOINTS
        return bad(f"url must be the batch's endpoint {endpoint}, got {url!r}"
                   + ("" if known else f" (batches serve {', '.join(ENDPOINTS)})"), "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object (the request to send)", "body")
    if body.get("stream"):
        return bad("stream is not supported in a batch: each line's answer is written whole", "stream")
    return Line(number, cid, body, url=url)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def answer_line(custom_id: str | None, status: int, request_id: str, body_text: str) -> str:
    """An output line for a request the endpoint answered (`body_text`: its JSON, as the endpoint wrote it)."""
    return (f'{{"id": {_json(new_line_id())}, "custom_id": {_json(custom_id)}, "response": {{"status_code": '
            f'{status}, "request_id": {_json(request_id)}, "body": {body_text}}}, "error": null}}')


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """An output line for a request that never ran (OpenAI's `batch_expired`)."""
    return _json({"id": new_line_id(), "custom_id": custom_id, "response": None,
                  "error": {"code": code, "message": message}})


def new_line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def refused(line: Line, e: ApiError) -> LineResult:
    return LineResult(line.number, line.custom_id, False,
                      answer_line(line.custom_id, e.status, f"req_{uuid.uuid4().hex}", _json(e.body())))


# --- the endpoints, serving batch lines -------------------------------------------------------------------
@dataclass
class _LineRun:
    """What the endpoint serving one line needs to know beyond its body (per asyncio task: a ContextVar)."""

    tenant: str | None
    check_only: bool
    api_id: str | None = None
    sub: Any = None  # the line's `Submission`, once submitted


_RUN: ContextVar[_LineRun] = ContextVar("conveyor_batch_line")


class _Checked(Exception):  # noqa: N818 - not an error: a check that reached the point of submitting
    """Raised where a checked line would be submitted: it passed every check of its endpoint."""


class BatchLineServing:
    """Mixed in before an endpoint class: its records go in the batch tier, and a check stops before the engine."""

    def __init__(self, ctx: ServingContext) -> None:
        super().__init__(ctx)
        # a line waits for what interactive work leaves: no --request-timeout (its window is the batch's)
        self.options = dataclasses.replace(ctx.options, request_timeout=None)

    def engine_requests(self, *args: Any, **kwargs: Any) -> list[EngineRequest]:
        run = _RUN.get()
        records = super().engine_requests(*args, **kwargs)
        by_body = self.options.tenant_rule.source == "user"
        return [dataclasses.replace(r, tier=Tier.BATCH, slo_ttft_s=None, slo_tpot_s=None,
                                    tenant=r.tenant if by_body else run.tenant) for r in records]

    def lora_for(self, name: str | None):
        if _RUN.get().check_only:  # counted once, when the line runs
            return self.ctx.loras.get(name) if name is not None and name not in self.ctx.model_names else None
        return super().lora_for(name)

    def submit(self, api_id: str, inputs: list[EngineRequest]):
        run = _RUN.get()
        if run.check_only:
            raise _Checked()
        run.api_id = api_id
        run.sub = super().submit(api_id, inputs)
        return run.sub


class BatchCompletion(BatchLineServing, OpenAIServingCompletion):
    pass


class BatchChat(BatchLineServing, OpenAIServingChat):
    pass


class BatchEmbedding(BatchLineServing, OpenAIServingEmbedding):
    pass


def _request(path: str, cancel: asyncio.Event | None) -> Request:
    """The HTTP request a line's endpoint sees: no headers (the batch's tenant is applied by the mixin), and a
    client that "leaves" when `cancel` is set."""

    async def receive() -> dict:
        if cancel is None:
            await asyncio.Event().wait()
        else:
            await cancel.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "", "client": None,
             "server": None}
    return Request(scope, receive)


class Deferred(Exception):  # noqa: N818 - an outcome: the line is neither answered nor refused
    """A line that got no answer to keep (the engine went away, or the batch was cancelled): it runs again later
    (after a restart) or never (cancelled); nothing is committed for it."""


def aborted(run: _LineRun) -> bool:
    """Whether any sequence of the line was aborted (finish reason "abort"): by a cancel, a shutdown, anything but
    its own end."""
    return run.sub is not None and any(s.finish_reason == FinishReason.ABORT for s in run.sub.seqs.values())


def _usage(body: dict) -> tuple[int, int, int]:
    u = body.get("usage") or {}
    details = u.get("prompt_tokens_details") or {}
    return (int(u.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
            int(u.get("completion_tokens") or 0))


class BatchLines:
    """Checks and runs lines through the server's endpoints (one instance per server, over its `ServingContext`)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.endpoints = {"/v1/completions": BatchCompletion(ctx), "/v1/chat/completions": BatchChat(ctx),
                          "/v1/embeddings": BatchEmbedding(ctx)}

    async def _create(self, endpoint: str, line: Line, run: _LineRun, cancel: asyncio.Event | None) -> Response:
        token = _RUN.set(run)
        try:
            return await self.endpoints[endpoint].create(dict(line.body), _request(endpoint, cancel))
        finally:
            _RUN.reset(token)

    async def check(self, endpoint: str, line: Line, tenant: str | None) -> LineResult | None:
        """None if the line would be accepted by its endpoint, else its error line (the endpoint's own error)."""
        if line.error is not None:
            return refused(line, line.error)
        try:
            await self._create(endpoint, line, _LineRun(tenant, check_only=True), None)
        except _Checked:
            return None
        except ApiError as e:
            return refused(line, e)
        except Exception as e:  # noqa: BLE001 - a bug in one line's path must not stop the batch
            log.exception("checking batch line %d failed", line.number)
            return refused(line, ApiError(500, f"internal error: {type(e).__name__}", "internal_error",
                                          code="internal_error"))
        raise RuntimeError("a checked line got to the engine")  # the mixin stops every path at submit

    async def run(self, endpoint: str, line: Line, tenant: str | None, cancel: asyncio.Event) -> LineResult:
        """The line's answer (or the endpoint's error). Raises `Deferred` when there is none to keep."""
        if line.error is not None:
            return refused(line, line.error)
        run = _LineRun(tenant, check_only=False)
        try:
            resp = await self._create(endpoint, line, run, cancel)
        except ApiError as e:
            # the engine is gone, restarting or stopping (or died under this line): this line runs again later
            if e.status in (429, 503) or e.code == "engine_restarted" or aborted(run):
                raise Deferred(e.message) from None
            return refused(line, e)
        except Exception as e:  # noqa: BLE001 - a bug in one line's path must not stop the batch
            log.exception("batch line %d failed", line.number)
            return refused(line, ApiError(500, f"internal error: {type(e).__name__}", "internal_error",
                                          code="internal_error"))
        if resp.status_code == 499:  # "the client left": the batch was cancelled while the line ran
            raise Deferred("cancelled")
        if aborted(run):  # cut short (a shutdown, a cancel): a partial answer is never kept
            raise Deferred("aborted")
        text = bytes(resp.body).decode()
        usage = _usage(json.loads(text)) if resp.status_code == 200 else (0, 0, 0)
        return LineResult(line.number, line.custom_id, resp.status_code == 200,
                          answer_line(line.custom_id, resp.status_code, run.api_id or f"req_{uuid.uuid4().hex}",
                                      text), *usage)
