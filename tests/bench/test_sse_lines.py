"""The bench clients read SSE lines as SSE splits them (CR LF, CR, LF), not as str.splitlines does."""

from __future__ import annotations

import asyncio
import json

import httpx

from conveyor.bench.http_backend import sse_lines


def lines_of(pieces: list[bytes]) -> list[str]:
    async def stream():
        for p in pieces:
            yield p

    async def main() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream()))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://test/") as resp:
                return [line async for line in sse_lines(resp)]

    return asyncio.run(main())


def test_unicode_line_separators_stay_inside_their_line():
    text = "a\u2028b\x85c\u2029d"
    body = f"data: {json.dumps({'text': text}, ensure_ascii=False)}\n\ndata: [DONE]\n\n".encode()
    lines = lines_of([body])
    assert lines == [f"data: {json.dumps({'text': text}, ensure_ascii=False)}", "", "data: [DONE]", ""]
    assert json.loads(lines[0][6:])["text"] == text


def test_every_sse_line_end_and_pieces_cut_anywhere():
    body = b"data: 1\r\n\r\ndata: 2\r\rdata: 3\n\ndata: \xe2\x80\xa8x\r\n"
    want = ["data: 1", "", "data: 2", "", "data: 3", "", "data: \u2028x"]
    assert lines_of([body]) == want
    for cut in range(1, len(body)):  # a CR LF split over two pieces is still one line end
        assert lines_of([body[:cut], body[cut:]]) == want, cut
    assert lines_of([b"data: tail without end"]) == ["data: tail without end"]
