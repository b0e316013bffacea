"""argparse, with errors that help and help that shows defaults: what every conveyor command line uses
(`conveyor generate | serve`, conveyor/cli.py; `conveyor bench | tune`, conveyor/bench/cli.py).

Standard library only, so that parsing a command line imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import difflib

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
