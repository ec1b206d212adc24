"""The engine's command-line flags, made once from EngineConfig's fields (engine/config.py) for every command that
builds an engine: `fastserve serve` (server.py), `simulate` and `compare` (as vLLM's EngineArgs.add_cli_args).

    add_engine_args(parser)            one flag per field: --field-name (or its metadata's "flag"), the field's
                                       default, its metadata's help and choices; a bool is --x / --no-x; an
                                       optional value also takes "none"
    config_from_args(args)             the EngineConfig those flags give (ValueError on bad values)
    engine_args_given(args)            {field: value} of the flags the command line set, in the order given
    engine_argv(values)                the flags that set those values: what `compare` passes on to its servers
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Collection, Mapping
from dataclasses import Field, fields
from typing import Any

from engine.config import EngineConfig

_GIVEN = "_engine_args_given"  # the namespace attribute that lists the fields set on the command line
FIELDS: dict[str, Field] = {f.name: f for f in fields(EngineConfig)}
_HINTS = typing.get_type_hints(EngineConfig)


def engine_flag(name: str) -> str:
    """The flag of EngineConfig field `name`."""
    return FIELDS[name].metadata.get("flag") or "--" + name.replace("_", "-")


def _is_switch(name: str) -> bool:
    hint = _HINTS[name]
    return bool in (typing.get_args(hint) or (hint,))


def _value_type(name: str):
    """int, float or str from the field's type; an optional one also takes "none" (or "off")."""
    members = typing.get_args(_HINTS[name]) or (_HINTS[name],)
    base = next(m for m in members if m is not type(None))
    if type(None) not in members:
        return base

    def parse(text: str):
        return None if text.lower() in ("none", "off") else base(text)

    parse.__name__ = base.__name__  # argparse says "invalid int value"
    return parse


def _record(namespace: argparse.Namespace, name: str) -> None:
    given = getattr(namespace, _GIVEN, None)
    if given is None:
        given = {}
        setattr(namespace, _GIVEN, given)
    given.pop(name, None)
    given[name] = None  # a dict: the order the flags came in, each once


class _Value(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _record(namespace, self.dest)


class _Switch(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = (),
                    title: str = "engine settings") -> argparse._ArgumentGroup:
    """One flag per EngineConfig field but those in `exclude`, in an argument group named `title`; a help that
    does not say its default gets "(default: X)"."""
    unknown = set(exclude) - set(FIELDS)
    if unknown:
        raise ValueError(f"not EngineConfig fields: {sorted(unknown)}")
    group = parser.add_argument_group(title, "engine/config.py; the same flags in fastserve serve, simulate "
                                             "and compare")
    for name, f in FIELDS.items():
        if name in exclude:
            continue
        text = f.metadata["help"]
        if "default" not in text:
            text += " (default: %(default)s)"
        if _is_switch(name):
            action = group.add_argument(engine_flag(name), dest=name, action=_Switch, default=f.default)
        else:
            action = group.add_argument(engine_flag(name), dest=name, action=_Value, default=f.default,
                                        type=_value_type(name), choices=f.metadata.get("choices"))
        action.help = text  # set after: BooleanOptionalAction appends its own "(default: ...)" on some Pythons
    return group


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of parsed flags (fields missing from `args` keep their defaults); `overrides` win."""
    values = {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    return EngineConfig(**(values | overrides))


def engine_args_given(args: argparse.Namespace) -> dict[str, Any]:
    """{field: parsed value} of the engine flags the command line set (a default that was not typed is not
    given), in the order they came."""
    return {name: getattr(args, name) for name in getattr(args, _GIVEN, {})}


def engine_argv(values: Mapping[str, Any]) -> list[str]:
    """The flags that set these EngineConfig fields to these values (parsing them gives the values back)."""
    argv: list[str] = []
    for name, value in values.items():
        flag = engine_flag(name)
        if _is_switch(name):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} sets True or False, not {value!r}")
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            argv += [flag, "none" if value is None else str(value)]
    return argv


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`PROG: error: MESSAGE`) and exit status 2, no usage dump:
    every command's parser."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
