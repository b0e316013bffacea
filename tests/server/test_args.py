"""`ServerArgs` is the one declaration of the server's settings: the flags are generated from its fields."""

from __future__ import annotations

import argparse
from dataclasses import fields

from conveyor.server.args import ServerArgs, add_server_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args(argv)


def test_defaults_are_the_dataclass_defaults(monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("CONVEYOR_RESPONSES_DIR", raising=False)
    assert ServerArgs.from_namespace(parse([])) == ServerArgs()


def test_every_field_has_a_flag_with_help() -> None:
    p = argparse.ArgumentParser()
    add_server_args(p)
    by_dest = {a.dest: a for a in p._actions}
    for f in fields(ServerArgs):
        assert f.name in by_dest, f.name
        assert by_dest[f.name].help, f.name


def test_flags_and_environment_reach_the_fields(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_API_KEY", "k")
    monkeypatch.setenv("CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING", "true")
    args = ServerArgs.from_namespace(parse(["--port", "9", "--engine-loop", "process", "--pooling", "mean",
                                            "--lora-modules", "a=/x", "b=/y", "--disable-log-requests"]))
    assert (args.port, args.engine_loop, args.pooling, args.lora_modules, args.disable_log_requests) == \
        (9, "process", "mean", ["a=/x", "b=/y"], True)
    assert args.api_key == "k" and args.allow_runtime_lora_updating is True
