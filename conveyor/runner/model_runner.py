"""Owns the device side: the model's weights, the KV cache tensors, and one step's forward pass.

The scheduler says which requests run and how many tokens each contributes; this file turns that
into flat tensors (ids, positions, slot mapping, block tables), runs the model, picks the rows that
need a next token, and samples.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import gc
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
from torch import nn

from conveyor import startup
from conveyor.config import DTYPES, W8A8_QUANTIZATION, EngineConfig
from conveyor.kernels.variants import cpu_info
from conveyor.model import w8a8
from conveyor.model.attention import KV_SCALE_DTYPE, build_metadata, cache_shapes, choose_backend, scale_shape
from conveyor.model.gguf_weights import GGUFEmbedding, GGUFLinear
from conveyor.model.llama import LlamaModel, ModelConfig, rope_inv_freq
from conveyor.model.loader import TensorDictSource, WeightSource
from conveyor.model.packed_linear import PackedLinear, available_kernels, pack_linears, packing_available
from conveyor.model.quantization import (
    KERNEL_DTYPES,
    QuantizedLinear,
    QuantizedWeight,
    dense_copy_bytes,
    dense_rows_note,
    keeps_checkpoint_weight,
    quantization_available,
    quantize_weight,
    tune_dense_threshold,
    usable_kept,
)
from conveyor.pooling import pool_step
from conveyor.request import ScheduledItem
from conveyor.runner.cores import CoreGovernor, Usable, engine_pids
from conveyor.runner.grammar_mask import GrammarMask
from conveyor.runner.memory import (
    DENSE_COPY_SHARE,
    MIN_DEFAULT_CONTEXT,
    available_ram,
    check_fits,
    default_kv_size,
    estimate_weight_bytes,
)
from conveyor.runner.sampler import SampleResult, sample

log = logging.getLogger("conveyor.runner")

KV_POPULATE_SYNC_BYTES = 256 << 20  # of the pool faulted in before the engine serves (populate_kv)
_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX, or our AVX2 bf16 linear (`linear_avx2.cpp`): bf16 beats fp32 there. Without them
    torch's bf16 matmul is emulated and slow (AVX2 alone: a 64-row decode step of SmolLM2 took 1.2 s).

    Measured on a 2-core AMD EPYC Zen 3 (AVX2 only) with the AVX2 kernel, SmolLM2-135M: one stream's decode
    step 12.8 ms in bf16 against 32.2 in fp32 (half the bytes to stream, and the decoder layers in one call),
    64 streams 147 against 210 ms, prefill the same (560 vs 570 tok/s)."""
    return cpu_info().has_fast_bf16 or "avx2" in available_kernels()


def cpu_threads(threads: int | None) -> CoreGovernor | None:
    """Set the compute threads: an explicit `threads` as given (None returned), else one per usable physical core
    that other processes are not keeping busy, kept up to date by the returned `CoreGovernor` (runner/cores.py
    says why: a step waits for its slowest thread at every operator). The HTTP server and detokenization run in
    other threads and take a core's time only between steps."""
    if threads is not None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return None
    usable = Usable.now()
    if usable.threads != torch.get_num_threads():
        torch.set_num_threads(usable.threads)
    # in the engine process (a child of the HTTP server), the server's CPU time is this engine's work too
    governor = CoreGovernor(torch.set_num_threads, torch.get_num_threads, own_pids=engine_pids())
    governor.probe()
    return governor


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


