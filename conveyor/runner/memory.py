"""How much memory an engine needs and may take on CPU: the check before any weight is read, and the default
size of the KV pool (docs/memory.md, "How big the KV pool is").

Why here, and before loading: an engine that cannot fit used to find out the hard way. A 1B-8B model read
gigabytes for a minute and was then killed by the kernel's OOM killer, the client seeing only a dead server
(an 8B model under `--quantization int4`, peak 23.3 GB on a 24 GiB machine). The weights' size follows from
the config and the dtype alone, so a start that cannot fit is refused in a second, with the numbers.
And the default pool used to be "half the free RAM, at most 4 GiB": 4 GiB for a 135M model (8 s of a server's
start to fault in, 4.9 GB resident), the same 4 GiB for an 8B model that has no room for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from conveyor.config import W8A8_QUANTIZATION
from conveyor.model.llama import ModelConfig, linear_parts
from conveyor.model.w8a8 import QUANTIZE_HEAD

log = logging.getLogger("conveyor.runner")

GiB = 2**30
# The default pool holds at most this many times the weights' bytes. A decode step reads the weights once and
# the K/V of every running sequence: with B sequences of s bytes of K/V each, tokens/s = B bw / (W + B s), i.e.
# a fraction P / (W + P) of the most any batch could reach, P = B s being the pool in use. A pool of 4 W gets
# 80% of it; doubling it to 8 W would add 9 points for twice the memory.
KV_WEIGHT_MULTIPLE = 4.0
# Without --max-model-len, the shortest context a default pool must hold at least one sequence of (or the
# model's own context, if shorter); a pool that small would make max_model_len this short.
MIN_DEFAULT_CONTEXT = 2048
# The dense copies of quantized layers (tune_dense_threshold) may take at most this share of the free RAM.
DENSE_COPY_SHARE = 0.25


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup may still take (limit - usage + reclaimable file pages), or None
    without a limit below the machine's RAM. A container sees the host's RAM in /proc/meminfo: its own limit
    is what the OOM killer enforces."""
    total = psutil.virtual_memory().total
    for limit_f, usage_f, stat_f, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                "memory/memory.stat", "total_inactive_file")):
        limit = _read_int(root / limit_f)
        usage = _read_int(root / usage_f)
        if limit is not None and usage is not None:
            if limit >= total:
                return None
            return max(0, limit - usage + _stat(root / stat_f, inactive))
    return None


def available_ram() -> int:
    """RAM this process may still take: the kernel's MemAvailable, or less under a cgroup memory limit."""
    avail = psutil.virtual_memory().available
    room = cgroup_room()
    return avail if room is None else min(avail, room)


