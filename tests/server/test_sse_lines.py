"""A streamed chunk is one line for every client, including those that split with str.splitlines()."""

from __future__ import annotations

import json

from pydantic import BaseModel

from conveyor.server.streaming import sse_event

TRICKY = "a\u2028b\x85c\u2029d\x1ce\x0bf\rg\nh"  # every character str.splitlines() breaks at


class Chunk(BaseModel):
    text: str


def test_a_chunk_is_one_line_whatever_its_text_holds():
    for obj in (Chunk(text=TRICKY), {"text": TRICKY}):
        event = sse_event(obj)
        assert event.endswith("\n\n")
        lines = [line for line in event.splitlines() if line]
        assert len(lines) == 1, lines  # httpx's aiter_lines() cut such chunks in two (seen in the soak test)
        assert json.loads(lines[0][len("data: "):])["text"] == TRICKY