class ModelRunner:
    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], config: EngineConfig) -> None:
        """`tensors`: the checkpoint's HF-named weights, a `WeightSource` (read tensor by tensor as each layer is
        built) or any mapping of tensors in memory."""
        self.model_config = cfg
        self.device = resolve_device(config.device)
        self.cores = cpu_threads(config.threads) if self.device.type == "cpu" else None
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        # KV storage: the model's dtype, or int8 with an fp16 scale per token and head (attention.py)
        self.kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.dtype
        # int8 / int4: quantized by us (or a GGUF's Q4_0/Q4_1 kept for int4); gguf / none / unset: how a GGUF's
        # blocks are served (kept as blocks, model/gguf_weights.py, or dequantized), no quantization of ours
        method = config.quantization if config.quantization in ("int8", "int4") else None
        # W8A8 (int8_per_channel): each linear is quantized as its layer is read (w8a8.py), like int8 / int4
        w8a8_on = config.quantization == W8A8_QUANTIZATION
        self.quantization = method or (config.quantization if w8a8_on else None)
        if method or w8a8_on:
            why = quantization_available(self.device, self.dtype)
            if why is not None:
                raise ValueError(f"--quantization {config.quantization} is not available: {why}")
        source = tensors if isinstance(tensors, WeightSource) else TensorDictSource(dict(tensors))
        blocks = source.kept_blocks(config.quantization)  # a GGUF's weights served as its blocks (headers only)
        if blocks and (self.device.type != "cpu" or self.dtype not in KERNEL_DTYPES):
            log.warning("GGUF block weights run on CPU kernels only: dequantizing them for %s/%s", self.device,
                        self.dtype)
            blocks = {}
        self.weight_dtype = self.quantization or ("gguf" if blocks else str(self.dtype).removeprefix("torch."))
        pack = config.packed_linear and packing_available(self.device, self.dtype) and not w8a8_on
        if self.device.type == "cpu":
            self._check_memory(config, pack, blocks)
        with torch.device("meta"):
            model = LlamaModel(cfg)
        t0 = time.perf_counter()
        counts = self._load_weights(model, source, config, pack, blocks)
        if blocks:
            kinds = sorted({t for m in model.modules() if isinstance(m, GGUFLinear) for t in m.qtypes})
            log.info("GGUF block weights served as shipped: %d modules (%s)%s", counts["gguf"],
                     ", ".join(kinds), "" if counts["gguf"] else "; none whole, all dequantized")
            if not counts["gguf"]:
                self.weight_dtype = str(self.dtype).removeprefix("torch.")
        model.inv_freq = rope_inv_freq(cfg).float().to(self.device)
        self.model = model.eval()
        self.model.build_rope_table()
        load_s = time.perf_counter() - t0
        # "kernel": compiled attention + fused RMSNorm/RoPE/SiLU (CPU); "torch": the reference everywhere
        self.attention_backend = choose_backend(config.attention_backend, self.device, self.dtype, cfg.num_heads,
                                                cfg.num_kv_heads, cfg.head_dim)
        self.model.use_fused_ops(self.attention_backend == "kernel")
        self.load_seconds = load_s
        log.info("weights: %.2f GiB read in %.1f s (%.0f MB/s, converted as read), %.2f GiB held as %s",
                 source.bytes_read / 2**30, load_s, source.bytes_read / max(load_s, 1e-9) / 1e6,
                 self.weight_bytes / 2**30, self.weight_dtype)
        if method:
            budget = int(DENSE_COPY_SHARE * available_ram()) if self.device.type == "cpu" else None
            threshold = tune_dense_threshold(self.model, config.max_num_batched_tokens, budget)
            _trim_heap()  # the dense copies' fp32 temporaries and the timing's inputs
            dense = sum(dense_copy_bytes(m) for m in self.model.modules()
                        if isinstance(m, QuantizedLinear) and m.dense is not None)
            log.info("weights: %s (%d linear layers, %d kept as the checkpoint ships them); %s%s",
                     method, counts["quantized"], counts["from_checkpoint"], dense_rows_note(threshold),
                     f" (dense copies of {dense / 2**30:.2f} GiB)" if dense else "")
        if w8a8_on:
            log.info("weights: %s (W8A8: %d linear layers in int8%s, activations quantized per token after a "
                     "block Hadamard transform, on %s)", config.quantization, counts["quantized"],
                     "" if w8a8.QUANTIZE_HEAD else ", the LM head in " + str(self.dtype), w8a8.kernel_isa())
            if config.packed_linear and packing_available(self.device, self.dtype):
                counts["packed"] += pack_linears(self.model)  # what stays in the dtype (the LM head)
        self.packed_linears = counts["packed"]
        # every op on the compiled CPU path gives a token a result that depends only on its own request
        # (tests/engine/test_batch_invariance.py); the torch reference path (CUDA, no compiler) does not
        quantized = (QuantizedLinear, GGUFLinear, w8a8.W8A8Linear)
        linears = [m for m in self.model.modules() if isinstance(m, (PackedLinear, *quantized))]
        self.quantized_linears = sum(1 for m in linears if isinstance(m, quantized))
        self.batch_invariant = (self.attention_backend == "kernel" and bool(linears)
                                and all(m.batch_invariant for m in linears))
        self.lora = None  # LoRAManager when adapters are enabled (conveyor/lora)
        if config.enable_lora:
            from conveyor.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.dtype, self.device)
            # the compiled kernel computes each adapter row alone, whatever its segment's size; the torch
            # path's matmuls (no compiled kernels, CUDA, fp16) see the segment: a row's bits may depend on it
            self.batch_invariant = self.batch_invariant and self.lora.kernel is not None
        kinds = sorted({m.kernel for m in linears if isinstance(m, PackedLinear)})
        # the decoder layers in one compiled call where all their ops are compiled (bit-identical; see fuse_body);
        # CONVEYOR_FUSED_BODY=0 keeps the Python loop (to measure what the call saves)
        fused = self.model.fuse_body(os.environ.get("CONVEYOR_FUSED_BODY", "1") != "0")
        log.info("runner: %s/%s, weights %s, attention %s, %d linear layers packed (%s), decoder layers %s, "
                 "%d torch threads, batch-invariant outputs: %s", self.device, self.dtype, self.weight_dtype,
                 self.attention_backend, self.packed_linears, "+".join(kinds) or "-",
                 "in one compiled call" if fused else "op by op", torch.get_num_threads(),
                 "yes" if self.batch_invariant else "no")
        self._pool_buffers: list[mmap.mmap] = []
        self._populate_job: tuple[threading.Thread, threading.Event] | None = None
        self.allocate_kv_cache(config)

    def _load_weights(self, model: LlamaModel, source: WeightSource, config: EngineConfig, pack: bool,
                      blocks: Mapping[str, int]) -> dict[str, int]:
        """Build every layer of `model` from `source`, one at a time, straight into its served form: each tensor
        is read into the buffer it is served from (fused weights: each part into its rows of the fused buffer),
        then packed for our kernels or quantized a chunk of rows at a time, and every source buffer is dropped
        before the next layer is read; a module all of whose weights are in `blocks` (a GGUF's kept blocks) is
        a GGUFLinear of the file's blocks, each repacked straight from the file (`loader.keep_gguf_tensor`), and
        an embedding in `blocks` a GGUFEmbedding whose blocks a tied LM head shares. Peak memory: the served
        weights plus about twice the largest layer (the LM head, read first, while nothing else is held).
        Returns counts of packed / quantized / kept-for-int4 / GGUF-block layers."""
        dtype, device = self.dtype, self.device
        method = self.quantization if self.quantization in ("int8", "int4") else None
        w8a8_on = self.quantization == W8A8_QUANTIZATION
        counts = {"packed": 0, "quantized": 0, "from_checkpoint": 0, "gguf": 0}

        def read(name: str) -> torch.Tensor:
            return source.read(name, dtype).to(device)

        def read_fused(parts: list[str]) -> torch.Tensor:
            shapes = [source.shape(p) for p in parts]
            if len({s[1:] for s in shapes}) != 1:
                raise ValueError(f"checkpoint does not fit the model: {parts} have shapes {shapes}")
            out = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype)
            row = 0
            for p, s in zip(parts, shapes):
                source.read(p, dtype, out=out[row:row + s[0]])
                row += s[0]
            return out.to(device)

        def kept(module: str, parts: list[str], n: int, k: int) -> QuantizedWeight | None:
            if not keeps_checkpoint_weight(module, method):
                return None
            ws = [source.kept(p, method) for p in parts]
            if any(w is None for w in ws):
                return None
            try:
                qw = ws[0] if len(ws) == 1 else QuantizedWeight.cat(ws)
            except ValueError:  # parts quantized differently: quantize the fused float weight
                return None
            return usable_kept(module, qw, method, n, k)

        def gguf_blocks(parts: list[str]) -> GGUFLinear | None:
            if not all(p in blocks for p in parts):
                return None  # a module with any part dequantized is dequantized whole (one dtype per matmul)
            counts["gguf"] += 1
            return GGUFLinear([source.kept(p, config.quantization) for p in parts], dtype)

        def make_embedding(name: str) -> nn.Module | None:
            table = gguf_blocks([name])
            return None if table is None else GGUFEmbedding(table, dtype)

        def make_linear(module: str, parts: list[str], bias_parts: list[str] | None,
                        weight: torch.Tensor | None) -> nn.Module:
            if weight is None and bias_parts is None:
                gguf = gguf_blocks(parts)
                if gguf is not None:
                    return gguf
            bias = None if bias_parts is None else read_fused(bias_parts)
            n, k = (weight.shape if weight is not None else
                    (sum(source.shape(p)[0] for p in parts), source.shape(parts[0])[1]))
            if method:
                qw = kept(module, parts, n, k) if weight is None else None
                if qw is not None:
                    counts["from_checkpoint"] += 1
                else:
                    w = weight if weight is not None else read_fused(parts)
                    qw = quantize_weight(module, w.detach(), method, dtype)
                    del w
                counts["quantized"] += 1
                return QuantizedLinear(qw, bias, dtype)
            w = weight if weight is not None else read_fused(parts)
            if w8a8_on and (layer := w8a8.linear_for(module, w, bias, dtype)) is not None:
                counts["quantized"] += 1
                return layer  # w is dropped once it returns
            lin = nn.Linear(k, n, bias=bias is not None, device="meta")
            lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias, requires_grad=False)
            if not pack:
                return lin
            counts["packed"] += 1
            return PackedLinear(lin)

        def make_linear_and_trim(*args) -> nn.Module:
            module = make_linear(*args)
            _trim_heap()  # this layer's source buffers are free now
            return module

        def make_embedding_and_trim(name: str) -> nn.Module | None:
            module = make_embedding(name)
            _trim_heap()
            return module

        model.load_weights(source.names(), read, make_linear_and_trim, make_embedding_and_trim)
        return counts

    def _check_memory(self, config: EngineConfig, pack: bool, kept_blocks: Mapping[str, int]) -> None:
        """Refuse a start that cannot fit before reading any weight (runner/memory.py); `kept_blocks`: a GGUF's
        weights served as their blocks, counted at their size."""
        cfg = self.model_config
        if config.max_model_len and (config.num_kv_blocks is not None or config.kv_cache_memory is not None):
            blocks = (config.num_kv_blocks if config.num_kv_blocks is not None
                      else int(config.kv_cache_memory * 2**30 // self.block_bytes(config.block_size)))
            if blocks * config.block_size < config.max_model_len:  # as LLMEngine says it, but before loading
                raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                                 f"({blocks * config.block_size} tokens); raise kv_cache_memory")
        elem = torch.empty((), dtype=self.dtype).element_size()
        weights = estimate_weight_bytes(cfg, elem, self.quantization, pack, kept_blocks)
        int4 = estimate_weight_bytes(cfg, elem, "int4", pack) if self.quantization != "int4" else None
        tokens = self.min_kv_tokens(config)
        kv, what = tokens * self.block_bytes(1), f"one {tokens}-token sequence's KV cache"
        if config.kv_cache_populate and config.num_kv_blocks is not None:
            kv, what = config.num_kv_blocks * self.block_bytes(config.block_size), "the KV pool asked for"
        elif config.kv_cache_populate and config.kv_cache_memory is not None:
            kv, what = int(config.kv_cache_memory * 2**30), "the KV pool asked for"
        check_fits(config.model, weights, self.weight_dtype, kv, what, self.activation_headroom(config),
                   available_ram(), int4)

    def min_kv_tokens(self, config: EngineConfig) -> int:
        """The fewest tokens a default pool must hold: one sequence of `max_model_len`, or without one of
        `MIN_DEFAULT_CONTEXT` tokens (the model's own context if shorter), whole blocks."""
        ctx = config.max_model_len or min(self.model_config.max_position_embeddings, MIN_DEFAULT_CONTEXT)
        return -(-ctx // config.block_size) * config.block_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a step reads: parameters, buffers, and the packed or quantized weights that
        packed layers keep as plain attributes; not the dense copies of quantized layers (only large steps
        read them) nor the RoPE tables."""
        seen: set[int] = set()

        def held(m: nn.Module) -> int:
            total = 0
            attrs = [v for k, v in vars(m).items() if isinstance(v, torch.Tensor) and k not in ("rope_cos", "rope_sin")]
            for t in [*m._parameters.values(), *m._buffers.values(), *attrs]:
                if t is None or t.device.type == "meta":
                    continue
                try:
                    key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                except NotImplementedError:  # oneDNN's packed weights have no storage to ask
                    key, size = id(t), t.numel() * t.element_size()
                if key not in seen:
                    seen.add(key)
                    total += size
            return total + sum(held(c) for name, c in m.named_children()
                               if not (isinstance(m, QuantizedLinear) and name == "dense"))

        return held(self.model)

    def kv_pool_key(self, config: EngineConfig) -> tuple:
        """What the pool's size and layout depend on: the lab compares it to decide whether a new
        configuration needs a new pool."""
        return (config.block_size, config.num_kv_blocks, config.kv_cache_memory, config.gpu_memory_utilization,
                config.kv_cache_memory_fraction, config.max_num_batched_tokens if config.gpu_memory_utilization
                else None, config.max_num_seqs if config.gpu_memory_utilization else None)

    def allocate_kv_cache(self, config: EngineConfig) -> None:
        """(Re)build the KV pool for `config`'s block size and memory budget. Called once at startup,
        and by the knob lab between runs (`LLMEngine.reset`), after the old pool is dropped."""
        cfg = self.model_config
        # drop the old pool first (its memory is not "held" when a budget is computed); if sizing the
        # new one fails there is no pool, and pool_key None makes the next reset build one
        self._stop_populating()  # a background fault-in of the old pool holds its tensors
        self.kv_caches = []
        self._pool_buffers = []  # unmapped once the old tensors are gone
        self.pool_key = None
        gc.collect()
        startup.phase(startup.ALLOCATING_KV)
        self.num_blocks = self._num_blocks(config)
        self.block_size = config.block_size
        self.pool_key = self.kv_pool_key(config)
        k_shape, v_shape = cache_shapes(self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        s_shape = scale_shape(self.num_blocks, self.block_size, cfg.num_kv_heads)
        if self.kv_dtype == torch.int8:
            self.kv_caches = [(self._zeros(k_shape, torch.int8), self._zeros(v_shape, torch.int8),
                               self._zeros(s_shape, KV_SCALE_DTYPE), self._zeros(s_shape, KV_SCALE_DTYPE))
                              for _ in range(cfg.num_layers)]
        else:
            self.kv_caches = [(self._zeros(k_shape, self.dtype), self._zeros(v_shape, self.dtype))
                              for _ in range(cfg.num_layers)]
        if config.kv_cache_populate:
            startup.phase(startup.FILLING_KV)
            self.populate_kv()
        tokens = self.num_blocks * self.block_size
        full = config.max_model_len or min(cfg.max_position_embeddings, tokens)
        log.info("KV cache: %s, %d blocks of %d tokens = %d tokens (%.2f GiB): %d full-length sequences of %d tokens",
                 self.kv_dtype_name, self.num_blocks, self.block_size, tokens,
                 self.num_blocks * self.bytes_per_block / 2**30, tokens // full, full)

    @property
    def kv_dtype_name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed cache tensor. Zeros matter: a masked slot still meets softmax weight 0, and 0 * NaN
        garbage would be NaN. On CPU the pool is an anonymous mmap: zero without touching pages, so a
        multi-GiB pool costs nothing until used (torch.zeros would write every byte at startup), and
        advised for transparent huge pages: attention reads 2 KiB pieces of blocks scattered over
        the pool, and with 4 KiB pages nearly every piece was a TLB miss."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        elem = torch.tensor([], dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        buf = mmap.mmap(-1, max(numel * elem, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # kernel without THP: 4 KiB pages, still correct
                pass
        self._pool_buffers.append(buf)  # the tensor views this memory; keep it mapped
        return torch.frombuffer(buf, dtype=torch.uint8, count=numel * elem).view(dtype).view(shape)

    def populate_kv(self) -> None:
        """Fault the CPU pool's pages in (`kv_cache_populate`), contents unchanged: its first
        `KV_POPULATE_SYNC_BYTES` now, the rest on a background thread while the engine starts and serves.

        Why: the pool is lazily zeroed memory and never-used blocks are handed out in id order, so a
        fresh server's first few GiB of KV writes each page-fault, inside the attention's parallel
        region, where one stalled thread stalls the other. In the 64-client load of benchmarks/vs_vllm.py
        (in-process, this 2-core AMD EPYC) the K/V writes took 5.3 s of 107 s with faults and 1.0 s
        without; output 303 -> 329 tok/s. A server commits its pool at startup instead, as vLLM's
        preallocated cache does. But first touches of memory are slow on some machines (this VM: ~0.6 GB/s,
        an 8.5 GiB pool took 41 s), so only the blocks handed out first are faulted in before the server
        answers; the rest follows in block order on one background thread, in the idle class's gaps between
        steps (`_populate_rest`). `MADV_POPULATE_WRITE` (Linux 5.14+) runs one call per tensor on a thread pool
        (ctypes drops the GIL); where the kernel lacks it, the whole pool is written with zeros now; on any
        other error (ENOMEM) it stays lazy, with a warning."""
        if not self._pool_buffers:
            return
        t0 = time.perf_counter()
        tensors = [t for layer in self.kv_caches for t in layer]
        total = sum(t.numel() * t.element_size() for t in tensors)
        head_blocks = self.num_blocks if total <= KV_POPULATE_SYNC_BYTES else max(
            1, self.num_blocks * KV_POPULATE_SYNC_BYTES // total)
        _libc()  # resolved once, before the threads ask for it

        with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
            errors = list(pool.map(_madvise_populate, [t[:head_blocks] for t in tensors]))
        how = "MADV_POPULATE_WRITE"
        if any(e == errno.EINVAL for e in errors):  # no such advice (before Linux 5.14, or not Linux)
            how, head_blocks = "zeros", self.num_blocks
            for t in tensors:
                t.zero_()  # one at a time: zero_ is itself parallel
        elif any(errors):  # ENOMEM and the like: touching every page would only fail harder
            log.warning("KV cache: could not fault the pool in (%s); it stays lazy",
                        os.strerror(next(e for e in errors if e)))
            return
        done = total * head_blocks // self.num_blocks
        log.info("KV cache: %.2f GiB of pages faulted in at startup in %.1f s (%s)%s", done / 2**30,
                 time.perf_counter() - t0, how, "" if head_blocks == self.num_blocks else
                 f"; the other {(total - done) / 2**30:.2f} GiB on a background thread")
        if head_blocks < self.num_blocks:
            stop = threading.Event()
            thread = threading.Thread(target=_populate_rest, args=(tensors, head_blocks, total, stop),
                                      name="conveyor-kv-populate", daemon=True)
            self._populate_job = (thread, stop)
            # a runner dropped without a reset stops it too (at the idle class it may run long): the thread holds
            # the pool's tensors, and would keep a discarded engine's pool alive and growing until it was done
            weakref.finalize(self, stop.set)
            thread.start()

    def _stop_populating(self) -> None:
        if self._populate_job is not None:
            thread, stop = self._populate_job
            stop.set()
            thread.join()
            self._populate_job = None

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block (int8: plus the fp16 scales)."""
        return self.block_bytes(self.block_size)

    def block_bytes(self, block_size: int) -> int:
        c = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_token_head = c.head_dim * elem
        if self.kv_dtype == torch.int8:
            per_token_head += torch.tensor([], dtype=KV_SCALE_DTYPE).element_size()
        return 2 * c.num_layers * block_size * c.num_kv_heads * per_token_head

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            if config.gpu_memory_utilization is not None:
                log.info("--kv-cache-memory %.2f GiB given: --gpu-memory-utilization is ignored",
                         config.kv_cache_memory)
            budget = config.kv_cache_memory * 2**30
        elif config.gpu_memory_utilization is not None:
            budget = self._kv_budget_from_utilization(config)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * config.kv_cache_memory_fraction
        else:
            size = default_kv_size(self.block_bytes(1), self.weight_bytes, config.max_num_seqs,
                                   config.max_model_len or self.model_config.max_position_embeddings,
                                   self.min_kv_tokens(config), available_ram(), self.activation_headroom(config),
                                   config.kv_cache_memory_fraction)
            budget = size.budget
            log.info("KV pool: %.2f GiB by default, %s", budget / 2**30, size.note)
        n = int(budget // self.block_bytes(config.block_size))
        if n < 2:
            raise ValueError(f"kv_cache_memory is too small for even two KV blocks "
                             f"({self.block_bytes(config.block_size)} bytes each)")
        return n

    def activation_headroom(self, config: EngineConfig) -> int:
        """Bytes a step's activations may take at most, kept out of the KV budget: per batched token the
        hidden state, q/k/v, the MLP's gate and up and a few temporaries in fp32, and per sequence
        its logits row and the sampler's copies of it."""
        c = self.model_config
        per_token = 4 * (6 * c.hidden_size + 3 * c.intermediate_size
                         + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        per_seq = 4 * 4 * c.vocab_size
        return config.max_num_batched_tokens * per_token + config.max_num_seqs * per_seq

    def _kv_budget_from_utilization(self, config: EngineConfig) -> float:
        """vLLM's --gpu-memory-utilization: this engine may use `u` of the device's memory (CUDA) or of
        the machine's RAM (CPU). The KV cache gets that minus what is already held (on CUDA everything
        in use on the device, this process's or not; on CPU this process's RSS) and the activation
        headroom. A speculative draft's weights and pool come on top (they are built after this)."""
        u = config.gpu_memory_utilization
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # a rebuild: the old pool's memory goes back first
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # this process's weights, context and cache, and whatever others hold
            where = "GPU memory"
        else:
            vm = psutil.virtual_memory()
            total = vm.total
            used = psutil.Process().memory_info().rss
            where = "RAM"
            if total * u - used > vm.available:
                raise ValueError(f"gpu_memory_utilization {u} asks for {total * u / 2**30:.2f} GiB of RAM but only "
                                 f"{(vm.available + used) / 2**30:.2f} GiB are available to this process; lower it")
        headroom = self.activation_headroom(config)
        budget = total * u - used - headroom
        if budget < 2 * self.block_bytes(config.block_size):
            raise ValueError(f"gpu_memory_utilization {u} gives this engine {total * u / 2**30:.2f} GiB of {where}, "
                             f"but {used / 2**30:.2f} GiB are already in use (weights, runtime) and a step's "
                             f"activations need up to {headroom / 2**30:.2f} GiB: nothing is left for the KV "
                             "cache. Raise it, or give --kv-cache-memory in GiB")
        log.info("--gpu-memory-utilization %.2f: %.2f GiB of %s, %.2f GiB held already, %.2f GiB for activations: "
                 "%.2f GiB for the KV cache", u, total * u / 2**30, where, used / 2**30, headroom / 2**30,
                 budget / 2**30)
        return budget

    def _prompt_logprobs(self, items: list[ScheduledItem], query_lens: list[int], hidden: torch.Tensor
                         ) -> dict[str, list[dict[int, float]]]:
        """For requests that asked for prompt logprobs: each prompt token's logprob (plus the top-k)
        under the logits of the row before it, for the prompt rows of this step not collected yet
        (a chunked prompt contributes chunk by chunk; a recompute after preemption adds nothing)."""
        out: dict[str, list[dict[int, float]]] = {}
        end = 0
        for it, q in zip(items, query_lens):
            row0, end = end, end + q
            r = it.request
            if r.prompt_logprobs is None:
                continue
            pos0 = r.num_computed_tokens  # the position of this item's first row
            first = max(len(r.prompt_logprobs) - 1 - pos0, 0)  # row j predicts the token at pos0 + j + 1
            last = min(q, r.num_prompt_tokens - 1 - pos0)
            if last <= first:
                continue
            lps = torch.log_softmax(self.model.compute_logits(hidden[row0 + first:row0 + last]), dim=-1)
            targets = r.prompt_token_ids[pos0 + first + 1:pos0 + last + 1]
            k = r.params.prompt_logprobs
            chosen = lps.gather(1, torch.tensor(targets, device=lps.device)[:, None])[:, 0].tolist()
            top_vals, top_ids = lps.topk(k, dim=-1) if k > 0 else (None, None)
            entries = []
            for i, (t, lp) in enumerate(zip(targets, chosen)):
                entry = {t: lp}
                if k > 0:
                    for tid, v in zip(top_ids[i].tolist(), top_vals[i].tolist()):
                        entry.setdefault(tid, v)
                entries.append(entry)
            out[r.request_id] = entries
        return out

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem], block_tables: list[list[int]],
                copies: list[tuple[int, int]] = (), grammar: GrammarMask | None = None) -> SampleResult:
        """Run one step. Returns a sample for each item whose pending tokens are now all computed
        (`grammar` masks the rows, in that order, whose output has a grammar), with the step's phase
        times and any prompt logprobs it computed."""
        t0 = time.perf_counter()
        if self.cores is not None:
            self.cores.tick()  # fewer compute threads while other processes keep cores busy (runner/cores.py)
        for src, dst in copies:  # copy-on-write of shared, partly filled blocks
            for cache in self.kv_caches:
                for t in cache:
                    t[dst].copy_(t[src])
        if not items:
            return SampleResult([], [], [], phases=(time.perf_counter() - t0, 0.0, 0.0, 0.0))
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        for it in items:
            r, start = it.request, it.request.num_computed_tokens
            end = start + it.num_tokens
            if it.num_tokens == 1 and end == r.num_tokens:
                ids.append(r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1])
            elif it.num_draft:  # the last real token, then the guesses to verify
                ids.extend(r.all_token_ids[start:end - it.num_draft])
                ids.extend(r.spec_token_ids[:it.num_draft])
            else:
                ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(it.num_tokens)
            context_lens.append(end)
        dev = self.device
        meta = build_metadata(query_lens, context_lens, block_tables, self.block_size, dev,
                              self.attention_backend)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        t1 = time.perf_counter()
        if self.lora is not None:
            self.lora.set_batch([it.request.lora_int_id for it in items], query_lens)
        hidden = self.model(input_ids, pos, self.kv_caches, meta)
        if self.lora is not None:
            self.lora.clear_batch()
        prompt_lps = (self._prompt_logprobs(items, query_lens, hidden)
                      if any(it.request.prompt_logprobs is not None for it in items) else {})
        pooled = pool_step(items, query_lens, hidden) if any(it.request.pooling for it in items) else []
        t2 = time.perf_counter()
        rows, reqs, positions, end = [], [], [], 0
        for it, q in zip(items, query_lens):
            end += q
            if it.samples:  # one row, or (guesses) the last real token's row and each guess's
                for j, row in enumerate(range(end - 1 - it.num_draft, end)):
                    rows.append(row)
                    reqs.append(it.request)
                    positions.append(len(it.request.output_token_ids) + j)
        if not rows:
            return SampleResult([], [], [], pooled=pooled, phases=(t1 - t0, time.perf_counter() - t1, 0.0, 0.0),
                                prompt_logprobs=prompt_lps)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        t3 = time.perf_counter()
        result = verify(sample(logits, reqs, grammar, positions), items)
        result.pooled = pooled
        result.prompt_logprobs = prompt_lps
        result.phases = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return result


def verify(rows: SampleResult, items: list[ScheduledItem]) -> SampleResult:
    """Per sampling item, in order: its new tokens as a list, with their logprobs. An item with
    guesses (speculative decoding) had a row for its last real token and one per guess; guess i is
    kept while the sample at the row before it equals it, and the first differing sample (or, when
    all were kept, the last row's) is the next token (see `conveyor/engine/speculative.py` for why
    this keeps the target's distribution)."""
    tokens, lps, slps, bad = [], [], [], []
    bad_rows = set(rows.bad)
    i = 0
    for it in items:
        if not it.samples:
            continue
        n = 1 + it.num_draft
        if bad_rows and any(r in bad_rows for r in range(i, i + n)):
            bad.append(len(tokens))
        got = rows.token_ids[i:i + n]
        kept = 0
        guesses = it.request.spec_token_ids
        while kept < it.num_draft and got[kept] == guesses[kept]:
            kept += 1
        tokens.append(got[:kept + 1])
        lps.append(rows.logprobs[i:i + kept + 1])
        slps.append(rows.sampled_logprobs[i:i + kept + 1])
        i += n
    return SampleResult(tokens, lps, slps, bad)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
_PAGE = mmap.PAGESIZE


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc's madvise on Linux (other systems number their advice differently), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`, which also releases whole free
    pages inside the heap). Loading frees a source buffer per layer; those below glibc's mmap threshold (which
    rises up to 32 MB as larger blocks are freed: a 3B model's fused q/k/v is 31.5 MB) come from the heap, whose
    holes otherwise stay resident after the load (~0.8 GB on the 3B shape)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)


