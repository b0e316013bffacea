"""The KV pool at a glance, for the dashboard: each block's state, summed into at most `max_cells` cells.

Read between steps on the engine's side (the loop answers a `SnapshotKV` with one), so only a few KB
cross to the server whatever the pool's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conveyor.kv_cache.block_pool import BlockPool


@dataclass(frozen=True)
class KVMap:
    """The pool's blocks as state codes (0 free, 1 cached and evictable, 2 in use, 3 shared by several
    sequences), one byte per cell of `blocks_per_cell` blocks, plus exact totals per state."""

    num_blocks: int
    blocks_per_cell: int
    cells: bytes
    totals: tuple[int, int, int, int]


def kv_map(pool: BlockPool, max_cells: int = 4096) -> KVMap:
    """`pool` in at most `max_cells` cells: each cell is the most common state of its blocks (ties go to the
    busier state)."""
    codes = pool.state_codes()
    n = len(codes)
    group = -(-n // max_cells)
    if group > 1:
        padded = np.zeros(-(-n // group) * group, dtype=np.uint8)
        padded[:n] = codes
        counts = np.stack([(padded.reshape(-1, group) == c).sum(1) for c in range(4)], axis=1)
        counts[-1, 0] -= padded.size - n  # the padding is not free blocks
        cells = (3 - counts[:, ::-1].argmax(1)).astype(np.uint8)  # ties go to the busier state
    else:
        cells = codes
    totals = np.bincount(codes, minlength=4)
    return KVMap(n, group, cells.tobytes(), tuple(int(x) for x in totals))
