"""The batched LoRA step: the base matmul once for every row, then the low-rank products per adapter.

A step's rows are grouped by adapter (the engine orders a step's items by adapter id, so each
adapter's rows form one contiguous segment; unordered rows only make more segments). For a fused
linear `y = x W^T` and each segment [s, e) of adapter a:

    y[s:e] += (x[s:e] @ A_a^T) @ B_a^T          shrink to the rank, then expand

which is S-LoRA's / Punica's SGMV (segmented gather matrix-vector): no weight is ever merged, no
forward runs per adapter, and rows without an adapter are in no segment, so they cost nothing.
conveyor fuses q/k/v and gate/up into one linear each (`conveyor/model/llama.py`); a fused linear's
adapters are stacked to match: the projections' A matrices are concatenated along the rank
([r_q + r_k + r_v, in], as peft stores A: the kernel's shrink is a dot product over its rows) and their B
matrices placed block-diagonally and transposed (Bt [r_q + r_k + r_v, out_q + out_k + out_v], zero where
a projection is not adapted), so one shrink and one expand cover all of them and each projection's delta
lands on its own output columns; the kernel reads only the non-zero blocks, listed beside them.

Two paths compute the same thing: the compiled CPU kernel (`kernels/csrc/lora_sgmv.cpp`: one call per
linear for every segment, fp32 accumulation, only Bt's non-zero blocks read) where the kernels are built
and the dtype is fp32 or bf16, and the torch reference (two matmuls per segment) everywhere else, or with
`CONVEYOR_LORA_KERNEL=0`. The kernel takes every segment, short (decodes) or long (prefills): a row's
result then never depends on how many other rows share its adapter in the step (batch invariance).
tests/lora/test_lora_parity.py checks both paths against a row-by-row reference and each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The current step's segments, shared by every `LoRALinear` of a model: (adapter id, first row,
    end row), and their row ranges as an int64 [S, 2] tensor for the kernel. Empty outside a step and in
    steps without adapter rows."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    ranges: torch.Tensor | None = None

    def set(self, segments: list[tuple[int, int, int]]) -> None:
        self.segments = segments
        self.ranges = torch.tensor([[s, e] for _, s, e in segments], dtype=torch.long) if segments else None


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


def sgmv_kernel(dtype: torch.dtype, device: torch.device):
    """The compiled `lora_sgmv_` op where it applies here, else None (the torch path runs)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("CONVEYOR_LORA_KERNEL", "1") == "0":
        return None
    from conveyor import kernels

    k = kernels.load()
    return getattr(k, "lora_sgmv_", None) if k is not None else None


_NONE = (torch.empty(0), torch.empty(0), torch.empty(0, 4, dtype=torch.long))  # a segment of an adapter a linear lacks


class LoRALinear(nn.Module):
    """A base linear (packed, quantized or plain) plus the low-rank deltas of every loaded adapter.

    `parts` names the projections fused in `base` with their output widths, in output order, e.g.
    [("q_proj", 576), ("k_proj", 192), ("v_proj", 192)] for a fused qkv."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], batch: LoRABatch, kernel=None) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.out_features = sum(n for _, n in parts)
        self.batch = batch
        self.kernel = kernel  # the compiled op, or None: torch
        # adapter id -> (A [R, in], Bt [R, out], blocks) with R the sum of the adapted parts' ranks and
        # blocks int64 [P, 4]: Bt's non-zero blocks (first rank row, rank rows, first column, columns)
        self.stacked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def add(self, adapter_id: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install one adapter's (A [r, in], B [out, r]) per projection (scaling already in B); parts it
        leaves out stay unadapted. Nothing is installed when it adapts none of this linear's parts."""
        if not pairs:
            return
        a_list, b_list, blocks, offset, rank = [], [], [], 0, 0
        for part, width in self.parts:
            if part in pairs:
                a, b = pairs[part]
                a_list.append(a)
                b_list.append(b)
                blocks.append((rank, a.shape[0], offset, width))
                rank += a.shape[0]
            offset += width
        a = torch.cat(a_list).contiguous()
        bt = a.new_zeros(rank, self.out_features)
        for (r0, rn, o0, on), b in zip(blocks, b_list):
            bt[r0:r0 + rn, o0:o0 + on] = b.t()
        self.stacked[adapter_id] = (a, bt, torch.tensor(blocks, dtype=torch.long))

    def remove(self, adapter_id: int) -> None:
        self.stacked.pop(adapter_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segs = self.batch.segments
        if not segs:
            return y
        if self.kernel is not None and y.dtype == x.dtype and x.is_contiguous() and y.is_contiguous():
            got = [self.stacked.get(lid, _NONE) for lid, _, _ in segs]
            self.kernel(y, x, self.batch.ranges, [w[0] for w in got], [w[1] for w in got], [w[2] for w in got])
            return y
        return self.torch_deltas(x, y, segs)

    def torch_deltas(self, x: torch.Tensor, y: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """The reference path: two matmuls per segment, added in place."""
        for lid, s, e in segments:
            w = self.stacked.get(lid)
            if w is not None:
                a, bt, _ = w
                y[s:e].addmm_(torch.mm(x[s:e], a.t()), bt)
        return y

    def reference(self, x: torch.Tensor, lora_ids: list[int | None]) -> torch.Tensor:
        """Row by row in fp32, each row's delta from its adapter's weights: what both paths must equal."""
        y = self.base(x).float()
        out = []
        for i, lid in enumerate(lora_ids):
            row = y[i].clone()
            if lid is not None and lid in self.stacked:
                a, bt, _ = self.stacked[lid]
                row += (x[i].float() @ a.float().t()) @ bt.float()
            out.append(row)
        return torch.stack(out)