def _populate_rest(tensors: list[torch.Tensor], first_block: int, total: int, stop: threading.Event) -> None:
    """`populate_kv`'s background part: blocks from `first_block` on, in block order across the layers, ~64 MB
    per round, until done or `stop` (a new pool replaces this one).

    It runs at the idle scheduling class (SCHED_IDLE: only on a core nobody else wants), else at nice 19. At the
    normal class it was a neighbour of the engine's own compute threads: each step waits at its barriers for the
    thread the populating one displaced, and on this VM, where first touches run at ~0.1-0.6 GB/s, the 9 GiB
    pool of a Llama-3.2-1B server took minutes, with the served prompts 1.5x slower all that time (2,560-token
    prefill in-process, 2 Zen 5 cores: 11.1-12.5 s against 7.1-7.9 s unpopulated). At the idle class it fills
    the pool in the gaps between steps and never delays one; blocks a step reaches first fault in as they would
    unpopulated."""
    _lowest_priority()
    t0 = time.perf_counter()
    blocks = tensors[0].shape[0]
    step = max(1, blocks * (64 << 20) // max(total, 1))
    for a in range(first_block, blocks, step):
        if stop.is_set():
            return
        for t in tensors:
            if _madvise_populate(t[a:a + step]) != 0:
                return  # ENOMEM and the like: the rest stays lazy
    log.info("KV cache: the rest of the pool (%.2f GiB) faulted in, in the background in %.1f s",
             total * (blocks - first_block) / blocks / 2**30, time.perf_counter() - t0)


def _lowest_priority() -> None:
    """Put the calling thread in the idle scheduling class (Linux: a thread's own policy), else at nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: a thread id names the thread
        except (AttributeError, OSError):
            pass


def _madvise_populate(t: torch.Tensor) -> int:
    """Fault in (writable, contents unchanged) the pages under `t`: 0, or the errno (EINVAL where the
    kernel or the system has no such advice)."""
    libc = _libc()
    if libc is None:
        return errno.EINVAL
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    start -= start % _PAGE
    end += -end % _PAGE
    return 0 if libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()
