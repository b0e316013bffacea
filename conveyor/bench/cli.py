"""`conveyor bench [run] | compare`: the batching lab's command line.

    conveyor bench run --in-process --scheduler iteration --request-rate 4 --num-prompts 64
    conveyor bench run --url http://127.0.0.1:8000 --concurrency 16 --workload longtail
    conveyor bench compare --request-rates 1,2,4,inf --out-dir docs/lab
    conveyor bench report docs/lab/results.json     # re-render the report from saved numbers
    conveyor bench sweep --knob max_num_seqs=8,16,32,64 --concurrency 64   # one knob over a range
    conveyor bench stress overload|storm|soak --url http://127.0.0.1:8000   # docs/reliability.md
    conveyor bench study                          # the studies in benchmarks/, each with its one line
    conveyor bench study vs_vllm --models smollm2 # run one (benchmarks/vs_vllm.py) with its own flags

`conveyor bench` without a subcommand means `run`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from conveyor.argparsing import CliParser, document
from conveyor.bench.lora import add_lora_args
from conveyor.bench.stress import add_stress_parser, cmd_stress
from conveyor.bench.workloads import WORKLOADS, WorkloadSpec
from conveyor.engine.args import add_engine_args, engine_config_from_args
from conveyor.scheduler.policies import POLICIES, default_strategies

log = logging.getLogger("conveyor.bench")


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {text}")
    return v


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI, got {text!r}") from None


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="random", choices=WORKLOADS)
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128, help="random/shared-prefix: prompt tokens (suffix)")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (random, shared-prefix)")
    g.add_argument("--long-fraction", type=float, default=0.2, help="longtail, mixed-slo: share of long requests")
    g.add_argument("--short-input", type=_range, default=(32, 128), help="longtail, mixed-slo: LO-HI")
    g.add_argument("--short-output", type=_range, default=(32, 128), help="longtail, mixed-slo: LO-HI")
    g.add_argument("--long-input", type=_range, default=(512, 1500), help="longtail, mixed-slo: LO-HI")
    g.add_argument("--long-output", type=_range, default=(128, 384), help="longtail, mixed-slo: LO-HI")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt tokens")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct system prompts, taken in turn by the requests")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before a run cancels what is left")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--peak-matmul-size", type=int, default=2048,
                   help="n of the n x n x n matmul that measures peak FLOP/s for MFU")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="in-process: exact KV pool size in blocks (overrides --kv-cache-memory)")
    g.add_argument("--noisy-ratio", type=float, default=8.0,
                   help="noisy-neighbour: the noisy tenant's request rate over the quiet one's")
    g.add_argument("--chat-ttft-ms", type=float, default=1000.0, help="mixed-slo: chat requests' TTFT target")
    g.add_argument("--chat-tpot-ms", type=float, default=200.0, help="mixed-slo: chat requests' TPOT target")
    g.add_argument("--batch-ttft-ms", type=float, default=30000.0, help="mixed-slo: batch jobs' TTFT target")


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(name=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio, long_fraction=args.long_fraction,
                        short_input=args.short_input, short_output=args.short_output, long_input=args.long_input,
                        long_output=args.long_output, prefix_len=args.prefix_len,
                        num_prefixes=args.num_prefixes, seed=args.seed, noisy_ratio=args.noisy_ratio,
                        chat_ttft_ms=args.chat_ttft_ms, chat_tpot_ms=args.chat_tpot_ms,
                        batch_ttft_ms=args.batch_ttft_ms)


def lab_engine_config(args: argparse.Namespace):
    """The engine flags plus the lab's own: an exact KV pool size."""
    return engine_config_from_args(args, {"kv_cache_populate": True}, num_kv_blocks=args.num_kv_blocks)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="conveyor bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", parents=[common], help="drive one server or engine with one load and report",
                         usage="%(prog)s [--url URL | --in-process] [options]",
                         description="Drive a running server (--url, the default) or an engine loaded here "
                                     "(--in-process) with one load, and report its throughput and latencies.")
    client = run.add_argument_group("client (a running server, or --in-process)")
    target = client.add_mutually_exclusive_group()
    target.add_argument("--url", default="http://127.0.0.1:8000", help="the server to drive")
    target.add_argument("--in-process", action="store_true",
                        help="load the engine in this process (the 'in-process engine' flags below) instead of "
                             "driving --url")
    client.add_argument("--served-model", default=None, help="HTTP: the model name to send (default: /v1/models)")
    client.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("CONVEYOR_API_KEY"),
                     help="HTTP: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else "
                          "$CONVEYOR_API_KEY, else none)")
    client.add_argument("--server-pid", type=int, default=None,
                     help="HTTP: the server's pid for CPU accounting (default: whoever listens on the port)")
    loop = client.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    loop.add_argument("--request-rate", type=_rate, default=float("inf"),
                      help="open loop: Poisson arrivals per second (default inf: all at once)")
    client.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    add_workload_args(run)
    add_lora_args(run)
    add_engine_args(run, title_prefix="in-process ")

    cmp_ = sub.add_parser("compare", parents=[common],
                          help="every strategy plus no batching, one workload, a Markdown report")
    cmp_.add_argument("--strategies", default=",".join(default_strategies("compare")),
                      help=f"strategies to compare, of {', '.join(POLICIES)}")
    cmp_.add_argument("--no-baseline", dest="baseline", action="store_false",
                      help="skip the no-batching baseline (continuous, max_num_seqs=1)")
    cmp_.add_argument("--request-rates", type=_rates, default=[1.0, 2.0, 4.0, 8.0],
                      help="offered loads, comma-separated req/s; inf = all at once")
    cmp_.add_argument("--table-rate", type=_rate, default=None,
                      help="the load the comparison table uses (default: the highest)")
    cmp_.add_argument("--out-dir", type=Path, default=None,
                      help="where report.md, results.json and the plots go (default: a new folder "
                           "bench-results/compare-YYYYmmdd-HHMMSS; the committed docs/lab is only written "
                           "when named here)")
    add_workload_args(cmp_)
    add_engine_args(cmp_)

    rep = sub.add_parser("report", parents=[common], help="rewrite a comparison's report from its results.json")
    rep.add_argument("results", type=Path, help="the results.json that `bench compare` wrote")
    rep.add_argument("--out-dir", type=Path, default=None, help="default: the results file's directory")
    rp = sub.add_parser("replay", parents=[common],
                        help="play a comparison's recorded steps in the live dashboard's views, side by side")
    rp.add_argument("results", type=Path, help="the results.json that `bench compare` wrote (e.g. docs/lab)")
    rp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    rp.add_argument("--port", type=int, default=8001, help="port to listen on")
    sw = sub.add_parser("sweep", parents=[common],
                        help="one engine knob (or a grid) over a range, same requests each point; a table and plots")
    sw.add_argument("--knob", action="append", required=True, metavar="NAME=V1,V2,...",
                    help="a knob and its values, e.g. max_num_seqs=8,16,32; repeat for a grid (knobs: "
                         "max_num_seqs, max_num_batched_tokens, block_size, gpu_memory_utilization, "
                         "kv_cache_memory, num_kv_blocks, scheduler)")
    sw_loop = sw.add_mutually_exclusive_group()
    sw_loop.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    sw_loop.add_argument("--request-rate", type=_rate, default=float("inf"),
                         help="open loop: Poisson arrivals per second (default inf: all at once)")
    sw.add_argument("--out-dir", type=Path, default=None,
                    help="where sweep.md, sweep.json and the plot go (default: bench-results/sweep-YYYYmmdd-HHMMSS)")
    add_workload_args(sw)
    add_engine_args(sw)
    add_stress_parser(sub, common)
    tu = sub.add_parser("tune", parents=[common], help="search max_num_seqs, max_num_batched_tokens and the strategy "
                        "for the highest goodput under a TTFT/TPOT SLO (also `conveyor tune`)")
    tu_loop = tu.add_mutually_exclusive_group()
    tu_loop.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    tu_loop.add_argument("--request-rate", type=_rate, default=float("inf"),
                         help="open loop: Poisson arrivals per second (default inf: all at once)")
    tu.add_argument("--slo-attainment", type=float, default=0.9,
                    help="the share of requests that must meet both SLOs for a configuration to meet the SLO")
    tu.add_argument("--time-budget", type=float, default=900.0,
                    help="seconds after which no new configuration is started")
    tu.add_argument("--results", type=Path, default=None,
                    help="JSON-lines file of measured points, appended as they come; a rerun with the same file "
                         "and workload resumes (default: bench-results/tune-<workload hash>.jsonl)")
    tu.add_argument("--strategies", default=",".join(default_strategies("tune")), help="strategies to search")
    tu.add_argument("--seqs", default="16,64,256", help="max_num_seqs values of the coarse grid")
    tu.add_argument("--tokens", default="512,2048,8192", help="max_num_batched_tokens values of the coarse grid")
    add_workload_args(tu)
    add_engine_args(tu)
    # parsed by cmd_study itself (everything after NAME is the study's): here for `conveyor bench --help`
    sub.add_parser("study", add_help=False, help="list the studies in benchmarks/, or run one: "
                   "`conveyor bench study NAME [ARGS...]` (from a source checkout)")
    return document(parser)


