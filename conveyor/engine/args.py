"""The engine's options on a command line: one `EngineFlag` per `EngineConfig` field the CLI takes.

`conveyor generate | serve`, the lab (`conveyor bench`) and the Ray ingress all add the same flags and
read them back with `engine_config_from_args`, which has no per-option code: each flag's default is
`EngineConfig`'s (or its policy's, conveyor/scheduler/policies.py), its choices are `EngineConfig`'s
`CHOICES`, and its help and group are declared here, once. tests/engine/test_args.py holds the table
to the dataclass.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.config import CHOICES, EngineConfig


@dataclass(frozen=True)
class EngineFlag:
    """One `EngineConfig` option on the command line: its flag, help and group. Its default is
    `EngineConfig`'s and its choices `config.CHOICES`' (the scheduler's: the policy table's names), so
    neither is written twice; `engine_config_from_args` reads every flag back by `name`."""

    name: str  # the EngineConfig field (and the argparse dest)
    group: str  # engine | scheduler | memory | kernels
    help: str = ""
    type: Callable[[str], Any] | None = None
    flags: tuple[str, ...] = ()  # default: --name-with-dashes
    action: Any = None
    choices: tuple[str, ...] | None = None  # only where config.CHOICES has none (the scheduler: POLICIES)
    cli_default: Any = None  # a policy table's own CLI default (scheduler/policies.py `Option.cli_default`)
    # the flag is left unset (None) unless given: the command decides (`engine_config_from_args`' `defaults`)
    command_decides: bool = False

    @property
    def default(self) -> Any:
        if self.command_decides:
            return None
        if self.cli_default is not None:
            return self.cli_default
        return EngineConfig.__dataclass_fields__[self.name].default

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        flags = self.flags or ("--" + self.name.replace("_", "-"),)
        kw: dict[str, Any] = {"dest": self.name, "default": self.default, "help": self.help or None}
        if self.action is not None:
            kw["action"] = self.action
        else:
            choices = CHOICES.get(self.name, self.choices)
            kw.update(type=self.type, choices=list(choices) if choices else None)
        group.add_argument(*flags, **kw)


ENGINE_GROUPS = {  # titles of the engine flag groups, in --help order
    "engine": "engine (model and sampling defaults)",
    "scheduler": "scheduler (batching strategy and its knobs)",
    "memory": "memory (KV cache)",
    "kernels": "kernels (compute paths and threads)",
}


def engine_flags() -> list[EngineFlag]:
    """Every engine option the CLI takes, in --help order (the scheduler policies' own knobs come from
    the one table in scheduler/policies.py)."""
    from conveyor.scheduler.policies import POLICIES, all_options

    flags = [
        EngineFlag("model", "engine", "HF model directory, .gguf file, HF hub id, or built-in name"),
        EngineFlag("tokenizer", "engine", "tokenizer directory or hub id (default: the model's)"),
        EngineFlag("dtype", "engine", "weights and activations dtype; auto: bf16 where the CPU has fast bf16 "
                   "(AVX512-BF16, AMX, or AVX2 with our bf16 kernel) or CUDA"),
        EngineFlag("device", "engine", "auto: CUDA when torch sees one, else CPU"),
        EngineFlag("quantization", "engine", "weights (CPU): int8 per channel, int4 in groups of 32 (a GGUF's Q4_0/"
                   "Q4_1 blocks kept as shipped); gguf: a GGUF's blocks as shipped, any type the kernels take; none: "
                   "a GGUF dequantized to --dtype; int8_per_channel (alias w8a8_int8): W8A8, int8 weights per channel "
                   "and activations quantized to int8 per token, int8 dot products, for compute-bound steps "
                   "(default: a GGUF of Q8_0, Q4_0, Q5_0/1 or k-quants served as its blocks, anything else in --dtype)",
                   flags=("--quantization", "-q")),
        EngineFlag("seed", "engine", "seeds the generator that sampled requests without their own seed draw from",
                   type=int),
        EngineFlag("generation_config", "engine", "sampling defaults for requests that set none: auto = the "
                   "model's generation_config.json (built-in models: their card's), vllm = none (temperature 1, "
                   "top_p 1), or a folder"),
        EngineFlag("speculative_config", "engine", 'speculative decoding as vLLM takes it, e.g. \'{"method": '
                   '"ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                   "(default: off)"),
        EngineFlag("max_num_seqs", "scheduler", "most sequences in one step", type=int),
        EngineFlag("max_num_batched_tokens", "scheduler", "token budget of one step (prompt chunks + decodes; "
                   "default: 2048 on a CPU, as vLLM's CPU server, 8192 on CUDA)", type=int),
        EngineFlag("scheduler", "scheduler", "batching strategy: " + "; ".join(
            f"{p.name}: {p.summary}" for p in POLICIES.values()), choices=tuple(POLICIES)),
    ]
    for opt in all_options():  # each policy's own knobs
        flags.append(EngineFlag(opt.name, "scheduler", opt.help, type=opt.type, flags=(opt.flag,),
                                cli_default=opt.cli_default))
    flags += [
        EngineFlag("slo_ttft_ms", "scheduler", "time-to-first-token target of requests that bring none (the "
                   "slo_ttft_ms request field); deadline-aware strategies, the per-tenant metrics and the lab's "
                   "goodput read it", type=float),
        EngineFlag("slo_tpot_ms", "scheduler", "time-per-output-token target of requests that bring none "
                   "(slo_tpot_ms)", type=float),
        EngineFlag("batch_tier_slowdown", "scheduler", "the batch tier (Batch API lines) may make a step of "
                   "interactive decodes at most this many times slower while interactive work is about; a step with "
                   "an interactive prompt takes no batch line (0: no cut, batch lines take whatever is left)",
                   type=float),
        EngineFlag("batch_tier_quiet_s", "scheduler", "seconds without interactive work after which batch lines "
                   "get whole steps", type=float),
        EngineFlag("enable_prefix_caching", "scheduler", "turn automatic prefix caching off",
                   flags=("--no-enable-prefix-caching",), action="store_false"),
        EngineFlag("isolate_prompt_ends", "scheduler", "fill every step's token budget, as vLLM does (default: a "
                   "step that ends a prompt, and so gives it its first token, takes no partial chunk of another "
                   "prompt, which would make that first token wait for work that samples nothing)",
                   flags=("--no-isolate-prompt-ends",), action="store_false"),
        EngineFlag("admission_reserve", "scheduler", "admit a request only if its prompt and its whole remaining "
                   "output fit in KV", action="store_true"),
        EngineFlag("block_size", "memory", "tokens per KV block", type=int),
        EngineFlag("kv_cache_memory", "memory", "GiB for the KV cache; wins over --gpu-memory-utilization "
                   "(default: the least of every seat at full length, 4x the weights and half the RAM free after "
                   "them; docs/memory.md)", type=float),
        EngineFlag("gpu_memory_utilization", "memory", "vLLM's budget: the fraction of the GPU's memory (CUDA) or "
                   "of total RAM (CPU) this engine may use, weights and activations included; the KV cache gets "
                   "the rest (e.g. 0.9)", type=float),
        EngineFlag("max_model_len", "memory", "longest prompt + output per request in tokens (default: the "
                   "model's, capped by the KV pool)", type=int),
        EngineFlag("kv_cache_dtype", "memory", "KV cache storage: auto = the model's dtype; int8 = one scale per "
                   "token and head, about half the memory per token"),
        EngineFlag("kv_cache_populate", "memory", "CPU: fault the KV pool's memory in at startup, as vLLM's "
                   "preallocated cache is, so that a fresh server's first requests do not pay page faults "
                   "(default: on for serve and in-process benchmarks; off for generate, the Python API and "
                   "serve --replicas)", action=argparse.BooleanOptionalAction, command_decides=True),
        EngineFlag("kv_disk_dir", "memory", "a directory for a second prefix-cache tier on local disk: full KV "
                   "blocks evicted from the pool are kept there and read back instead of recomputed, across "
                   "restarts too (default: none, memory only; docs/memory.md)"),
        EngineFlag("kv_disk_gib", "memory", "GiB the disk tier may take; least recently used blocks are removed "
                   "first", type=float),
        EngineFlag("kv_disk_load", "memory", "auto: read a block back from disk when that is measured to cost less "
                   "than recomputing its tokens; always: read every block found"),
        EngineFlag("attention_backend", "kernels", "auto: the compiled CPU kernels where they apply (CPU, "
                   "fp32/bf16), else pure torch; torch: the reference path everywhere"),
        EngineFlag("threads", "kernels", "torch compute threads (default: one per physical core)", type=int),
        EngineFlag("packed_linear", "kernels", "CPU: keep the linears' weights in the packed kernels' layout where "
                   "they apply (--no-packed-linear: torch's own linear, for comparison)",
                   action=argparse.BooleanOptionalAction),
        EngineFlag("enable_lora", "engine", "serve LoRA adapters of the model (serve --lora-modules; docs/lora.md)",
                   action="store_true"),
        EngineFlag("max_loras", "engine", "most distinct LoRA adapters in one step", type=int),
        EngineFlag("max_lora_rank", "engine", "highest LoRA rank accepted", type=int),
        EngineFlag("max_cpu_loras", "engine", "LoRA adapters kept loaded, least recently used dropped first "
                   "(default: --max-loras)", type=int),
    ]
    return flags


def add_engine_args(p: argparse.ArgumentParser, title_prefix: str = "") -> None:
    """The engine flags, in one argument group per `ENGINE_GROUPS` entry (`title_prefix`: e.g. the lab's
    "in-process ", where these flags only apply when the engine runs in the command's own process)."""
    groups = {key: p.add_argument_group(title_prefix + title) for key, title in ENGINE_GROUPS.items()}
    for flag in engine_flags():
        flag.add_to(groups[flag.group])


def engine_config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None,
                            **extra: Any) -> EngineConfig:
    """The `EngineConfig` that the engine flags (`engine_flags()`) describe, plus `extra` fields.

    `defaults`: the command's own values for flags that leave it the choice (`command_decides`) and were
    not given, e.g. {"kv_cache_populate": True} for long-running servers and benchmarks; without one
    such a flag takes `EngineConfig`'s default."""
    values = {flag.name: getattr(args, flag.name) for flag in engine_flags()}
    unset = {flag.name for flag in engine_flags() if flag.command_decides and values[flag.name] is None}
    for name in unset:
        if defaults and name in defaults:
            values[name] = defaults[name]
        else:
            del values[name]
    return EngineConfig(**values, **extra)
