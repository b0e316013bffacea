"""`conveyor generate | serve | bench`: the command line.

Engine flags are shared by every subcommand and named as in vLLM (`--max-num-seqs`, ...).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineConfig


@dataclass(frozen=True)
class EngineFlag:
    """One `EngineConfig` option on the command line, declared once: its flag, parsing, help and group
    are generated from this record, and `engine_config_from_args` reads every flag back by `name`
    with no per-option code. The default is `EngineConfig`'s unless `cli_default` says otherwise."""

    name: str  # the EngineConfig field (and the argparse dest)
    group: str  # engine | scheduler | memory | kernels
    help: str = ""
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flags: tuple[str, ...] = ()  # default: --name-with-dashes
    action: Any = None
    cli_default: Any = None  # with has_cli_default: the flag's default when it differs from EngineConfig's
    has_cli_default: bool = False

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        flags = self.flags or ("--" + self.name.replace("_", "-"),)
        default = self.cli_default if self.has_cli_default else EngineConfig.__dataclass_fields__[self.name].default
        kw: dict[str, Any] = {"dest": self.name, "default": default, "help": self.help or None}
        if self.action is not None:
            kw["action"] = self.action
        else:
            kw.update(type=self.type, choices=list(self.choices) if self.choices else None)
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
                   "(AVX512-BF16/AMX) or CUDA", choices=("auto", "bfloat16", "float16", "float32")),
        EngineFlag("device", "engine", "auto: CUDA when torch sees one, else CPU", choices=("auto", "cpu", "cuda")),
        EngineFlag("quantization", "engine", "weight-only quantization (CPU): int8 per channel, int4 in groups of "
                   "32; a GGUF's Q4_0/Q4_1 weights are kept as shipped with int4 (default: none)",
                   choices=("int8", "int4"), flags=("--quantization", "-q")),
        EngineFlag("seed", "engine", "seeds the generator that sampled requests without their own seed draw from",
                   type=int),
        EngineFlag("generation_config", "engine", "sampling defaults for requests that set none: auto = the "
                   "model's generation_config.json (built-in models: their card's), vllm = none (temperature 1, "
                   "top_p 1), or a folder"),
        EngineFlag("speculative_config", "engine", 'speculative decoding as vLLM takes it, e.g. \'{"method": '
                   '"ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                   "(default: off)"),
        EngineFlag("max_num_seqs", "scheduler", "most sequences in one step", type=int),
        EngineFlag("max_num_batched_tokens", "scheduler", "token budget of one step (prompt chunks + decodes)",
                   type=int),
        EngineFlag("scheduler", "scheduler", "batching strategy: " + "; ".join(
            f"{p.name}: {p.summary}" for p in POLICIES.values()), choices=tuple(POLICIES)),
    ]
    defaults = EngineConfig.__dataclass_fields__
    for opt in all_options():  # each policy's own knobs
        default = opt.cli_default if opt.cli_default is not None else defaults[opt.name].default
        flags.append(EngineFlag(opt.name, "scheduler", opt.help, type=opt.type, flags=(opt.flag,),
                                cli_default=default, has_cli_default=True))
    flags += [
        EngineFlag("enable_prefix_caching", "scheduler", "turn automatic prefix caching off",
                   flags=("--no-enable-prefix-caching",), action="store_false"),
        EngineFlag("admission_reserve", "scheduler", "admit a request only if its prompt and its whole remaining "
                   "output fit in KV", action="store_true"),
        EngineFlag("block_size", "memory", "tokens per KV block", type=int),
        EngineFlag("kv_cache_memory", "memory", "GiB for the KV cache; wins over --gpu-memory-utilization "
                   "(default: half the free memory, at most 4 GiB on CPU)", type=float),
        EngineFlag("gpu_memory_utilization", "memory", "vLLM's budget: the fraction of the GPU's memory (CUDA) or "
                   "of total RAM (CPU) this engine may use, weights and activations included; the KV cache gets "
                   "the rest (e.g. 0.9)", type=float),
        EngineFlag("max_model_len", "memory", "longest prompt + output per request in tokens (default: the "
                   "model's, capped by the KV pool)", type=int),
        EngineFlag("kv_cache_dtype", "memory", "KV cache storage: auto = the model's dtype; int8 = one scale per "
                   "token and head, about half the memory per token", choices=("auto", "int8")),
        EngineFlag("kv_cache_populate", "memory", "CPU: fault the KV pool's memory in at startup, as vLLM's "
                   "preallocated cache is, so that a fresh server's first requests do not pay page faults "
                   "(default: on for serve and in-process benchmarks; off for generate, the Python API and "
                   "serve --replicas)", action=argparse.BooleanOptionalAction, has_cli_default=True),
        EngineFlag("attention_backend", "kernels", "auto: the compiled CPU kernels where they apply (CPU, "
                   "fp32/bf16), else pure torch; torch: the reference path everywhere",
                   choices=("auto", "kernel", "torch")),
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


_HELP = {  # flags defined without a help text get this one
    "--log-level": "logging level: DEBUG, INFO, WARNING, ERROR (servers log at INFO when left at WARNING)",
    "--workload": "request mix: random, longtail (mostly short, some long) or shared-prefix",
    "--num-prompts": "requests in the run",
    "--output-len": "output tokens per request (ignore_eos holds every length)",
    "--no-progress": "no progress bar",
    "--strategies": "comma-separated strategies to compare",
    "--max-tokens": "tokens to generate",
    "--temperature": "sampling temperature (0: greedy)",
    "--top-p": "nucleus sampling mass",
    "--sampling-seed": "seed of this generation's sampling",
    "--host": "address to listen on",
    "--port": "port to listen on (0: any free port, written to the log)",
    "--uvicorn-log-level": "uvicorn's own log level",
}


class CliParser(argparse.ArgumentParser):
    """argparse, with errors that help: a flag a subcommand does not know is reported by that subcommand,
    with its usage (argparse reports it from the top-level parser, whose usage does not list it), and a
    near miss gets a "did you mean" (`conveyor serve --modle x` -> did you mean --model?). Exit code 2."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self
            while (sub := _chosen_subparser(parser, ns)) is not None:
                parser = sub
            parser.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(parser, extras)}")
        return ns

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        if "invalid choice: " in message and "did you mean" not in message:
            wrong = message.split("invalid choice: ", 1)[1].split("'")[1] if "'" in message else ""
            choices = [c for a in self._actions if a.choices for c in a.choices]
            close = difflib.get_close_matches(wrong, [str(c) for c in choices], n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)


def _chosen_subparser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(ns, action.dest, None)
            return action.choices.get(name) if name is not None else None
    return None


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    flags = [x for x in extras if x.startswith("-")]
    for x in flags:
        close = difflib.get_close_matches(x.split("=", 1)[0], options, n=1, cutoff=0.6)
        if close:
            hints.append(f"did you mean {close[0]}?" if len(flags) == 1 else f"{x}: did you mean {close[0]}?")
    return ("; " + "; ".join(hints)) if hints else ""


def document(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of `parser` (and its subcommands) gets a help text that shows its default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_parser in action.choices.values():
                document(sub_parser)
            continue
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if action.help is None:
            action.help = next((_HELP[o] for o in action.option_strings if o in _HELP), "")
        if "default" not in action.help and not isinstance(action, (argparse._StoreTrueAction,
                                                                       argparse._StoreFalseAction)):
            shown = "none" if action.default is None else action.default
            if isinstance(shown, list):
                shown = ",".join(str(x) for x in shown)
            action.help = f"{action.help} (default: {shown})".strip()
    return parser


def engine_config_from_args(args: argparse.Namespace, populate_default: bool = False, **extra) -> EngineConfig:
    """The `EngineConfig` that the engine flags (`engine_flags()`) describe, plus `extra` fields.

    `populate_default`: whether the KV pool is faulted in at startup unless --(no-)kv-cache-populate says
    (on for long-running servers and benchmarks, off for one-off generation)."""
    values = {flag.name: getattr(args, flag.name) for flag in engine_flags()}
    # requests' default latency targets: `serve --slo-ttft-ms/--slo-tpot-ms`, or the lab's SLO (bench's own flags)
    values.update(slo_ttft_ms=getattr(args, "slo_ttft_ms", None), slo_tpot_ms=getattr(args, "slo_tpot_ms", None))
    if values["kv_cache_populate"] is None:
        values["kv_cache_populate"] = populate_default
    return EngineConfig(**values, **extra)


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.llm import LLM
    from conveyor.sampling_params import SamplingParams

    cfg = engine_config_from_args(args)
    llm = LLM(use_tqdm_on_load=args.progress, **{k: v for k, v in vars(cfg).items()})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=args.progress)
    else:
        outs = llm.generate([args.prompt], params, use_tqdm=args.progress)
    print(outs[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from conveyor.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "tune":
        from conveyor.bench.cli import main as bench_main

        return bench_main(argv)
    args = document(build_parser()).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            if args.replicas > 1 or args.ray_address is not None:
                from conveyor.scaleout.ingress import run_replicated_server

                return run_replicated_server(args)
            from conveyor.server.launch import run_server

            return run_server(args)
    except ValueError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    return 1


def build_parser() -> CliParser:
    """`conveyor generate | serve` (bench and tune have their own, conveyor/bench/cli.py). Parsing imports
    neither torch nor the engine nor the web stack: `--help` and a wrong flag answer at once."""
    parser = CliParser(prog="conveyor", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the model and print the text",
                         usage="%(prog)s PROMPT [--chat] [options]")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no loading and generation progress on stderr (the text alone on stdout)")
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server", usage="%(prog)s [options]",
                           description="Serve the OpenAI API. The port answers at once; /health says "
                                       "\"loading\" (503) until the engine is up.")
    from conveyor.scaleout.args import add_scaleout_args
    from conveyor.server.args import add_server_args

    add_server_args(serve)
    add_engine_args(serve)
    add_scaleout_args(serve)
    sub.add_parser("bench", help="the batching lab (see `conveyor bench --help`)")
    sub.add_parser("tune", help="find the knobs with the best goodput under a latency SLO (see `conveyor tune --help`)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
