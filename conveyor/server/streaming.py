"""Streaming an answer as server-sent events, written once for every streaming endpoint.

`stream_events` is the skeleton: it runs a submission's deltas through the endpoint's `StreamFormat`
(which turns them into events) and owns everything a stream must get right whatever its events look like:
- a failure tied to this request alone (`StepDelta.error`) becomes an in-band error event, and the stream ends;
- the request's deadline (`--request-timeout`), an engine that dies mid-answer (500 `engine_restarted` while
  it restarts) and a drain whose time runs out (`server_shutdown`) become error events too;
- the token counts (completion tokens, prompt tokens served from the prefix cache) for a final usage event;
- `finally`: the submission is closed however the stream ends (its unfinished sequences are aborted and
  their KV blocks freed), then the format's last events (`[DONE]` for completions and chat).
`SSEResponse` sends it, watching for the client leaving on every server. A format names its own events:
chat and completions send `data:` lines only; an endpoint with named events (OpenAI's Responses API:
`event: response.output_text.delta`) passes `event=` to `sse_event` and sends no `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.engine.clients import EngineDeadError
from conveyor.outputs import StepDelta
from conveyor.server import protocol as P
from conveyor.server.async_engine import Submission
from conveyor.server.http import engine_error

DONE = "data: [DONE]\n\n"

# SSE breaks lines only at CR and LF, but many clients split a stream with str.splitlines() (httpx's
# aiter_lines among them), which also breaks at U+0085, U+2028 and U+2029: a token holding one of them
# cut its chunk in two. JSON may escape any character, so these three are always sent escaped.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(obj: BaseModel | dict, event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (after an `event: <name>` line when the endpoint names its events)."""
    body = obj.model_dump_json(exclude_unset=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {body.translate(_UNICODE_LINE_BREAKS)}\n\n"


def request_failed_body(message: str) -> dict:
    """A failure tied to one request (its text, its grammar, non-finite logits in its row): OpenAI's 500 shape."""
    return P.error_body(f"the request failed in the engine: {message}", "internal_error", code="request_failed")


def stream_error_body(e: BaseException) -> dict:
    """What an exception that ends a stream says in-band: the engine's error as a plain answer would say it
    (`engine_error`: it died and is restarting, the drain's time ran out, it is dead for good), or something
    that failed here."""
    if isinstance(e, EngineDeadError):
        return engine_error(e).body()
    return P.error_body(f"internal error: {e!r}", "internal_error", code="internal_error")


@dataclass
class StreamCounts:
    """What a stream has produced so far, for its usage event."""

    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (counted once per prompt)

    def add(self, d: StepDelta) -> None:
        self.completion_tokens += len(d.new_token_ids)
        if d.finished and d.index == 0:
            self.cached_tokens += d.num_cached_tokens


class StreamFormat:
    """How one endpoint writes its stream; `stream_events` calls these in order. Each returns the events
    (whole SSE strings) to send, possibly none."""

    def start(self) -> Iterable[str]:
        """Before any delta (chat's role chunks, completions' echo)."""
        return ()

    def delta(self, d: StepDelta) -> Iterable[str]:
        """One delta of one sequence."""
        raise NotImplementedError

    def finish(self, counts: StreamCounts) -> Iterable[str]:
        """After the last delta (or after a request's own error event): usage, if the client asked for it."""
        return ()

    def error(self, body: dict) -> str:
        """An error in-band (`body`: OpenAI's error object); the stream ends after it."""
        return sse_event(body)

    def end(self) -> Iterable[str]:
        """The very last events, however the stream ended."""
        return (DONE,)


async def stream_events(sub: Submission, deltas: AsyncIterator[StepDelta], fmt: StreamFormat,
                        timeout_body: Callable[[], dict]) -> AsyncIterator[str]:
    """The stream of one submission: `deltas` (the submission's, until its deadline) through `fmt`.
    `timeout_body`: the error the deadline's TimeoutError becomes (--request-timeout)."""
    counts = StreamCounts()
    try:
        for ev in fmt.start():
            yield ev
        async for d in deltas:
            if d.error:  # this request failed alone: say so in-band and end the stream
                yield fmt.error(request_failed_body(d.error))
                break
            counts.add(d)
            for ev in fmt.delta(d):
                yield ev
        for ev in fmt.finish(counts):
            yield ev
    except (TimeoutError, asyncio.TimeoutError):  # --request-timeout: abort (finally) and say so in-band
        yield fmt.error(timeout_body())
    except Exception as e:  # the engine died mid-stream: tell the client in-band
        yield fmt.error(stream_error_body(e))
    finally:
        sub.close()
    for ev in fmt.end():
        yield ev


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client leaving, and always runs `on_close`.

    Starlette only listens for disconnects on ASGI < 2.4; this does it on every server, and runs
    `on_close` even if the body iterator was cancelled before it started, so no request is leaked.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
