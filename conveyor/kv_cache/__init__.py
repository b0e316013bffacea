"""Paged KV cache bookkeeping: which physical block holds which tokens (no tensors here)."""

from conveyor.kv_cache.block_pool import BlockPool
from conveyor.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
