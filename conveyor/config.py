"""Engine-wide settings: the knobs a user turns (named as in vLLM) and what follows from them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# The allowed values of the options that take a fixed set: declared here once; `EngineConfig` checks
# them, the CLI offers them (conveyor/engine/args.py), and the model and runner read their names from here.
DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
# weight-only: int8 / int4 (conveyor/model/quantization.py); gguf: a GGUF's blocks as shipped, whatever their type;
# none: a GGUF dequantized to the dtype. Unset: a GGUF of k-quants, Q8_0, Q4_0 or Q5_0/1 is served as its blocks
# (conveyor/model/gguf_weights.py). int8_per_channel: W8A8, int8 weights per channel and int8 activations per
# token (conveyor/model/w8a8.py; vLLM's shorthand style, as its fp8_per_channel); w8a8_int8: SGLang's name for the
# same, accepted and read as int8_per_channel (QUANTIZATION_ALIASES)
W8A8_QUANTIZATION = "int8_per_channel"
QUANTIZATION_ALIASES = {"w8a8_int8": W8A8_QUANTIZATION}
QUANTIZATIONS = ("int8", "int4", "gguf", "none", W8A8_QUANTIZATION, *QUANTIZATION_ALIASES)
KV_CACHE_DTYPES = ("auto", "int8")
ATTENTION_BACKENDS = ("auto", "kernel", "torch")  # conveyor/model/attention.py
KV_DISK_LOADS = ("auto", "always")  # the disk tier's load policy (conveyor/kv_cache/disk_tier.py)
CHOICES: dict[str, tuple[str, ...]] = {"dtype": DTYPES, "device": DEVICES, "quantization": QUANTIZATIONS,
                                       "kv_cache_dtype": KV_CACHE_DTYPES, "attention_backend": ATTENTION_BACKENDS,
                                       "kv_disk_load": KV_DISK_LOADS}


def check_choice(name: str, value: object, choices: tuple[str, ...], optional: bool = False) -> None:
    """A ValueError naming `name` unless `value` is one of `choices` (or None, when `optional`)."""
    if value in choices or (optional and value is None):
        return
    listed = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
    raise ValueError(f"{name} must be {listed}{' (or unset)' if optional else ''}, got {value!r}")


def json_object(value: dict | str, what: str) -> dict:
    """`value` as a dict: given as one, or as JSON text of an object; else a ValueError naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value


# The token budget of one step on a CPU when none is given: vLLM's own for its CPU server. Measured at the
# Llama-3.2-1B shape on 2 Zen 5 cores (docs/performance.md, 2026-12-05 "third"): prompt tokens go through 4-8%
# faster in 2,048-token steps than in 8,192-token ones (a step's activations stay nearer the caches), and on
# long prompts under load the first token comes sooner: a request's prompt is done in its own few steps
# instead of waiting for a step that holds three other prompts. CUDA keeps 8192, where larger steps pay.
CPU_BATCHED_TOKENS = 2048
CUDA_BATCHED_TOKENS = 8192


