"""Structured outputs in the engine: one grammar matcher per sequence, one token bitmask per step.

Each step, every sampling sequence that has a grammar gets its row of allowed tokens (a packed
bitmask, 32 tokens per int32, computed by llguidance's Rust matcher from the tokens it has
accepted so far); the sampler sets everything else to -inf, so greedy and random sampling alike can
only pick a token that keeps the output inside the grammar. After sampling, the matcher consumes
the token; when the grammar is complete it allows only EOS, and a matcher that has stopped ends
its sequence with finish_reason "stop".

Compiling a grammar (a JSON schema into a lexer and parser over this tokenizer's vocabulary) costs
milliseconds to seconds, so compiled matchers are cached by grammar and each sequence takes a
copy. The llguidance view of the tokenizer (~0.3 s to build for a 49k vocabulary) is built on the
first structured request, so servers that never see one pay nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from conveyor.runner.grammar_mask import GrammarMask

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from conveyor.request import Request
    from conveyor.sampling_params import StructuredOutputsParams

log = logging.getLogger("conveyor.structured")


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 128) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar -> fresh matcher (LRU)
        self.cache_size = cache_size
        self.compiled_count = 0  # grammars compiled (cache misses), for tests and logs

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        if self._ll_tokenizer is None:
            import llguidance.hf

            # the model's vocabulary size, not the tokenizer's: the mask must cover every logit, and
            # ids the tokenizer does not know stay banned
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher for one sequence (a copy of the cached compiled one)."""
        from llguidance import LLMatcher

        base = self._compiled.get(params.spec)
        if base is None:
            base = LLMatcher(self.ll_tokenizer, params.spec, log_level=0)
            if base.is_error():
                raise ValueError(f"structured_outputs: invalid {params.kind}: {base.get_error()}")
            self.compiled_count += 1
            self._compiled[params.spec] = base
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(params.spec)
        return base.deep_copy()

    def bitmask(self, reqs: list[Request]) -> GrammarMask | None:
        """The allowed tokens of every row in `reqs` that has a grammar; None when none has (the
        common case costs one scan of the batch)."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        mask = torch.empty((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        row_bytes = mask.shape[1] * 4
        ptr = mask.data_ptr()
        for j, i in enumerate(rows):  # (not llguidance.torch: importing it pulls in torch.compile, ~1 s)
            reqs[i].matcher.unsafe_compute_mask_ptr(ptr + j * row_bytes, row_bytes)
        return GrammarMask(rows, mask)

    @staticmethod
    def accept(req: Request, token: int) -> bool:
        """Advance `req`'s matcher by its sampled `token`; True when the grammar is finished (the
        sequence should stop). A token the grammar refuses (possible only when something else, such
        as min_tokens, overrode the mask) also ends the sequence, with a warning, rather than let
        it continue unconstrained."""
        m = req.matcher
        if not m.consume_token(token):
            log.warning("request %s: sampled token %d outside its grammar (%s); stopping it",
                        req.request_id, token, m.get_error().splitlines()[0] if m.get_error() else "")
            return True
        return m.is_stopped()
