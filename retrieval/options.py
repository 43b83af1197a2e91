"""Options declared once: a spec's dataclass field carries its type, its default and its help (``option``); the
command line's flags, the service's /info and the documentation's tables are read from those fields.

    @dataclass(frozen=True)
    class ServeOptions:
        max_batch: int = option(32, "Micro-batching: queries per engine batch.")

    markdown_table(ServeOptions)   # | option | type | default | meaning |, one row per documented field
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HELP = "help"


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with ``default`` and its ``help`` (one sentence or two, as ``--help`` shows it). Other
    ``metadata`` is the front ends': ``flag_decls`` (the command line's spelling when it is not ``--name``),
    ``default_help`` (what a default of None means), ``cli=False`` (not a command-line option), ``group``;
    ``cli_type`` and ``cli_default`` where the command line reads the value otherwise (a flag for a spec object,
    text for a parsed filter)."""
    return dataclasses.field(default=default, metadata={HELP: help, **metadata})


@dataclass(frozen=True)
class Described:
    """One documented field of a spec: its name, type (as written), default and help, and its other metadata."""

    name: str
    type: str
    default: Any
    help: str
    metadata: dict[str, Any]


def described(spec: type) -> Iterator[Described]:
    """The documented fields of the dataclass ``spec``, in declaration order (fields without help are internal)."""
    hints = typing.get_type_hints(spec)
    for field in dataclasses.fields(spec):
        if HELP not in field.metadata:
            continue
        kind = field.metadata.get("cli_type", hints.get(field.name, field.type))
        shown = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        extra = {key: value for key, value in field.metadata.items() if key != HELP}
        default = field.metadata.get("cli_default", field.default)
        yield Described(field.name, shown, default, field.metadata[HELP], extra)


def help_of(spec: type, name: str) -> str:
    """The help of field ``name`` of ``spec``."""
    for field in dataclasses.fields(spec):
        if field.name == name:
            return str(field.metadata[HELP])
    raise KeyError(f"{spec.__name__} has no field {name!r}")


def markdown_table(spec: type) -> str:
    """The documented fields of ``spec`` as a markdown table: option (as the command line spells it), type,
    default, meaning. What the documentation's option tables are generated from."""
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for item in described(spec):
        flag = (item.metadata.get("flag_decls") or ["--" + item.name.replace("_", "-")])[0]
        name = item.name if item.metadata.get("cli") is False else flag  # not a flag: the service's own limit
        default = item.metadata.get("default_help", "") if item.default is None else f"`{item.default}`"
        meaning = item.help.replace("\\[", "[").replace("|", "\\|")
        kind = item.type.replace("|", "\\|")
        rows.append(f"| `{name}` | `{kind}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def values(spec_object: Any) -> dict[str, dict[str, Any]]:
    """The documented fields of a spec object: each one's value, default and help (what /info shows of the
    server's options)."""
    return {
        item.name: {"value": getattr(spec_object, item.name), "default": item.default, "help": item.help}
        for item in described(type(spec_object))
    }
