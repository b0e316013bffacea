"""Which replica serves a request: least-loaded, or prefix-aware with a load margin.

A replica only has a prompt's prefix cached if it served that prefix before, so the prefix router
sends each request where its longest prefix went last. Prefixes are matched on the request's
text, cut into fixed blocks of characters and hashed as a chain (each block's hash covers every
block before it), the way SGLang's router and Ray's prefix-affinity router match on text: no
tokenizer is needed in the ingress, and two prompts that share their first k text blocks share
(roughly) their first k KV blocks on the replica.

Affinity must not pile every request on one replica: if the replica holding the prefix carries
more than `imbalance` sequences above the least-loaded live replica, the request goes to the
least-loaded one instead (and that replica becomes the prefix's new home). This module is pure
bookkeeping, with no Ray in it, so it is tested on its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROUTERS = ("prefix", "least-loaded")


def prefix_text(path: str, body: dict | None) -> str | None:
    """The text whose prefix decides affinity: the prompt, or the chat messages in order (None: no text)."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\x1f{content or ''}\x1e")
        return "".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else " ".join(map(str, prompt))
    if isinstance(prompt, list):  # a list of token-id lists: the first one
        prompt = " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) and prompt else None


def block_hashes(text: str, chars_per_block: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the text's whole blocks (a partial last block is not matched)."""
    out, h = [], b""
    for i in range(min(len(text) // chars_per_block, max_blocks)):
        h = hashlib.blake2b(h + text[i * chars_per_block:(i + 1) * chars_per_block].encode(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class Decision:
    replica: int
    reason: str  # prefix_hit | prefix_overloaded | least_loaded
    matched_blocks: int = 0


class Router:
    """Picks a replica from per-replica loads (None: the replica is down).

    `policy` "least-loaded": the live replica with the fewest sequences (ties: the lowest index
    after the last pick, so equal replicas take turns). "prefix": the replica that last served
    the longest matching prefix, unless it is down or `imbalance` sequences busier than the
    least-loaded one; then least-loaded. Either way the prefix's blocks are recorded for the
    chosen replica, in a table of at most `table_size` blocks (least recently used go first).
    """

    def __init__(self, num_replicas: int, policy: str = "prefix", chars_per_block: int = 64, max_blocks: int = 64,
                 imbalance: float = 32.0, table_size: int = 200_000) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {policy!r}")
        self.n = num_replicas
        self.policy = policy
        self.chars_per_block = chars_per_block
        self.max_blocks = max_blocks
        self.imbalance = imbalance
        self.table_size = table_size
        self.table: OrderedDict[bytes, int] = OrderedDict()
        self._turn = 0

    def least_loaded(self, loads: Sequence[float | None]) -> int | None:
        """The live replica with the fewest sequences; ties: the first at or after the turn (not advanced here)."""
        live = [i for i in range(self.n) if loads[i] is not None]
        if not live:
            return None
        best = min(loads[i] for i in live)
        tied = [i for i in live if loads[i] == best]
        return next((i for i in tied if i >= self._turn), tied[0])

    def _take(self, decision: Decision) -> Decision:
        if decision.reason != "prefix_hit":  # equal replicas take turns among the requests load decides
            self._turn = (decision.replica + 1) % self.n
        return decision

    def pick(self, text: str | None, loads: Sequence[float | None]) -> Decision | None:
        """The replica for a request with prompt text `text`; None when every replica is down."""
        fallback = self.least_loaded(loads)
        if fallback is None:
            return None
        if self.policy != "prefix" or not text:
            return self._take(Decision(fallback, "least_loaded"))
        hashes = block_hashes(text, self.chars_per_block, self.max_blocks)
        home, matched = None, 0
        for k in range(len(hashes), 0, -1):  # the longest prefix with a home
            home = self.table.get(hashes[k - 1])
            if home is not None:
                matched = k
                break
        if home is None:
            decision = Decision(fallback, "least_loaded")
        elif loads[home] is None or loads[home] > loads[fallback] + self.imbalance:
            decision = Decision(fallback, "prefix_overloaded", matched)
        else:
            decision = Decision(home, "prefix_hit", matched)
        for h in hashes:
            self.table[h] = decision.replica
            self.table.move_to_end(h)
        while len(self.table) > self.table_size:
            self.table.popitem(last=False)
        return self._take(decision)
