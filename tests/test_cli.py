"""Every command-line flag explains itself and shows its default."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys

import pytest

from conveyor.bench.cli import build_parser
from conveyor.cli import main


def flags(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, prefix + name + " ")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield prefix, action


def test_every_bench_flag_has_help_with_its_default():
    for where, action in flags(build_parser(), "bench "):
        assert action.help, f"{where}{action.option_strings} has no help"
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            assert "default" in action.help, f"{where}{action.option_strings}: help shows no default"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_serve_and_generate_flag_has_help_with_its_default(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    text = out.getvalue()
    for flag in ("--port", "--host", "--max-model-len", "--max-num-seqs", "--seed", "--quantization",
                 "--kv-cache-dtype", "--engine-loop", "--scheduler", "--batch-size"):
        if command == "generate" and flag in ("--port", "--host", "--engine-loop"):
            continue
        i = text.index("\n  " + flag + " ")  # its entry in the options list, not the usage line
        entry = text[i:text.find("\n  -", i + 1)]
        assert "default" in entry, f"{command} {flag}: {entry!r}"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, usage, hint", [
    (["serve", "--modle", "x"], "usage: conveyor serve", "did you mean --model?"),
    (["serve", "--max-num-sqes", "4", "--port", "0"], "usage: conveyor serve", "did you mean --max-num-seqs?"),
    (["generate", "hi", "--max-tokns", "3"], "usage: conveyor generate", "did you mean --max-tokens?"),
    (["bench", "run", "--concurency", "4"], "usage: conveyor bench run", "did you mean --concurrency?"),
    (["serv"], "usage: conveyor ", "did you mean 'serve'?"),
])
def test_a_near_miss_gets_the_subcommands_usage_and_did_you_mean(argv, usage, hint):
    code, _, err = run_cli(argv)
    assert code == 2
    assert err.startswith(usage), err
    assert hint in err, err


def test_an_unknown_flag_far_from_any_gets_no_guess():
    code, _, err = run_cli(["serve", "--zzzzzz"])
    assert code == 2 and "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_help_and_parsing_import_no_torch_or_web_stack():
    """`--help` and argument errors answer at once because parsing imports none of the heavy stack."""
    code = ("import contextlib, io, sys\n"
            "from conveyor.cli import main\n"
            "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['serve', '--modle', 'x']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'transformers', 'ray') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_help_groups_its_flags():
    _, text, _ = run_cli(["serve", "--help"])
    titles = ["\nserver:", "\nengine (", "\nscheduler (", "\nmemory (", "\nkernels (", "\nscale-out"]
    where = [text.index(t) for t in titles]
    assert where == sorted(where), text
    kernels = text[text.index("\nkernels ("):text.index("\nscale-out")]
    assert "--attention-backend" in kernels and "--threads" in kernels
    scheduler = text[text.index("\nscheduler ("):text.index("\nmemory (")]
    assert "--max-num-seqs" in scheduler and "--batch-size" in scheduler


def test_bench_run_help_shows_client_flags_first_and_the_default_url():
    _, text, _ = run_cli(["bench", "run", "--help"])
    client, engine = text.index("\nclient"), text.index("\nin-process engine (")
    assert client < text.index("\nworkload:") < engine
    assert "--url URL" in text[client:engine] and "(default: http://127.0.0.1:8000)" in text[client:engine]
    assert "--model" in text[engine:] and "--model" not in text[client:engine]


def test_engine_flags_round_trip_into_the_config():
    """Every engine flag lands in its EngineConfig field; the defaults are EngineConfig's."""
    from conveyor.cli import build_parser
    from conveyor.config import EngineConfig
    from conveyor.engine.args import engine_config_from_args
    from conveyor.scheduler.policies import all_options

    args = build_parser().parse_args(["serve"])
    cli_defaults = {o.name: o.cli_default for o in all_options() if o.cli_default is not None}
    assert engine_config_from_args(args) == EngineConfig(**cli_defaults)
    assert engine_config_from_args(args, {"kv_cache_populate": True}).kv_cache_populate is True
    args = build_parser().parse_args(["serve", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--scheduler",
                                      "static", "--batch-size", "3", "-q", "int8", "--no-kv-cache-populate",
                                      "--kv-cache-memory", "0.5", "--threads", "2", "--admission-reserve"])
    cfg = engine_config_from_args(args, {"kv_cache_populate": True}, served_model_name="m")
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.scheduler, cfg.batch_size, cfg.quantization,
            cfg.kv_cache_populate, cfg.kv_cache_memory, cfg.threads, cfg.admission_reserve,
            cfg.served_model_name) == (7, False, "static", 3, "int8", False, 0.5, 2, True, "m")
