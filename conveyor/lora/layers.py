"""The batched LoRA step: the base matmul once for every row, then the low-rank products per adapter.

A step's rows are grouped by adapter (the engine orders a step's items by adapter id, so each
adapter's rows form one contiguous segment; unordered rows only make more segments). For a fused
linear `y = x W^T` and each segment [s, e) of adapter a:

    y[s:e] += (x[s:e] @ A_a^T) @ B_a^T          shrink to the rank, then expand

which is S-LoRA's / Punica's SGMV (segmented gather matrix-vector) done with two dense matmuls per
segment: no weight is ever merged, no forward runs per adapter, and rows without an adapter are in
no segment, so they cost nothing. conveyor fuses q/k/v and gate/up into one linear each
(`conveyor/model/llama.py`); a fused linear's adapters are stacked to match: the projections'
A matrices are concatenated along the rank ([r_q + r_k + r_v, in]) and their B matrices placed
block-diagonally ([out_q + out_k + out_v, r_q + r_k + r_v], zero where a projection is not
adapted), so one shrink and one expand cover all of them and each projection's delta lands on its
own output columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The current step's segments, shared by every `LoRALinear` of a model: (adapter id, first row,
    end row). Empty outside a step and in steps without adapter rows."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)


def segments_for(lora_ids: list[int | None], row_counts: list[int]) -> list[tuple[int, int, int]]:
    """Merge consecutive items of the same adapter into (id, start, end) row ranges; rows of items
    without an adapter (None) are left out."""
    segs: list[tuple[int, int, int]] = []
    row = 0
    for lid, n in zip(lora_ids, row_counts):
        if lid is not None and n:
            if segs and segs[-1][0] == lid and segs[-1][2] == row:
                segs[-1] = (lid, segs[-1][1], row + n)
            else:
                segs.append((lid, row, row + n))
        row += n
    return segs


class LoRALinear(nn.Module):
    """A base linear (packed, quantized or plain) plus the low-rank deltas of every loaded adapter.

    `parts` names the projections fused in `base` with their output widths, in output order, e.g.
    [("q_proj", 576), ("k_proj", 192), ("v_proj", 192)] for a fused qkv."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.out_features = sum(n for _, n in parts)
        self.batch = batch
        # adapter id -> (A [R, in], B [out, R]) with R the sum of the adapted parts' ranks
        self.stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, adapter_id: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install one adapter's (A, B) per projection (scaling already in B); parts it leaves out stay
        unadapted. Nothing is installed when it adapts none of this linear's parts."""
        if not pairs:
            return
        a_list, blocks, offset, rank = [], [], 0, 0
        for part, width in self.parts:
            if part in pairs:
                a, b = pairs[part]
                a_list.append(a)
                blocks.append((offset, rank, b))
                rank += a.shape[0]
            offset += width
        a_cat = torch.cat(a_list).contiguous()
        b_bd = a_cat.new_zeros(self.out_features, rank)
        for out0, r0, b in blocks:
            b_bd[out0:out0 + b.shape[0], r0:r0 + b.shape[1]] = b
        self.stacked[adapter_id] = (a_cat, b_bd)

    def remove(self, adapter_id: int) -> None:
        self.stacked.pop(adapter_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for lid, s, e in self.batch.segments:
            w = self.stacked.get(lid)
            if w is not None:
                a, b = w
                y[s:e].addmm_(torch.mm(x[s:e], a.t()), b.t())
        return y

    def reference(self, x: torch.Tensor, lora_ids: list[int | None]) -> torch.Tensor:
        """Row by row in fp32, each projection's delta from its own (A, B): what `forward` must equal."""
        y = self.base(x).float()
        out = []
        for i, lid in enumerate(lora_ids):
            row = y[i].clone()
            if lid is not None and lid in self.stacked:
                a, b = self.stacked[lid]
                row += b.float() @ (a.float() @ x[i].float())
            out.append(row)
        return torch.stack(out)
