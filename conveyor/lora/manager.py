"""Which adapters are loaded, and the model's LoRA layers they are installed in.

`LoRAManager` lives with the model runner. It wraps the model's four fused linears per layer
(qkv, o, gate_up, down) in `LoRALinear`s once, at startup; adapters are then loaded (from disk, on
first use) into those layers and kept in an LRU of at most `max_cpu_loras`: loading one more
evicts the least recently used adapter that no live request holds. Before each forward the runner
hands it the step's (adapter, rows) layout (`set_batch`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from conveyor.lora.adapter import LoRAAdapter, LoRASpec, load_adapter
from conveyor.lora.layers import LoRABatch, LoRALinear, segments_for, sgmv_kernel
from conveyor.lora.request import LoRARequest
from conveyor.model.llama import LlamaModel

log = logging.getLogger("conveyor.lora")


class LoRAManager:
    def __init__(self, model: LlamaModel, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        cfg = model.cfg
        self.spec = LoRASpec.for_model(cfg, max_lora_rank)
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {"self_attn.qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                 "self_attn.o_proj": [("o_proj", cfg.hidden_size)],
                 "mlp.gate_up_proj": [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)],
                 "mlp.down_proj": [("down_proj", cfg.hidden_size)]}
        self.kernel = sgmv_kernel(dtype, device)
        log.info("LoRA: up to %d adapters per step, %d loaded, rank <= %d; low-rank products on the %s path",
                 max_loras, max_cpu_loras, max_lora_rank, "compiled" if self.kernel is not None else "torch")
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.layers:
            wrapped = {}
            for path, parts in fused.items():
                parent_name, attr = path.split(".")
                parent: nn.Module = getattr(layer, parent_name)
                lin = LoRALinear(getattr(parent, attr), parts, self.batch, self.kernel)
                setattr(parent, attr, lin)
                for part, _ in parts:
                    wrapped[part] = lin
            self.layers.append(wrapped)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: least recently used first
        self.requests: dict[int, LoRARequest] = {}
        self.num_loads = 0
        self.num_evictions = 0

    # --- adapters -----------------------------------------------------------------------------------
    def get(self, req: LoRARequest, in_use: set[int]) -> LoRAAdapter:
        """The loaded adapter for `req`, loading it (and evicting the LRU adapter not `in_use` beyond
        `max_cpu_loras`) if needed. Raises AdapterError (a ValueError) if it cannot be loaded."""
        lid = req.lora_int_id
        known = self.requests.get(lid)
        if known is not None and known.lora_path != req.lora_path:
            if lid in in_use:
                raise ValueError(f"lora_int_id {lid} is in use by adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r}; give {req.lora_name!r} another id")
            self.remove(lid)
        if lid in self.adapters:
            self.adapters.move_to_end(lid)
            return self.adapters[lid]
        adapter = load_adapter(req.lora_path, self.spec, req.lora_name, self.dtype)
        self._evict(in_use, room_for=1)
        for (layer, proj), (a, b) in adapter.weights.items():
            adapter.weights[(layer, proj)] = (a.to(self.device), b.to(self.device))
        by_linear: dict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, proj), ab in adapter.weights.items():
            lin = self.layers[layer][proj]
            by_linear.setdefault((layer, id(lin)), {})[proj] = ab
        for (layer, _), pairs in by_linear.items():
            self.layers[layer][next(iter(pairs))].add(lid, pairs)
        self.adapters[lid] = adapter
        self.requests[lid] = req
        self.num_loads += 1
        log.info("LoRA adapter %r (id %d, rank %d, %s) loaded from %s: %.1f MB", req.lora_name, lid, adapter.rank,
                 ",".join(adapter.targets), req.lora_path, adapter.num_bytes / 2**20)
        return adapter

    def _evict(self, in_use: set[int], room_for: int) -> None:
        """Drop least recently used adapters no request holds until `room_for` more fit. When every
        loaded adapter is held, the limit is exceeded for now (a request is never refused for it)."""
        for lid in list(self.adapters):
            if len(self.adapters) + room_for <= self.max_cpu_loras:
                return
            if lid not in in_use:
                self.remove(lid)
                self.num_evictions += 1

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter (its tensors go at once). False if it was not loaded."""
        if self.adapters.pop(lora_int_id, None) is None:
            self.requests.pop(lora_int_id, None)
            return False
        self.requests.pop(lora_int_id, None)
        for wrapped in self.layers:
            for lin in set(wrapped.values()):
                lin.remove(lora_int_id)
        return True

    def trim(self, in_use: set[int]) -> None:
        """Back down to `max_cpu_loras` once adapters held past it are free."""
        if len(self.adapters) > self.max_cpu_loras:
            self._evict(in_use, room_for=0)

    @property
    def loaded(self) -> list[LoRARequest]:
        return [self.requests[lid] for lid in self.adapters]

    # --- the step -----------------------------------------------------------------------------------
    def set_batch(self, lora_ids: list[int | None], row_counts: list[int]) -> None:
        self.batch.set(segments_for(lora_ids, row_counts))

    def clear_batch(self) -> None:
        self.batch.set([])
