"""Owns the device side: the model's weights, the KV cache tensors, and one step's forward pass.

The scheduler says which requests run and how many tokens each contributes; this file turns that
into flat tensors (ids, positions, slot mapping, block tables), runs the model, picks the rows that
need a next token, and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from conveyor.config import EngineConfig
from conveyor.model.attention import build_metadata
from conveyor.model.llama import LlamaModel, ModelConfig, rope_inv_freq
from conveyor.request import Request
from conveyor.runner.sampler import SampleResult, sample

log = logging.getLogger("conveyor.runner")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_DEFAULT_KV_CAP_GIB = 4.0


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls beat fp32 there; elsewhere bf16 on a CPU is emulated and slow."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


@dataclass
class ScheduledItem:
    """One request's share of a step: feed `num_tokens` tokens starting at its `num_computed_tokens`."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


class ModelRunner:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], config: EngineConfig) -> None:
        self.model_config = cfg
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        with torch.device("meta"):
            model = LlamaModel(cfg)
        model.load_hf_state_dict(tensors)
        model.inv_freq = rope_inv_freq(cfg).float()
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.inv_freq = self.model.inv_freq.float()
        self.num_blocks = self._num_blocks(config)
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(cfg.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor. Zeros matter: a masked slot still meets softmax weight 0, and 0 * NaN
        garbage would be NaN. On CPU, calloc'd memory (numpy.zeros) is zero without touching pages,
        so a multi-GiB pool costs nothing until used; torch.zeros would write every byte at startup."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        return torch.from_numpy(np.zeros(numel * elem, dtype=np.uint8)).view(self.dtype).view(shape)

    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * config.kv_cache_memory_fraction
        else:
            budget = min(psutil.virtual_memory().available * config.kv_cache_memory_fraction,
                         CPU_DEFAULT_KV_CAP_GIB * 2**30)
        n = int(budget // self.bytes_per_block)
        if n < 2:
            raise ValueError(f"kv_cache_memory is too small for even two KV blocks "
                             f"({self.bytes_per_block} bytes each)")
        return n

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem], block_tables: list[list[int]],
                copies: list[tuple[int, int]] = ()) -> SampleResult | None:
        """Run one step. Returns a sample for each item whose pending tokens are now all computed."""
        for src, dst in copies:  # copy-on-write of shared, partly filled blocks
            for kc, vc in self.kv_caches:
                kc[dst].copy_(kc[src])
                vc[dst].copy_(vc[src])
        if not items:
            return None
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        for it in items:
            r, start = it.request, it.request.num_computed_tokens
            end = start + it.num_tokens
            if it.num_tokens == 1 and end == r.num_tokens:
                ids.append(r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1])
            else:
                ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(it.num_tokens)
            context_lens.append(end)
        dev = self.device
        meta = build_metadata(query_lens, context_lens, block_tables, self.block_size, dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, pos, self.kv_caches, meta)
        rows, reqs, end = [], [], 0
        for it, q in zip(items, query_lens):
            end += q
            if it.samples:
                rows.append(end - 1)
                reqs.append(it.request)
        if not rows:
            return SampleResult([], [], [])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        return sample(logits, reqs)
