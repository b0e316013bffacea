"""The draft-model proposer for speculative decoding: a second, cheaper model guesses k tokens.

`{"method": "draft", "model": PATH}` takes any model with the target's vocabulary; `"model": "self"`
(the default) loads the target's own checkpoint again at `"quantization": "int4"` (the default for
self), which needs no second model at all and on a CPU decodes about twice as fast as bf16;
`"num_layers": N` keeps only the draft's first N layers (layer skip: the final norm and LM head
read the N-th layer's output).

The draft keeps its own paged KV cache in a second pool with its own block tables (no prefix
caching: a draft's KV is cheap to recompute). Per sequence it remembers how many leading tokens of
the sequence its cache holds; after each verification it keeps those and the guesses the target
accepted, so catching up costs one batched forward over the few new tokens, and guessing k tokens
costs k - 1 more single-token forwards, all batched across the sequences that speculate.

Guesses are the draft's argmax (a point mass), so the target's verification (`speculative.py`) keeps
the output distribution exact for sampled requests too.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from conveyor.config import EngineConfig
from conveyor.kv_cache.block_pool import BlockPool
from conveyor.model.attention import build_metadata
from conveyor.request import Request

log = logging.getLogger("conveyor.speculative")


class DraftProposer:
    def __init__(self, config: EngineConfig, model: str, quantization: str | None, num_blocks: int,
                 vocab_size: int, num_layers: int | None = None) -> None:
        from conveyor.model.loader import load_checkpoint
        from conveyor.runner.model_runner import ModelRunner

        ckpt = load_checkpoint(model, config.tokenizer)
        if num_layers is not None:  # layer skip: the first layers, then the final norm and the LM head
            if not 1 <= num_layers <= ckpt.config.num_layers:
                raise ValueError(f"speculative_config: num_layers must be in [1, {ckpt.config.num_layers}]")

            def keep(name: str) -> bool:
                return not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers

            ckpt.config = replace(ckpt.config, num_layers=num_layers)
            ckpt.tensors = ckpt.tensors.only(keep)
        if ckpt.config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({ckpt.config.vocab_size}) differs "
                             f"from the target's ({vocab_size})")
        draft_config = replace(config, model=model, quantization=quantization, num_kv_blocks=num_blocks,
                               kv_cache_memory=None, speculative_config=None)
        self.runner = ModelRunner(ckpt.config, ckpt.tensors, draft_config)
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.tables: dict[str, list[int]] = {}
        self.valid: dict[str, int] = {}  # leading tokens of the sequence whose draft KV is in the cache
        self.fed_guesses: dict[str, list[int]] = {}  # guesses fed after them (kept if the target accepts them)
        log.info("draft model %s (%s): %d KV blocks", model, self.runner.weight_dtype, num_blocks)

    def _forget(self, rid: str) -> None:
        table = self.tables.pop(rid, None)
        if table:
            self.pool.release(table)
        self.valid.pop(rid, None)
        self.fed_guesses.pop(rid, None)

    def _room(self, rid: str, num_tokens: int) -> bool:
        table = self.tables.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[Request, int]], live: set[str]) -> dict[str, list[int]]:
        """Guesses for each (request, how many) in `reqs`; `live`: every request id the engine still
        has (the draft's blocks of any other are returned first)."""
        for rid in [r for r in self.tables if r not in live]:
            self._forget(rid)
        runner = self.runner
        todo: list[tuple[Request, int, list[int], int]] = []  # request, k, tokens to feed, first position
        for req, k in reqs:
            rid = req.request_id
            tokens = req.all_token_ids
            valid = self.valid.get(rid, 0)
            for g in self.fed_guesses.get(rid, ()):  # guesses the target went on to accept are real now
                if valid < len(tokens) - 1 and tokens[valid] == g:
                    valid += 1
                else:
                    break
            valid = min(valid, len(tokens) - 1)
            if not self._room(rid, len(tokens) + k - 1):
                self._forget(rid)
                continue
            todo.append((req, k, tokens[valid:], valid))
        out: dict[str, list[int]] = {req.request_id: [] for req, *_ in todo}
        want = {req.request_id: k for req, k, _, _ in todo}
        feeds = [(req, feed, pos) for req, _, feed, pos in todo]
        for step in range(max(want.values(), default=0)):
            if not feeds:
                break
            ids, positions, qlens, clens, tables = [], [], [], [], []
            for req, feed, pos in feeds:
                ids.extend(feed)
                positions.extend(range(pos, pos + len(feed)))
                qlens.append(len(feed))
                clens.append(pos + len(feed))
                tables.append(self.tables[req.request_id])
            meta = build_metadata(qlens, clens, tables, self.block_size, runner.device, runner.attention_backend)
            dev = runner.device
            hidden = runner.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), runner.kv_caches,
                                  meta)
            last = torch.tensor([sum(qlens[:i + 1]) - 1 for i in range(len(qlens))], device=runner.device)
            guesses = runner.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
            nxt = []
            for (req, feed, pos), g in zip(feeds, guesses):
                rid = req.request_id
                out[rid].append(g)
                if step == 0:
                    self.valid[rid] = pos + len(feed)
                    self.fed_guesses[rid] = []
                else:
                    self.fed_guesses[rid].append(feed[0])
                if len(out[rid]) < want[rid]:
                    nxt.append((req, [g], pos + len(feed)))
            feeds = nxt
        return out
