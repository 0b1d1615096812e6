"""Flags drawn from a config dataclass, and back: a field whose metadata has a "help" is a flag, --field-name unless
the metadata names another ("flag"), parsed into the field's name. A bool flag turns its field away from the
default (store_true, or store_false for a field that defaults to True); a `bool | None` field gets --x and --no-x
(None when neither is given); int, float and str fields take a value of
that type; a field of any other type takes its text, which the config's converter parses. Old spellings of a flag
("deprecated": a tuple of them) still set its field for one release, left out of --help, with a warning."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Iterable

from blockspec.errors import ConfigError

_SCALARS = (int, float, str)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _default(f: dataclasses.Field) -> Any:
    return None if f.default is dataclasses.MISSING else f.default


def _argument(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    if hint is bool:
        return {"action": "store_false" if f.default else "store_true", "help": f.metadata["help"]}
    if set(typing.get_args(hint)) == {bool, type(None)}:  # None: the command decides; --x / --no-x say it
        return {"action": argparse.BooleanOptionalAction, "default": None, "help": f.metadata["help"]}
    kinds = [t for t in typing.get_args(hint) or (hint,) if t in _SCALARS]
    kw = {"type": kinds[0] if kinds else str, "default": _default(f), "help": f.metadata["help"]}
    kw.update({k: f.metadata[k] for k in ("metavar", "choices") if k in f.metadata})
    return kw


def add_config_flags(p: argparse._ActionsContainer, cls: type, names: Iterable[str] | None = None,
                     skip: Iterable[str] = (), **overrides: dict[str, Any]) -> None:
    """The flags of `cls`'s fields (only `names` when given, less `skip`) on a parser or an argument group;
    overrides: field name -> add_argument keywords a command words its own way ("flag" renames the flag; the value
    still lands in the field's name)."""
    names, skip = (None if names is None else set(names)), set(skip)
    fields = [f for f in flag_fields(cls) if (names is None or f.name in names) and f.name not in skip]
    unknown = ((names or set()) | skip | set(overrides)) - {f.name for f in flag_fields(cls)}
    if unknown:  # a typo in a command's table would silently drop a flag
        raise ValueError(f"{cls.__name__} has no flag fields {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    for f in fields:
        kw = {**_argument(f, hints[f.name]), **overrides.get(f.name, {})}
        flag = kw.pop("flag", flag_name(f))
        if "action" not in kw:  # shown as argparse shows a flag's own name, not as the field's
            kw.setdefault("metavar", flag[2:].replace("-", "_").upper())
        action = p.add_argument(flag, dest=f.name, **kw)
        for old in f.metadata.get("deprecated", ()):
            add_deprecated_alias(p, old, action)


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: it sets the flag's field as the flag does, and says once on
    stderr which flag to use instead."""

    def __init__(self, option_strings: list[str], dest: str, use: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.use, self.warned = use, False

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if not self.warned:
            print(f"blockspec: warning: {option_string} is deprecated, use {self.use}", file=sys.stderr)
            self.warned = True
        setattr(namespace, self.dest, values)


def add_deprecated_alias(p: argparse._ActionsContainer, old: str, new: argparse.Action) -> None:
    """`old` as a deprecated spelling of the value flag `new` (what add_argument returned): the same field, type
    and choices, hidden from --help, a warning when used."""
    p.add_argument(old, action=DeprecatedAlias, use=new.option_strings[0], dest=new.dest, type=new.type,
                   choices=new.choices, metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def name_the_flag(e: ConfigError, cls: type) -> ConfigError:
    """`e`, about a field of `cls`, to start with the field's flag where it has one: the user typed the flag."""
    names = {f.name: flag_name(f) for f in flag_fields(cls)}
    return ConfigError(f"{names[e.field]}: {e}", field=e.field) if e.field in names else e


def flags_given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Field name -> value of the flags of `cls` this command registered and that differ from the field's default
    (so that an unset flag leaves the config's own default in place). The flags are found by their field names: a
    command registers no other flag under the name of a field of a config it converts."""
    given = {}
    for f in flag_fields(cls):
        value = getattr(args, f.name, None)
        if value is not None and value != _default(f):
            given[f.name] = value
    return given
