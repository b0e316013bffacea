"""`conveyor generate | serve | bench`: the command line.

Engine flags are shared by every subcommand and named as in vLLM (`--max-num-seqs`, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys

from conveyor.config import EngineConfig
from conveyor.scheduler.policies import POLICIES, all_options


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="HF model directory, .gguf file, HF hub id, or built-in name (default: smollm2-135m)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB for the KV cache; wins over --gpu-memory-utilization (default: half the free memory, "
                        "at most 4 GiB on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's budget: the fraction of the GPU's memory (CUDA) or of total RAM (CPU) this engine "
                        "may use, weights and activations included; the KV cache gets the rest (e.g. 0.9)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--scheduler", default="iteration", choices=list(POLICIES),
                   help="batching strategy: " + "; ".join(f"{p.name}: {p.summary}" for p in POLICIES.values())
                        + " (default: iteration)")
    defaults = EngineConfig.__dataclass_fields__
    for opt in all_options():  # each policy's own knobs, from the one table in scheduler/policies.py
        default = opt.cli_default if opt.cli_default is not None else defaults[opt.name].default
        g.add_argument(opt.flag, type=opt.type, default=default, help=f"{opt.help} (default: {default})")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    g.add_argument("--admission-reserve", action="store_true",
                   help="admit a request only if its prompt and its whole remaining output fit in KV")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "kernel", "torch"],
                   help="auto: the compiled CPU kernels where they apply (CPU, fp32/bf16), else pure torch; "
                        "torch: the reference path everywhere (default: auto)")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="weight-only quantization (CPU): int8 per channel, int4 in groups of 32; a GGUF's "
                        "Q4_0/Q4_1 weights are kept as shipped with int4 (default: none)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV cache storage: auto = the model's dtype; int8 = one scale per token and head, "
                        "about half the memory per token (default: auto)")
    g.add_argument("--kv-cache-populate", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: fault the KV pool's memory in at startup, as vLLM's preallocated cache is, so that "
                        "a fresh server's first requests do not pay page faults (default: on for serve and "
                        "in-process benchmarks; off for generate, the Python API and serve --replicas)")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that set none: auto = the model's generation_config.json "
                        "(built-in models: their card's), vllm = none (temperature 1, top_p 1), or a folder")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as vLLM takes it, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)')
    g.add_argument("--threads", type=int, default=None,
                   help="torch compute threads (default: one per physical core)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters of the model (serve --lora-modules; docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=1, help="most distinct LoRA adapters in one step")
    g.add_argument("--max-lora-rank", type=int, default=16, help="highest LoRA rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept loaded, least recently used dropped first (default: --max-loras)")


_HELP = {  # flags defined without a help text get this one
    "--log-level": "logging level: DEBUG, INFO, WARNING, ERROR (servers log at INFO when left at WARNING)",
    "--workload": "request mix: random, longtail (mostly short, some long) or shared-prefix",
    "--num-prompts": "requests in the run",
    "--output-len": "output tokens per request (ignore_eos holds every length)",
    "--no-progress": "no progress bar",
    "--dtype": "weights and activations dtype; auto: bf16 where the CPU has fast bf16 (AVX512-BF16/AMX) or CUDA",
    "--device": "auto: CUDA when torch sees one, else CPU",
    "--max-model-len": "longest prompt + output per request in tokens (default: the model's, capped by the KV pool)",
    "--max-num-seqs": "most sequences in one step",
    "--max-num-batched-tokens": "token budget of one step (prompt chunks + decodes)",
    "--seed": "seeds the generator that sampled requests without their own seed draw from",
    "--strategies": "comma-separated strategies to compare",
    "--max-tokens": "tokens to generate",
    "--temperature": "sampling temperature (0: greedy)",
    "--top-p": "nucleus sampling mass",
    "--sampling-seed": "seed of this generation's sampling",
    "--host": "address to listen on",
    "--port": "port to listen on (0: any free port, written to the log)",
    "--uvicorn-log-level": "uvicorn's own log level",
}


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
    """`populate_default`: whether the KV pool is faulted in at startup unless --(no-)kv-cache-populate says
    (on for long-running servers and benchmarks, off for one-off generation)."""
    populate = populate_default if args.kv_cache_populate is None else args.kv_cache_populate
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler=args.scheduler, **{opt.name: getattr(args, opt.name) for opt in all_options()},
        enable_prefix_caching=args.enable_prefix_caching, admission_reserve=args.admission_reserve,
        seed=args.seed, attention_backend=args.attention_backend, threads=args.threads,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_populate=populate,
        generation_config=args.generation_config, speculative_config=args.speculative_config,
        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16), max_cpu_loras=getattr(args, "max_cpu_loras", None), **extra,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.llm import LLM
    from conveyor.sampling_params import SamplingParams

    cfg = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(cfg).items()})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate([args.prompt], params, use_tqdm=False)
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
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the model and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    from conveyor.server.api_server import add_server_args

    add_server_args(serve)
    from conveyor.scaleout.ingress import add_scaleout_args

    add_scaleout_args(serve)
    sub.add_parser("bench", help="the batching lab (see `conveyor bench --help`)")
    sub.add_parser("tune", help="find the knobs with the best goodput under a latency SLO (see `conveyor tune --help`)")

    args = document(parser).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            if args.replicas > 1 or args.ray_address is not None:
                from conveyor.scaleout.ingress import run_replicated_server

                return run_replicated_server(args)
            from conveyor.server.api_server import run_server

            return run_server(args)
    except ValueError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
