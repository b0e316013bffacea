"""Detokenize new tokens incrementally and decide whether a sequence is done.

`tokenizers`' DecodeStream holds back bytes until they form whole UTF-8 characters, so a
streamed emoji or CJK character is never split. Stop strings are searched in the new text plus
a little of the old; while a sequence runs, the last `max_stop_len - 1` characters are held back
from streaming so that a stop string is never half-sent.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from conveyor.outputs import StepDelta
from conveyor.request import Request

_PREFILL_CONTEXT = 8  # prompt tokens fed to the decoder so the first word gets its leading space


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self.streams: dict[str, DecodeStream] = {}
        self.emitted: dict[str, int] = {}  # characters of output_text already streamed

    def _stream(self, req: Request) -> DecodeStream:
        ds = self.streams.get(req.request_id)
        if ds is None:
            ctx = req.prompt_token_ids[-_PREFILL_CONTEXT:]
            try:
                ds = DecodeStream(ids=ctx, skip_special_tokens=req.params.skip_special_tokens)
            except TypeError:  # older tokenizers: no prefill
                ds = DecodeStream(skip_special_tokens=req.params.skip_special_tokens)
            self.streams[req.request_id] = ds
            self.emitted[req.request_id] = 0
        return ds

    def decode_token(self, req: Request, token: int) -> str:
        piece = self._stream(req).step(self.backend, token)
        return piece or ""

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.emitted.pop(request_id, None)

    def take_new_text(self, req: Request, final: bool) -> str:
        start = self.emitted.get(req.request_id, 0)
        end = len(req.output_text)
        if not final and req.params.stop_list:
            end = max(start, end - (max(len(s) for s in req.params.stop_list) - 1))
        self.emitted[req.request_id] = end
        return req.output_text[start:end]


def check_stop(req: Request, token: int, new_text: str, max_model_len: int) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if `req` is done after `token`, else None. Truncates text at a stop string."""
    p = req.params
    n_out = len(req.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if p.stop_list and new_text:
            longest = max(len(s) for s in p.stop_list)
            text = req.output_text
            search_from = max(0, len(text) - len(new_text) - longest + 1)
            best = None
            for s in p.stop_list:
                i = text.find(s, search_from)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                req.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
                return "stop", s
    if n_out >= req.max_tokens:
        return "length", None
    if req.num_tokens >= max_model_len:
        return "length", None
    return None


def make_delta(req: Request, new_tokens: list[int], new_text: str, logprob: dict | None) -> StepDelta:
    return StepDelta(
        request_id=req.request_id,
        group_id=req.group_id,
        index=req.index,
        new_token_ids=new_tokens,
        new_text=new_text,
        new_logprobs=[logprob] if logprob is not None else None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
    )