def cmd_replay(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.bench.replay import build_replay_app

    try:
        app = build_replay_app(str(args.results))
    except (OSError, ValueError) as e:
        print(f"conveyor bench: error: {e}", file=sys.stderr)
        return 2
    print(f"open http://{args.host}:{args.port}/dashboard/compare (one strategy: /dashboard?replay=NAME)")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_study(argv: list[str]) -> int:
    """`conveyor bench study [NAME [ARGS...]]`: list the studies, or run benchmarks/NAME.py (or .sh) with ARGS in
    place of this process, recording this command line as the one its result names."""
    from conveyor.bench import study

    folder = study.STUDIES
    found = study.studies(folder) if folder.is_dir() else {}
    if not found:
        print(f"conveyor bench study: error: no studies here: they are the scripts in benchmarks/ of a source "
              f"checkout, and there is none beside this conveyor ({folder.parent}; an installed wheel has none). "
              "Run it from a clone of the repository.", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: conveyor bench study [NAME [ARGS...]]\n\nThe studies in "
              f"{folder}/ (`conveyor bench study NAME --help` for one's flags):\n")
        width = max(map(len, found))
        for name, path in found.items():
            print(f"  {name:<{width}}  {study.describe(path)}")
        return 0
    name, args = argv[0], argv[1:]
    path = found.get(name) or found.get(Path(name).stem)
    if path is None:
        print(f"conveyor bench study: error: no study {name!r}; the studies: {', '.join(found)}", file=sys.stderr)
        return 2
    if path.suffix == ".sh" and args[:1] in (["-h"], ["--help"]):  # a shell script takes no --help: its header
        print("\n".join(line.lstrip("#") for line in path.read_text().splitlines()[1:] if line.startswith("#")))
        return 0
    cmd = [sys.executable, str(path), *args] if path.suffix == ".py" else ["bash", str(path), *args]
    typed = list(getattr(sys, "orig_argv", None) or sys.argv)
    if len(typed) > 1 and Path(typed[1]).name == "conveyor":  # the console script: as the user typed it
        typed = typed[1:]
        typed[0] = "conveyor"
    # the study imports this conveyor (its checkout first on the path) and records the command typed here
    env = {**os.environ, study.STUDY_ARGV_ENV: json.dumps(typed),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(folder.parent), os.environ.get("PYTHONPATH")]))}
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name != "posix":
        import subprocess

        return subprocess.call(cmd, env=env)
    import shutil

    os.execve(shutil.which(cmd[0]) or cmd[0], cmd, env)  # the study replaces this process: its signals, its exit code
    raise AssertionError("unreachable: execve returned")