def default_batched_tokens(device: str) -> int:
    """`max_num_batched_tokens` when unset, for `device` (one of DEVICES; auto: CUDA when torch sees one)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDA_BATCHED_TOKENS if device == "cuda" else CPU_BATCHED_TOKENS


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    tokenizer: str | None = None
    dtype: str = "auto"  # one of DTYPES; auto: bf16 on CUDA or a CPU with fast bf16, else fp32
    device: str = "auto"  # one of DEVICES
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; None: a fraction of free memory
    kv_cache_memory_fraction: float = 0.5  # of free memory, used when neither budget below is given
    # vLLM's budget: the fraction of the device's memory (CUDA) or of total RAM (CPU) this engine may use,
    # weights and activations included; the KV cache gets what is left. kv_cache_memory wins over it.
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None  # override (tests): exact pool size
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # None: CPU_BATCHED_TOKENS on a CPU, 8192 on CUDA (resolved in __post_init__; see default_batched_tokens)
    max_num_batched_tokens: int | None = None
    scheduler: str = "iteration"
    # a step that ends a prompt (its first token) takes no partial chunk of another prompt: that chunk would make
    # the first token wait for work that samples nothing this step (Scheduler.chunk_allowed); False: fill the
    # budget, as vLLM does
    isolate_prompt_ends: bool = True
    # policy options: each policy's own are listed in conveyor/scheduler/policies.py (POLICIES)
    batch_size: int = 8  # static / dynamic: requests per batch
    static_flush_ms: float | None = None  # static: flush a partial batch after this wait (None: at end of input)
    batch_timeout_ms: float = 50.0  # dynamic: the longest the oldest request waits for a batch
    max_num_partial_prefills: int = 4  # iteration: long prompts prefilled at once
    long_prefill_token_threshold: int = 0  # iteration: a prompt above this counts as long (0: budget/8)
    priority_aging_steps: int = 64  # iteration: steps of waiting that earn one priority level
    tenant_weights: str | None = None  # per-tenant shares, "a=2,b=1" (tenants not named: 1)
    fair_output_token_weight: float = 2.0  # a generated token costs this many prompt tokens of service
    # latency targets for requests that bring none (ms; None: no target); deadline-aware policies read them
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # the batch tier (Batch API lines, conveyor/scheduler/core.py): while interactive work is about, a step of
    # interactive decodes may grow to batch_tier_slowdown x its own cost with batch lines (0: no cut), a step
    # with an interactive prompt takes none; interactive work gone batch_tier_quiet_s seconds: whole steps
    batch_tier_slowdown: float = 1.25
    batch_tier_quiet_s: float = 10.0
    enable_prefix_caching: bool = True
    admission_reserve: bool = False  # admit only if prompt + remaining output fits (mini-sglang style)
    seed: int | None = 0  # seeds the generator that sampled requests without their own seed draw from
    quantization: str | None = None  # None (a GGUF's blocks as they ship, where the kernels take them) or QUANTIZATIONS
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: auto (the model's dtype) or int8
    kv_cache_populate: bool = False  # CPU: fault the pool's pages in at startup (servers: on, see `serve`)
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    threads: int | None = None  # torch compute threads; None: one per physical core (CPU)
    served_model_name: str | None = None
    generation_config: str = "auto"  # auto | vllm | a folder: sampling defaults (model/loader.py)
    speculative_config: dict | str | None = None  # vLLM's: {"method": "ngram", "num_speculative_tokens": 5, ...}
    # LoRA adapters (conveyor/lora, docs/lora.md), as vLLM's flags
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU); None: max_loras
    packed_linear: bool = True  # CPU: linears in the packed kernels' layout where they apply (model/packed_linear.py)
    # the prefix cache's second tier, on local disk (conveyor/kv_cache/disk_tier.py, docs/memory.md): off unless
    # a directory is given; at most kv_disk_gib GiB there, least recently used blocks removed first
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 16.0
    kv_disk_load: str = "auto"  # one of KV_DISK_LOADS: auto = read a block when that beats recomputing it

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_batched_tokens(self.device)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        # `scheduler` names a policy of conveyor/scheduler/policies.py, which checks it (`check_scheduler`):
        # this module sits below the scheduler package, which imports it
        defaults = {f.name: f.default for f in fields(self)}
        self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)
        for name, choices in CHOICES.items():
            check_choice(name, getattr(self, name), choices, optional=defaults[name] is None)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 ms, got {v}")
        if not (self.batch_tier_slowdown == 0 or self.batch_tier_slowdown >= 1):
            raise ValueError(f"batch_tier_slowdown must be 0 (no cut) or >= 1, got {self.batch_tier_slowdown}")
        if not self.batch_tier_quiet_s >= 0:
            raise ValueError(f"batch_tier_quiet_s must be >= 0 seconds, got {self.batch_tier_quiet_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not self.kv_disk_gib > 0:
            raise ValueError(f"kv_disk_gib must be > 0 GiB, got {self.kv_disk_gib}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
