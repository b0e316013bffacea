"""The HTTP rules every front door of conveyor keeps, written once: the single server (`api_server.py`) and
the Ray ingress (`conveyor/scaleout/ingress.py`) both use them, so a rule cannot drift between the two.

- errors: `ApiError` becomes OpenAI's `{"error": {...}}` body with its status (`bad_request`: a 400;
  `engine_error`: the answer to a call the engine cannot serve, with `Retry-After` where asking again soon
  can succeed);
- keys: `ApiKeys` (`--api-key k1,k2`: any of the keys, compared in constant time) on the bearer token
  (`bearer_token`, the one parser of `Authorization: Bearer ...`);
- bodies: `read_body` (413 past the limit, after reading the rest so that the client sees the answer
  rather than a reset) and `read_json` (400 unless the body is a JSON object);
- disconnects: `wait_disconnect` returns when the client has gone;
- headers: `forwarded_headers`, what an ingress passes on to the server behind it (everything a request
  carries end to end, so that rules reading headers, like `--tenant-key header:NAME` or `api-key`, see
  the same request behind `--replicas` as on one server).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse

from conveyor.server import protocol as P

# hop-by-hop headers (RFC 9110 7.6.1) and the ones the next hop sets itself: never passed on
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                            "transfer-encoding", "upgrade", "host", "content-length"})


class ApiError(Exception):
    """An error that becomes OpenAI's {"error": {...}} body with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return P.error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def engine_error(e: Exception) -> ApiError:
    """The answer to a call the engine cannot serve, as the error says: `EngineDeadError` (503 `engine_dead`)
    or one of the supervisor's subclasses (`conveyor/server/async_engine.py`), which carry their `status`,
    OpenAI's error `error_type` and `code`, and `retry_after` seconds: 503 `loading` while the engine restarts,
    503 `draining` while the server drains (both with `Retry-After`), 500 `engine_restarted` for a call the
    engine died under, 503 `server_shutdown` for one the drain's time ran out on."""
    retry = getattr(e, "retry_after", None)
    return ApiError(getattr(e, "status", 503), str(e), getattr(e, "error_type", "service_unavailable"),
                    code=getattr(e, "code", "engine_dead"),
                    headers={"Retry-After": str(retry)} if retry is not None else None)


def bearer_token(headers: Mapping[str, str]) -> str:
    """The token of `Authorization: Bearer <token>` ("" when there is none)."""
    auth = headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else ""


class ApiKeys:
    """`--api-key`: one key, or several separated by commas (`--tenant-key api-key` tells tenants apart by
    key). Empty or None: no check."""

    def __init__(self, spec: str | None) -> None:
        self.enabled = bool(spec)
        self.keys = [k.encode() for k in (spec or "").split(",") if k]

    def __bool__(self) -> bool:
        return self.enabled

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the keys (each compared in constant time, all of them every time)."""
        given = token.encode()
        return any([hmac.compare_digest(given, k) for k in self.keys])

    def check(self, request: Request) -> None:
        """A 401 unless the request brings one of the keys (nothing to check without keys)."""
        if self.enabled and not self.accepts(bearer_token(request.headers)):
            raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes: a 413 past `limit`. A body up to 16x the limit is read (and dropped) first, so the
    client sees this answer, not a reset; one declared or found larger than that is cut short."""
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > 16 * limit:
        raise _too_large(limit)
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
        elif size > 16 * limit:
            break
    if size > limit:
        raise _too_large(limit)
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past `limit` bytes, 400 unless it parses to an object."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone (its `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers an ingress passes on with a request: all of them but the hop-by-hop ones."""
    return [(k, v) for k, v in headers if k.lower() not in _NOT_FORWARDED]
