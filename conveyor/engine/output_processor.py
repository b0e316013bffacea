"""Detokenize new tokens incrementally, decide whether a sequence is done, and assemble outputs.

Stop handling lives here in one place (`apply_stop`), and so does output assembly: a
`RequestOutputBuilder` turns a request's stream of `StepDelta`s into the `RequestOutput` that
`LLM.generate` returns and the server's non-streaming responses are built from.

`tokenizers`' DecodeStream holds back bytes until they form whole UTF-8 characters, so a
streamed emoji or CJK character is never split. Stop strings are searched in the new text plus
a little of the old; while a sequence runs, the last `max_stop_len - 1` characters are held back
from streaming so that a stop string is never half-sent.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from conveyor.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput, StepDelta
from conveyor.request import Request, sequence_ids

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

    def flush(self, req: Request, drop_last: bool) -> None:
        """At the end of a sequence: text the stream still holds back (bytes after an invalid or
        incomplete character wait for a completion that will not come) is appended if the whole
        output decodes to an extension of what was emitted. `drop_last`: the last token is a stop
        token whose text is not part of the output."""
        ids = req.output_token_ids[:-1] if drop_last else req.output_token_ids
        full = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        if len(full) > len(req.output_text) and full.startswith(req.output_text):
            req.output_text = full

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


StopDecision = tuple[FinishReason, int | str | None]  # (finish_reason, stop_reason)


def check_stop(req: Request, token: int, new_text: str, max_model_len: int,
               n_out: int | None = None) -> StopDecision | None:
    """(finish_reason, stop_reason) if `req` is done after `token`, its `n_out`-th output token (default:
    its last), else None. Truncates text at a stop string."""
    p = req.params
    if n_out is None:
        n_out = len(req.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
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
                return FinishReason.STOP, s
    if n_out >= req.max_tokens:
        return FinishReason.LENGTH, None
    if len(req.prompt_token_ids) + n_out >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def apply_stop(req: Request, token: int, piece: str, max_model_len: int,
               n_out: int | None = None) -> StopDecision | None:
    """Append `token`'s text (`req`'s `n_out`-th output token, default: its last) to the output and decide
    whether `req` stops: (finish_reason, stop_reason) or None. Trims a stop string (unless it is to be
    included) and, as vLLM does, the text of a stop token (EOS or `stop_token_ids`)."""
    req.output_text += piece
    stop = check_stop(req, token, piece, max_model_len, n_out)
    if stop is not None and stop[0] is FinishReason.STOP and not isinstance(stop[1], str) and piece \
            and not req.params.include_stop_str_in_output:
        req.output_text = req.output_text[: len(req.output_text) - len(piece)]
    return stop


def make_delta(req: Request, new_tokens: list[int], new_text: str, logprobs: list[dict] | None) -> StepDelta:
    delta = StepDelta(
        request_id=req.request_id,
        group_id=req.group_id,
        index=req.index,
        new_token_ids=new_tokens,
        new_text=new_text,
        new_logprobs=logprobs or None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
    )
    if req.finish_reason is not None:  # a sequence's last delta carries what the caller's metrics need
        delta.first_scheduled_time = req.first_scheduled_time
        delta.num_cached_tokens = req.num_cached_tokens
        delta.num_preemptions = req.num_preemptions
    return delta


class RequestOutputBuilder:
    """Accumulates one request's deltas (all n of its sequences) into a `RequestOutput`."""

    def __init__(self, request_id: str, n: int, prompt: str | None, prompt_token_ids: list[int],
                 logprobs: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.outputs = {sid: CompletionOutput(index=i, text="", token_ids=[],
                                              cumulative_logprob=0.0 if logprobs else None,
                                              logprobs=[] if logprobs else None)
                        for i, sid in enumerate(sequence_ids(request_id, n))}
        self.metrics: RequestMetrics | None = None
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served (the first sequence's)
        self.prompt_logprobs: list | None = None
        self._text: dict[str, list[str]] = {sid: [] for sid in self.outputs}

    def add(self, d: StepDelta) -> None:
        out = self.outputs[d.request_id]
        if d.index == 0 and d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        out.token_ids.extend(d.new_token_ids)
        self._text[d.request_id].append(d.new_text)
        if d.new_logprobs and out.logprobs is not None:
            out.logprobs.extend(d.new_logprobs)
            for lp, tok in zip(d.new_logprobs, d.new_token_ids):
                out.cumulative_logprob += lp.get(tok, 0.0)
        if d.finished:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
            if d.index == 0:
                self.num_cached_tokens = d.num_cached_tokens

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs.values())

    def build(self) -> RequestOutput:
        for sid, out in self.outputs.items():
            out.text = "".join(self._text[sid])
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=list(self.outputs.values()), finished=self.finished, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)


def request_metrics(reqs: list[Request]) -> RequestMetrics:
    """Timestamps and counts of a request's sequences, for `RequestOutput.metrics`."""
    r0 = reqs[0]
    return RequestMetrics(r0.arrival_time, r0.first_scheduled_time, r0.first_token_time,
                          max((r.last_token_time or 0) for r in reqs) or None,
                          max((r.finished_time or 0) for r in reqs) or None,
                          r0.num_cached_tokens, sum(r.num_preemptions for r in reqs))
