"""Test-only looks inside an engine (its runner's KV tensors, the adapters its layers hold): kept here, with
the engine's own tests, the only tests that may reach into an engine (tests/test_layering.py), so that tests
elsewhere ask through these functions instead of through `LLMEngine`'s public surface."""

from __future__ import annotations

import ctypes
import os

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


def kv_pool_resident_bytes(engine: LLMEngine) -> int:
    """Bytes of the CPU KV pool that are resident in RAM (mincore over each cache tensor's pages): the pool's own
    pages, whatever the rest of the process frees or takes meanwhile (a whole process's RSS moved by tens of MB
    in a suite run while a pool was faulted in, as other engines' memory went back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for layer in engine.runner.kv_caches:
        for t in layer:
            start = t.data_ptr() - t.data_ptr() % page
            pages = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(start, pages * page, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += sum(1 for b in bytes(vec) if b & 1) * page
    return total


def wait_for_kv_populate(engine: LLMEngine, timeout: float) -> bool:
    """Wait for the pool's background faulting (`populate_kv`) to end; False when none was started."""
    job = engine.runner._populate_job
    if job is None:
        return False
    job[0].join(timeout)
    return not job[0].is_alive()
