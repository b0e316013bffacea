"""Attention over the paged KV cache, in plain vectorised torch (runs on CPU and CUDA alike).

One step's tokens from every request arrive flattened: `[num_tokens, heads, head_dim]`. The
runner builds `AttentionMetadata` once per step; every layer reuses it, so per layer there is a
constant number of tensor ops and no Python loop over tokens, blocks or requests.

Requests are split into at most two groups so padding stays small in mixed batches: decodes
(one query token each) and prefills (a prompt or a chunk of one). Within a group, queries are
padded to the longest, the group's KV is gathered block-wise through the block tables, and one
`scaled_dot_product_attention` call with a boolean mask does causal + padding masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    num_seqs: int
    max_query_len: int
    query_index: torch.Tensor  # [num_seqs * max_query_len] -> flat token index (padding -> 0)
    token_index: torch.Tensor  # [n] flat token indices that belong to this group
    out_index: torch.Tensor  # [n] where each of those tokens sits in the padded layout
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_blocks * block_size] bool, True = attend
    identity: bool = False  # tokens already in padded order (a pure decode group): skip the scatter
    fresh: bool = False  # whole prompts with no earlier context: attend to this step's K/V, plain causal

    def to(self, device: torch.device) -> AttentionGroup:
        return AttentionGroup(self.num_seqs, self.max_query_len, self.query_index.to(device),
                              self.token_index.to(device), self.out_index.to(device),
                              self.block_tables.to(device), None if self.mask is None else self.mask.to(device),
                              self.identity, self.fresh)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] -> slot = block * block_size + offset
    groups: list[AttentionGroup]
    block_size: int


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Describe one flattened step: request i contributes query_lens[i] tokens ending at context_lens[i]."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slot_mapping = torch.empty(starts[-1], dtype=torch.long)
    decode = [i for i, q in enumerate(query_lens) if q == 1]
    fresh = [i for i, q in enumerate(query_lens) if q > 1 and context_lens[i] == q]
    cont = [i for i, q in enumerate(query_lens) if q > 1 and context_lens[i] > q]
    groups = []
    for members in (decode, fresh, cont):
        if members:
            group, slots = _build_group(members, query_lens, context_lens, block_tables, starts, block_size,
                                        fresh=members is fresh)
            slot_mapping[group.token_index] = slots
            groups.append(group.to(device))
    return AttentionMetadata(slot_mapping.to(device), groups, block_size)


def _build_group(members, query_lens, context_lens, block_tables, starts, block_size, fresh=False):
    n = len(members)
    max_q = max(query_lens[i] for i in members)
    nbs = [-(-context_lens[i] // block_size) for i in members]
    max_blocks = max(nbs)
    tables = torch.tensor([block_tables[i][:nb] + [0] * (max_blocks - nb) for i, nb in zip(members, nbs)],
                          dtype=torch.long)
    q_lens = torch.tensor([query_lens[i] for i in members])
    ctx_lens = torch.tensor([context_lens[i] for i in members])
    starts_t = torch.tensor([starts[i] for i in members])
    j = torch.arange(max_q)
    valid = j[None, :] < q_lens[:, None]  # [n, max_q]
    query_index = torch.where(valid, starts_t[:, None] + j[None, :], 0).reshape(-1)
    # absolute position of each padded query; padding rows look at key 0 only (never all-masked)
    q_pos = torch.where(valid, (ctx_lens - q_lens)[:, None] + j[None, :], 0)
    mask = None
    if not fresh:  # causal; also hides the padding beyond each request's context
        mask = (torch.arange(max_blocks * block_size)[None, None, :] <= q_pos[:, :, None])[:, None]
    flat_valid = valid.reshape(-1).nonzero().squeeze(1)
    token_index = query_index[flat_valid]
    slots = (tables.gather(1, q_pos // block_size) * block_size + q_pos % block_size).reshape(-1)[flat_valid]
    identity = max_q == 1 and members == list(range(members[0], members[0] + n))
    group = AttentionGroup(n, max_q, query_index, token_index, flat_valid, tables, mask, identity, fresh)
    return group, slots


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into their slots, then attend every query to its request's context."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    h = q.shape[1]
    out = q.new_empty(q.shape)
    gqa = h != hkv
    for g in meta.groups:
        n, mq = g.num_seqs, g.max_query_len
        qg = q.index_select(0, g.query_index).view(n, mq, h, d).transpose(1, 2)
        if g.fresh:  # padded keys sit after every valid query, so the causal mask already hides them
            kg = k.index_select(0, g.query_index).view(n, mq, hkv, d).transpose(1, 2).to(q.dtype)
            vg = v.index_select(0, g.query_index).view(n, mq, hkv, d).transpose(1, 2).to(q.dtype)
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kg = k_cache.index_select(0, g.block_tables.view(-1)).view(n, -1, hkv, d).transpose(1, 2)
            vg = v_cache.index_select(0, g.block_tables.view(-1)).view(n, -1, hkv, d).transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        og = og.transpose(1, 2).reshape(n * mq, h, d)
        if g.identity and len(meta.groups) == 1:
            return og
        out.index_copy_(0, g.token_index, og.index_select(0, g.out_index))
    return out
