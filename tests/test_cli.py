"""Every command-line flag explains itself and shows its default."""

from __future__ import annotations

import argparse
import contextlib
import io

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