def main(argv: list[str]) -> int:
    argv = list(argv)
    if argv and argv[0] == "study":
        return cmd_study(argv[1:])
    parser = build_parser()
    if not argv or argv[0] not in ("run", "compare", "report", "replay", "stress", "sweep", "tune", "-h", "--help"):
        argv = ["run", *argv]  # `conveyor bench` alone means `conveyor bench run`
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "report":
        return cmd_report(args)
    if args.command == "stress":
        return cmd_stress(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.threads is not None:
        import torch

        if args.threads < 1:
            print("conveyor bench: error: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    try:
        if args.command == "compare":
            return cmd_compare(args, argv)
        if args.command == "sweep":
            return cmd_sweep(args)
        if args.command == "tune":
            return cmd_tune(args)
        return cmd_run(args)
    except ValueError as e:
        print(f"conveyor bench: error: {e}", file=sys.stderr)
        return 2


def cmd_run(args: argparse.Namespace) -> int:
    from conveyor.bench.compare import set_peak
    from conveyor.bench.loadgen import LoadPattern
    from conveyor.bench.result import format_result
    from conveyor.bench.run import run_once
    from conveyor.bench.stats import FlopModel, measure_peak_flops
    from conveyor.bench.workloads import generate

    spec = workload_from_args(args)
    load = LoadPattern(concurrency=args.concurrency, request_rate=args.request_rate, burstiness=args.burstiness,
                       seed=args.seed, timeout_s=args.timeout)
    meta = {"label": f"{'in-process ' + args.scheduler if args.in_process else args.url} @ {load.label}",
            "workload": vars(spec), "load": load.label, "concurrency": args.concurrency,
            "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate}
    from conveyor.bench import lora as bench_lora

    modules = bench_lora.parse_modules(args.lora_modules, need_paths=args.in_process)
    if not modules and args.lora_spread and not args.in_process:
        modules = bench_lora.http_adapters(args.url, args.api_key)
    adapters = bench_lora.choose(modules, args.lora_spread)
    if adapters:
        meta["lora"] = {"adapters": [n for n, _ in adapters]}
    if args.in_process:
        from conveyor.bench.engine_backend import EngineBackend
        from conveyor.engine.llm_engine import LLMEngine

        config = lab_engine_config(args)
        if adapters and not config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        engine = LLMEngine(config)
        loras = bench_lora.lora_requests(adapters)
        if loras:
            bench_lora.preload(engine, loras)
        backend, cfg, max_len = EngineBackend(engine, loras), engine.model_config, engine.max_model_len
        dtype, device, pid = engine.info.torch_dtype, engine.info.torch_device, None
        meta["strategy"] = config.scheduler
    else:
        from conveyor.bench.http_backend import HttpBackend, find_listening_pid
        from conveyor.model.loader import load_checkpoint
        from conveyor.runner.model_runner import resolve_device, resolve_dtype

        cfg = load_checkpoint(args.model, args.tokenizer).config  # vocab for prompts, shapes for FLOPs
        backend, max_len = HttpBackend(args.url, args.served_model, api_key=args.api_key), args.max_model_len
        device = resolve_device(args.device)
        dtype, pid = resolve_dtype(args.dtype, device), args.server_pid or find_listening_pid(args.url)
    requests = bench_lora.spread(generate(spec, cfg.vocab_size, max_len), [n for n, _ in adapters])
    peak = measure_peak_flops(dtype, device, n=args.peak_matmul_size)
    make = lambda: run_once(backend, requests, load, flop_model=FlopModel.from_config(cfg), peak_flops=peak,
                            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, server_pid=pid,
                            progress=args.progress, meta=meta)
    if args.in_process:  # the engine steps on this thread, which loaded it (see run_on_this_thread)
        from conveyor.bench.engine_backend import run_on_this_thread

        res = run_on_this_thread(backend, make)
    else:
        res = asyncio.run(make())
    # a shared machine's peak varies: use the best of before and after the run
    set_peak(res, max(peak, measure_peak_flops(dtype, device, n=args.peak_matmul_size)))
    if adapters:
        res.meta["lora"]["per_adapter"] = bench_lora.per_adapter(res, requests)
    print(format_result(res))
    if adapters:
        print(bench_lora.format_lora(res.meta))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res.to_json(), indent=1))
        print(f"result written to {args.out}")
    return 0 if res.completed else 1


def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    from conveyor.bench.compare import CompareSpec, run_compare
    from conveyor.bench.report import write_report
    from conveyor.engine.llm_engine import LLMEngine

    spec = CompareSpec(strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
                       baseline=args.baseline, request_rates=args.request_rates, table_rate=args.table_rate,
                       burstiness=args.burstiness, workload=workload_from_args(args), slo_ttft_ms=args.slo_ttft_ms,
                       slo_tpot_ms=args.slo_tpot_ms, timeout_s=args.timeout,
                       peak_matmul_size=args.peak_matmul_size)
    base = lab_engine_config(args)
    engine = LLMEngine(base)
    data = run_compare(engine, base, spec, progress=args.progress)
    command = "conveyor bench " + shlex.join(argv)
    out_dir = args.out_dir or Path("bench-results") / time.strftime("compare-%Y%m%d-%H%M%S")
    path = write_report(data, out_dir, command)
    print(path.read_text().split("## The seed's claims, tested")[0])
    print(f"report written to {path}")
    print(f"watch the runs in the live dashboard's views: conveyor bench replay {out_dir / 'results.json'}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from conveyor.bench.sweep import SweepSpec, parse_knob, run_sweep, write
    from conveyor.engine.llm_engine import LLMEngine

    knobs = dict(parse_knob(k) for k in args.knob)
    spec = SweepSpec(knobs=knobs, workload=workload_from_args(args), concurrency=args.concurrency,
                     request_rate=args.request_rate, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                     timeout_s=args.timeout)
    base = lab_engine_config(args)
    engine = LLMEngine(base)
    results = run_sweep(engine, base, spec, progress=args.progress)
    out_dir = args.out_dir or Path("bench-results") / time.strftime("sweep-%Y%m%d-%H%M%S")
    paths = write(results, out_dir)
    print(paths[1].read_text())
    print("written: " + ", ".join(str(p) for p in paths))
    return 0 if any(p["result"] for p in results["points"]) else 1


def cmd_tune(args: argparse.Namespace) -> int:
    from conveyor.bench.tune import Tuner, TuneSpec, fingerprint, format_answer
    from conveyor.engine.llm_engine import LLMEngine

    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ValueError("conveyor tune needs both --slo-ttft-ms and --slo-tpot-ms")
    ints = lambda text: tuple(int(x) for x in text.split(",") if x.strip())
    spec = TuneSpec(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, workload=workload_from_args(args),
                    concurrency=args.concurrency, request_rate=args.request_rate, slo_attainment=args.slo_attainment,
                    strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
                    seqs=ints(args.seqs), tokens=ints(args.tokens), time_budget_s=args.time_budget,
                    timeout_s=args.timeout)
    base = lab_engine_config(args)
    results = args.results or Path("bench-results") / f"tune-{fingerprint(base, spec)[:10]}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(base)
    ans = Tuner(engine, base, spec, results, progress=args.progress).run()
    print(format_answer(ans, spec, serve_flags(base)))
    print(f"measured points: {results}")
    return 0 if ans["best"] is not None else 1


def serve_flags(base) -> list[str]:
    """The engine flags that differ from the defaults, as `conveyor serve` takes them."""
    from conveyor.config import EngineConfig

    defaults = EngineConfig()
    out = ["--model", base.model]
    for name in ("dtype", "device", "block_size", "kv_cache_memory", "gpu_memory_utilization", "max_model_len",
                 "quantization", "kv_cache_dtype", "threads"):
        value = getattr(base, name)
        if value is not None and value != getattr(defaults, name):
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render the Markdown and plots from saved numbers (same command line, nothing re-measured)."""
    from conveyor.bench.report import write_report
    from conveyor.bench.result import CompareResults

    data = CompareResults.from_json(json.loads(args.results.read_text()))
    path = write_report(data, args.out_dir or args.results.parent, data.command or "(unknown command)")
    print(f"report written to {path}")
    print(f"watch the runs in the live dashboard's views: conveyor bench replay {path.parent / 'results.json'}")
    return 0
