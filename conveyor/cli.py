"""`conveyor generate | serve | batch | bench`: the command line.

Engine flags are shared by every subcommand and named as in vLLM (`--max-num-seqs`, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys

from conveyor.argparsing import CliParser, document
from conveyor.engine.args import add_engine_args, engine_config_from_args

__all__ = ["build_parser", "engine_config_from_args", "main"]


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
        if args.command == "batch":
            from conveyor.server.batch.offline import run_batch_file

            return run_batch_file(args)
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
    batch = sub.add_parser("batch", help="run a Batch API file in this process (see `conveyor batch run --help`)")
    batch_sub = batch.add_subparsers(dest="batch_command", required=True)
    run = batch_sub.add_parser("run", help="answer every line of a Batch API file (JSONL) into an output file, as "
                               "vLLM's run-batch", usage="%(prog)s INPUT.jsonl -o OUTPUT.jsonl [options]")
    from conveyor.server.batch.offline import add_run_args

    add_run_args(run)
    add_engine_args(run)
    sub.add_parser("bench", help="the batching lab (see `conveyor bench --help`)")
    sub.add_parser("tune", help="find the knobs with the best goodput under a latency SLO (see `conveyor tune --help`)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