def _linear_bytes(n: int, k: int, elem: int, quantization: str | None, lm_head: bool) -> int:
    if quantization == W8A8_QUANTIZATION:  # int8 (K padded to 4), fp32 scales and int32 column sums (w8a8.py)
        return n * (-(-k // 4) * 4) + 8 * n if not lm_head or QUANTIZE_HEAD else n * k * elem
    if quantization == "int8" or (quantization == "int4" and (lm_head or n % 16 or k % 32)):
        return n * k + 4 * n  # int8, one fp32 scale per output channel
    if quantization == "int4":
        return n * k // 2 + n * (k // 32) * 8  # nibbles, an fp32 scale and zero per group of 32
    return n * k * elem


def estimate_weight_bytes(cfg: ModelConfig, elem: int, quantization: str | None, packed: bool,
                          blocks: Mapping[str, int] | None = None) -> int:
    """The served weights' bytes, from the config alone: the linears in `elem`-byte floats or quantized as
    quantization.py does it (int4 keeps the LM head in int8), the embedding and norms in `elem` bytes. A tied LM
    head costs nothing more unless packed or quantized (then it is a copy of the embedding in another layout).
    `blocks`: the weights served as a GGUF file's own blocks (HF name -> bytes, `WeightSource.kept_blocks`),
    counted at their size: a module all of whose parts are kept is a GGUF module, the embedding kept is looked
    up from its blocks and a tied head shares them (an 8B Q4_K_M file: ~4.9 GB, not 16 GB of bf16)."""
    blocks = blocks or {}
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_up_proj": (2 * cfg.intermediate_size, h), "mlp.down_proj": (h, cfg.intermediate_size)}
    embed = "model.embed_tokens.weight"
    total = blocks[embed] if embed in blocks else cfg.vocab_size * h * elem
    for module, parts in linear_parts(cfg).items():
        if module == "lm_head" and parts == [embed]:  # tied
            if embed in blocks or not (packed or quantization):
                continue  # the embedding's own table or blocks
        if all(p in blocks for p in parts):
            total += sum(blocks[p] for p in parts)
        elif module == "lm_head":
            total += _linear_bytes(cfg.vocab_size, h, elem, quantization, True)
        else:
            total += _linear_bytes(*shapes[module.split(".", 2)[2]], elem, quantization, False)
    return total + (2 * cfg.num_layers + 1) * h * elem


@dataclass(frozen=True)
class KVSize:
    budget: float  # bytes for the pool
    note: str  # why that size, for the log


def default_kv_size(bytes_per_token: int, weight_bytes: int, max_num_seqs: int, context: int, min_tokens: int,
                    available: int, headroom: int, fraction: float) -> KVSize:
    """The default KV pool: the least of
    - every seat at full length: `max_num_seqs` sequences of `context` tokens (more could never be used);
    - `KV_WEIGHT_MULTIPLE` times the weights (past that, decode steps mostly read K/V: see above);
    - `fraction` of the RAM free once the weights are in, less a step's activations;
    but at least one sequence of `min_tokens`. ValueError where even that does not fit."""
    need = min_tokens * bytes_per_token
    room = available - headroom
    if need > room:
        raise ValueError(
            f"not enough memory left for the KV cache: one {min_tokens}-token sequence needs "
            f"{need / GiB:.2f} GiB and a step's activations up to {headroom / GiB:.2f} GiB, but only "
            f"{available / GiB:.2f} GiB of RAM are available after loading the weights. Lower --max-model-len or "
            "--max-num-batched-tokens, use --quantization int8/int4 or --kv-cache-dtype int8, or free memory")
    seats = max_num_seqs * context * bytes_per_token
    weights = KV_WEIGHT_MULTIPLE * weight_bytes
    free = fraction * room
    budget = max(min(seats, weights, free), need)
    which = ("every seat at full length" if budget == seats else
             f"{KV_WEIGHT_MULTIPLE:g}x the weights" if budget == weights else
             f"{fraction:g} of the free RAM" if budget == free else f"one {min_tokens}-token sequence")
    note = (f"{which}; the least of max_num_seqs x {context} tokens ({seats / GiB:.2f} GiB), "
            f"{KV_WEIGHT_MULTIPLE:g}x the weights ({weights / GiB:.2f} GiB) and {fraction:g} of the "
            f"{room / GiB:.2f} GiB of RAM free after the weights and a step's activations ({free / GiB:.2f} GiB)")
    return KVSize(budget, note)


def check_fits(model: str, weight_bytes: int, weight_dtype: str, kv_bytes: int, kv_what: str, headroom: int,
               available: int, int4_bytes: int | None = None) -> None:
    """Refuse, before any weight is read, a start whose weights, minimum KV pool and a step's activations
    exceed the RAM available now."""
    need = weight_bytes + kv_bytes + headroom
    if need <= available:
        return
    hint = (f"--quantization int4 (weights ~{int4_bytes / GiB:.1f} GiB), " if int4_bytes is not None
            and int4_bytes < weight_bytes else "")
    raise ValueError(
        f"not enough memory for {model}: its weights take ~{weight_bytes / GiB:.2f} GiB in {weight_dtype}, {kv_what} "
        f"{kv_bytes / GiB:.2f} GiB and a step's activations up to {headroom / GiB:.2f} GiB: {need / GiB:.2f} GiB, "
        f"but only {available / GiB:.2f} GiB of RAM are available. Try {hint}a shorter --max-model-len, a smaller "
        "--max-num-batched-tokens or --kv-cache-memory, or free memory")
