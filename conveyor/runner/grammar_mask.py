"""The runner's view of structured outputs: which tokens each masked row of a step's logits may take.

The engine's `StructuredOutputManager` (conveyor/engine/structured_output.py) fills one per step from its
grammar matchers; the runner and the sampler only apply it, so the mask lives here, below the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarMask:
    """Allowed tokens for some rows of a step's logits: `bits[j]` packs row `rows[j]`'s vocabulary,
    32 tokens per int32 (bit t % 32 of word t // 32), as llguidance and xgrammar lay it out."""

    rows: list[int]
    bits: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """Set every logit of a masked row whose bit is 0 to -inf, in place (the compiled kernel on
        CPU, else `apply_reference`)."""
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            from conveyor import kernels

            ops = kernels.load()
            if ops is not None:
                ops.apply_token_bitmask_(logits, self.bits, torch.tensor(self.rows, dtype=torch.long))
                return
        self.apply_reference(logits)

    def apply_reference(self, logits: torch.Tensor) -> None:
        """The pure-torch path: unpack the bits, then one masked_fill."""
        v = logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((self.bits[:, :, None] >> shifts) & 1).reshape(len(self.rows), -1)[:, :v].bool()
        idx = torch.tensor(self.rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
