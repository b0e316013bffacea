"""The engine's side of the disk tier (conveyor/kv_cache/disk_tier.py): what a tier's namespace is made of,
and opening one on the runner's KV pool.

The namespace is everything a block's K/V bytes depend on besides the block's own key (its tokens, parent,
salt and adapter, which every file carries): the weights (a digest of their values, not the model's name),
the model's shape, weight quantization, activation and KV dtypes, block size, the pool's layout, the device
and the compute path (attention backend, compiled kernel variant and sources, torch). Output with the tier
must be token for token what a cold run computes, so anything that can change a bit of K/V is in it; a
tier written under any other namespace is never read, only left on disk beside this one.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from conveyor.config import EngineConfig
from conveyor.kv_cache.disk_tier import DiskTier, open_disk_tier
from conveyor.runner.model_runner import ModelRunner

log = logging.getLogger("conveyor.engine")


def tier_identity(config: EngineConfig, runner: ModelRunner, weights: str) -> dict:
    """What this engine's KV blocks depend on (see the module docstring); `weights`: `weights_digest`."""
    from conveyor import kernels

    compiled = kernels.load() is not None
    return {
        "weights": weights,
        "model_config": dataclasses.asdict(runner.model_config),
        "quantization": config.quantization,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_dtype": runner.kv_dtype_name,
        "block_size": runner.block_size,
        "layout": [[list(t.shape[1:]), str(t.dtype)] for t in runner.kv_caches[0]],
        "num_layers": len(runner.kv_caches),
        "device": runner.device.type,
        "attention_backend": runner.attention_backend,
        "packed_linears": runner.packed_linears,
        "kernels": [kernels.variant(), kernels.source_hash()] if compiled else None,
        "torch": torch.__version__,
    }


def open_kv_disk(config: EngineConfig, runner: ModelRunner, weights: str | None) -> DiskTier | None:
    """The disk tier `config` asks for on `runner`'s pool, or None (none asked for, prefix caching off,
    or the directory unusable: `open_disk_tier` logs why)."""
    if not config.kv_disk_dir:
        return None
    if not config.enable_prefix_caching:
        log.warning("--kv-disk-dir is ignored: prefix caching is off (--no-enable-prefix-caching)")
        return None
    tensors = [t for layer in runner.kv_caches for t in layer]
    return open_disk_tier(config.kv_disk_dir, config.kv_disk_gib, tier_identity(config, runner, weights or ""),
                          tensors, runner.block_size, config.kv_disk_load)


def tier_key(config: EngineConfig, runner: ModelRunner) -> tuple:
    """What an open tier depends on: another value (the lab's `reset` to another config) reopens it."""
    return (config.kv_disk_dir, config.kv_disk_gib, config.kv_disk_load, config.enable_prefix_caching,
            runner.pool_key)
