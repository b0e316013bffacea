"""Test-only looks inside an engine (its runner's KV tensors, the adapters its layers hold): kept here, with
the engine's own tests, the only tests that may reach into an engine (tests/test_layering.py), so that tests
elsewhere ask through these functions instead of through `LLMEngine`'s public surface."""

from __future__ import annotations

import torch

from conveyor.engine.llm_engine import LLMEngine


def kv_pool_is_zero(engine: LLMEngine) -> bool:
    """Whether every KV cache tensor holds only zeros (a populated pool starts so)."""
    return all(not t.any() for layer in engine.runner.kv_caches for t in layer)


def a_kv_tensor(engine: LLMEngine) -> torch.Tensor:
    """One tensor of the engine's KV pool (a test holds a weak reference to it to prove the pool is freed)."""
    return engine.runner.kv_caches[0][0]


def lora_weights_held(engine: LLMEngine) -> set[int]:
    """Adapter ids whose weights some layer of the model still holds (an unload must leave none)."""
    if engine.runner.lora is None:
        return set()
    return {lid for layer in engine.runner.lora.layers for lin in layer.values() for lid in lin.stacked}
