"""The engine's options are declared once: `EngineConfig` holds each default, `config.CHOICES` each set of
allowed values, and the command line (conveyor/engine/args.py) is generated from them."""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from dataclasses import MISSING, fields

import pytest

from conveyor.config import CHOICES, EngineConfig
from conveyor.engine import args as engine_args
from conveyor.engine.args import add_engine_args, engine_config_from_args, engine_flags
from conveyor.scheduler.policies import POLICIES, all_options

# fields that are not engine flags: a server flag (`serve --served-model-name`), and two knobs for tests
# and the lab (`bench --num-kv-blocks`), each passed to engine_config_from_args by the command that has it
NOT_ENGINE_FLAGS = {"served_model_name", "num_kv_blocks", "kv_cache_memory_fraction"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser()._actions if a.dest != "help"}


def test_every_field_is_a_flag_or_named_as_not_one() -> None:
    names = {f.name for f in fields(EngineConfig)}
    flags = {f.name for f in engine_flags()}
    assert flags <= names, flags - names
    assert names - flags == NOT_ENGINE_FLAGS


def test_every_flag_defaults_to_the_dataclass_default() -> None:
    """The parser's default is EngineConfig's, so the dataclass is the one place a default is written
    (a policy table's own CLI default, or a flag the command decides, are the declared exceptions)."""
    overrides = {o.name: o.cli_default for o in all_options() if o.cli_default is not None}
    decided = {f.name for f in engine_flags() if f.command_decides}
    for f in fields(EngineConfig):
        if f.name in NOT_ENGINE_FLAGS:
            continue
        expected = overrides.get(f.name, None if f.name in decided else f.default)
        assert f.default is not MISSING
        assert actions()[f.name].default == expected, f.name


def test_choices_are_declared_once() -> None:
    """Only the scheduler's flag names its choices (the policy table's); the rest come from config.CHOICES,
    which is also what EngineConfig checks."""
    declared = {f.name: f.choices for f in engine_flags() if f.choices is not None}
    assert declared == {"scheduler": tuple(POLICIES)}
    acts = actions()
    for name, choices in CHOICES.items():
        assert tuple(acts[name].choices) == choices, name
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: "no-such-choice"})
    assert [c for c in acts["scheduler"].choices] == list(POLICIES)


def test_defaults_parse_into_the_default_config() -> None:
    cfg = engine_config_from_args(parser().parse_args([]))
    overrides = {o.name: o.cli_default for o in all_options() if o.cli_default is not None}
    assert cfg == EngineConfig(**overrides)


def test_engine_config_from_args_has_no_per_option_code() -> None:
    """No option's name appears in the code that turns flags into a config: it reads the table."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(engine_config_from_args)))
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {f.name for f in fields(EngineConfig)}
    docstring = ast.get_docstring(tree.body[0])
    assert not (strings - {docstring}) & names
    assert not attrs & names
    assert engine_args.engine_config_from_args is engine_config_from_args
