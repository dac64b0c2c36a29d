"""Command-line flags generated from config dataclasses: one flag per field, its help the field's.

A field made with `arg(default, help)` becomes `--field-name` (plus any `aliases`); its type picks the
parsing: `bool` a `--x/--no-x` pair, a `Literal` its choices, `int | None` an int, `int | str` a string
parsed later. A field whose type is itself such a dataclass adds that dataclass's flags under a group
named by its `help`. `from_namespace` builds the config back from the parsed flags and `changed_flags`
writes a config as the flags that reproduce it (what a child process is started with).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import field
from typing import Any, Literal


def arg(
    default: Any,
    help_text: str,
    *,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    nargs: str | None = None,
    **kwargs,
):
    """A field whose help text doubles as the CLI flag's help; `nargs="+"` for a tuple of values."""
    metadata = {"help": help_text, "aliases": aliases, "metavar": metavar, "nargs": nargs}
    return field(default=default, metadata=metadata, **kwargs)


def section(cls: type, title: str):
    """A field holding a nested config, whose flags appear under `title` in --help."""
    return field(default_factory=cls, metadata={"help": title})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of `cls` in a group `title`; nested configs in groups of their own."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        hint = hints[spec.name]
        if dataclasses.is_dataclass(hint):
            add_flags(parser, hint, spec.metadata["help"])
            continue
        flags = (flag_name(spec.name), *spec.metadata.get("aliases", ()))
        options: dict[str, Any] = {"dest": spec.name, "default": spec.default, "help": spec.metadata["help"]}
        kind, choices = flag_type(hint)
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
            continue
        if spec.metadata.get("metavar"):
            options["metavar"] = spec.metadata["metavar"]
        if spec.metadata.get("nargs"):
            options["nargs"] = spec.metadata["nargs"]
        group.add_argument(*flags, type=kind, choices=choices, **options)


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """`cls` (nested configs included) from the flags `add_flags` added."""
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in dataclasses.fields(cls):
        hint = hints[spec.name]
        nested = dataclasses.is_dataclass(hint)
        values[spec.name] = from_namespace(hint, namespace) if nested else getattr(namespace, spec.name)
    return cls(**values)


def changed_flags(config: Any, exclude: frozenset[str] = frozenset()) -> list[str]:
    """The flags that give `config`'s fields that differ from their defaults (nested ones included),
    except the fields named in `exclude`."""
    flags: list[str] = []
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if spec.name in exclude:
            continue
        if dataclasses.is_dataclass(value):
            flags += changed_flags(value, exclude)
        elif value != spec.default:
            if isinstance(value, bool):
                flags.append(flag_name(spec.name) if value else "--no-" + flag_name(spec.name)[2:])
            elif isinstance(value, (tuple, list)):
                flags += [flag_name(spec.name), *map(str, value)]
            else:
                flags += [flag_name(spec.name), str(value)]
    return flags


def flag_type(hint: Any) -> tuple[type, tuple | None]:
    """(type, choices): `int | None` -> (int, None), `int | str` -> (str, None) (parsed later),
    `Literal["a", "b"] | None` -> (str, ("a", "b"))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if str in args:
            return str, None
        return flag_type(args[0])
    if typing.get_origin(hint) in (tuple, list):  # a flag with nargs: its elements' type
        return flag_type(typing.get_args(hint)[0])
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), choices
    return hint, None


def check_choice(name: str, value: Any, choices: Any) -> None:
    """ValueError naming `name` unless `value` is one of the `Literal` `choices`."""
    allowed = typing.get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def json_object(text: str, flag: str) -> dict:
    """A flag's JSON object; ValueError (one line, naming `flag`) for bad JSON or another JSON type."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not valid JSON: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return values
