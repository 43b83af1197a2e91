"""Metadata filters: one typed structure, parsed from ``--where`` text or from JSON, evaluated by pyarrow compute.

A filter is a tree of ``And`` / ``Or`` / ``Not`` over ``Cond(column, op, value)``: ``=``, ``!=``, ``<``, ``<=``,
``>``, ``>=`` against a literal, ``in`` / ``not in`` a list of literals, ``is null`` / ``is not null``. The text
form is a small grammar of our own (``year >= 2020 and source in ('pubmed', 'arxiv')``); the JSON form is
``{"and": [...]}``, ``{"or": [...]}``, ``{"not": {...}}`` or ``{"column": "year", "op": ">=", "value": 2020}``.
Both become the same frozen dataclasses (hashable: the service groups searches by their parameters), and only
``evaluate`` reads data: pyarrow compute over the columns an index kept, nothing else. A filter names columns
and literals, never a function, a file or an expression, so it cannot reach beyond the kept columns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.errors import ConfigError
from retrieval.text import valid_unicode

COMPARISONS = {"=": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal"}
OPS = (*COMPARISONS, "in", "not in", "is null", "is not null")
MAX_NODES = 1000  # conditions and connectives in one filter: a bigger one is not a filter a person wrote
MAX_TEXT = 10_000
MAX_DEPTH = 50  # nested parentheses or connectives (a deeper one would exhaust the parser's stack first)

Literal = str | int | float | bool


class FilterError(ConfigError):
    """A filter that cannot be evaluated: a syntax error, an unknown column, a value of the wrong type."""

    def __init__(self, message: str):
        super().__init__(message, "where")


@dataclass(frozen=True)
class Cond:
    column: str
    op: str
    value: Literal | tuple[Literal, ...] | None = None


@dataclass(frozen=True)
class And:
    items: tuple[Filter, ...]


@dataclass(frozen=True)
class Or:
    items: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    item: Filter


Filter = Cond | And | Or | Not


# ----- the text form -------------------------------------------------------------------------------------
TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>'(?:[^']|'')*'|"(?:[^"]|"")*")
      | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
      | (?P<op><=|>=|!=|<>|==|=|<|>)
      | (?P<punct>[(),])
      | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
    )""",
    re.VERBOSE,
)
KEYWORDS = {"and", "or", "not", "in", "is", "null", "true", "false"}


def _tokens(text: str) -> list[tuple[str, Any, int]]:
    out: list[tuple[str, Any, int]] = []
    position = 0
    while position < len(text):
        if text[position:].strip() == "":
            break
        match = TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise FilterError(f"`where`: cannot read {text[position:].strip()[:20]!r} at character {position + 1}")
        kind = match.lastgroup
        assert kind is not None
        raw = match.group(kind)
        start = match.start(kind)
        if kind == "string":
            out.append(("literal", raw[1:-1].replace(raw[0] * 2, raw[0]), start))
        elif kind == "number":
            out.append(("literal", float(raw) if any(c in raw for c in ".eE") else int(raw), start))
        elif kind == "word" and raw.lower() in ("true", "false"):
            out.append(("literal", raw.lower() == "true", start))
        elif kind == "word" and raw.lower() in KEYWORDS:
            out.append(("keyword", raw.lower(), start))
        elif kind == "op":
            out.append(("op", {"==": "=", "<>": "!="}.get(raw, raw), start))
        else:
            out.append((kind, raw, start))
        position = match.end()
    return out


class _Parser:
    """Recursive descent: or_expr := and_expr (or and_expr)*; and_expr := not_expr (and not_expr)*;
    not_expr := not not_expr | ( or_expr ) | condition."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokens(text)
        self.at = 0
        self.depth = 0

    def fail(self, what: str) -> FilterError:
        if self.at < len(self.tokens):
            kind, value, start = self.tokens[self.at]
            return FilterError(f"`where`: {what} at character {start + 1} (found {value!r})")
        return FilterError(f"`where`: {what} at the end of the filter")

    def peek(self, kind: str, value: Any = None) -> bool:
        if self.at >= len(self.tokens):
            return False
        got_kind, got_value, _ = self.tokens[self.at]
        return got_kind == kind and (value is None or got_value == value)

    def take(self, kind: str, value: Any = None, what: str = "") -> Any:
        if not self.peek(kind, value):
            raise self.fail(f"expected {what or value or kind}")
        self.at += 1
        return self.tokens[self.at - 1][1]

    def parse(self) -> Filter:
        if not self.tokens:
            raise FilterError("`where` is empty: give a condition such as year >= 2020")
        node = self.or_expr()
        if self.at != len(self.tokens):
            raise self.fail("expected and, or or the end")
        return node

    def or_expr(self) -> Filter:
        items = [self.and_expr()]
        while self.peek("keyword", "or"):
            self.at += 1
            items.append(self.and_expr())
        return items[0] if len(items) == 1 else Or(tuple(items))

    def and_expr(self) -> Filter:
        items = [self.not_expr()]
        while self.peek("keyword", "and"):
            self.at += 1
            items.append(self.not_expr())
        return items[0] if len(items) == 1 else And(tuple(items))

    def not_expr(self) -> Filter:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"nested more than {MAX_DEPTH} deep")
        try:
            return self._not_expr()
        finally:
            self.depth -= 1

    def _not_expr(self) -> Filter:
        if self.peek("keyword", "not"):
            self.at += 1
            return Not(self.not_expr())
        if self.peek("punct", "("):
            self.at += 1
            node = self.or_expr()
            self.take("punct", ")", "')'")
            return node
        return self.condition()

    def condition(self) -> Filter:
        column = self.take("word", what="a column name")
        if self.peek("op"):
            op = self.take("op")
            return Cond(column, op, self.take("literal", what="a value (a number, 'text', true or false)"))
        if self.peek("keyword", "is"):
            self.at += 1
            negated = self.peek("keyword", "not")
            self.at += negated
            self.take("keyword", "null", "null")
            return Cond(column, "is not null" if negated else "is null")
        negated = self.peek("keyword", "not")
        self.at += negated
        if self.peek("keyword", "in"):
            self.at += 1
            self.take("punct", "(", "'('")
            values = [self.take("literal", what="a value")]
            while self.peek("punct", ","):
                self.at += 1
                values.append(self.take("literal", what="a value"))
            self.take("punct", ")", "')'")
            return Cond(column, "not in" if negated else "in", tuple(values))
        raise self.fail("expected a comparison (=, !=, <, <=, >, >=), in, or is null")


def parse(text: str) -> Filter:
    """The filter a ``--where`` text states; ``FilterError`` naming the problem and where it is."""
    if len(text) > MAX_TEXT:
        raise FilterError(f"`where` is {len(text):,} characters long; the limit is {MAX_TEXT:,}")
    node = _Parser(text).parse()
    _check_size(node)
    return node


# ----- the JSON form -------------------------------------------------------------------------------------
def from_json(data: Any) -> Filter:
    """The filter a JSON object states (the service's ``filter`` field)."""
    node = _from_json(data, "filter", 0)
    _check_size(node)
    return node


def _from_json(data: Any, where: str, depth: int) -> Filter:
    if depth > MAX_DEPTH:
        raise FilterError(f"`where`: the filter is nested more than {MAX_DEPTH} deep")
    if not isinstance(data, Mapping):
        raise FilterError(f"`where`: {where} must be an object, not {type(data).__name__}")
    keys = set(data)
    if keys in ({"and"}, {"or"}):
        key = next(iter(keys))
        items = data[key]
        if not isinstance(items, list) or not items:
            raise FilterError(f"`where`: {where}.{key} must be a non-empty list of filters")
        nodes = tuple(_from_json(item, f"{where}.{key}[{i}]", depth + 1) for i, item in enumerate(items))
        return And(nodes) if key == "and" else Or(nodes)
    if keys == {"not"}:
        return Not(_from_json(data["not"], f"{where}.not", depth + 1))
    if "column" in keys and "op" in keys and keys <= {"column", "op", "value"}:
        column, op = data["column"], data["op"]
        if not isinstance(column, str) or not column or not valid_unicode(column):
            raise FilterError(f"`where`: {where}.column must be a column name (valid UTF-8 text)")
        if op not in OPS:
            shown = repr(op) if not isinstance(op, str) or valid_unicode(op) else "(not UTF-8)"  # never echo it
            raise FilterError(f"`where`: {where}.op {shown} is not one of {', '.join(OPS)}")
        value = data.get("value")
        if op in ("is null", "is not null"):
            if value is not None:
                raise FilterError(f"`where`: {where} ({op}) takes no value")
            return Cond(column, op)
        if op in ("in", "not in"):
            if not isinstance(value, list) or not value:
                raise FilterError(f"`where`: {where}.value must be a non-empty list for {op}")
            return Cond(column, op, tuple(_literal(v, f"{where}.value") for v in value))
        return Cond(column, op, _literal(value, f"{where}.value"))
    raise FilterError(
        f"`where`: {where} must be {{'and': [...]}}, {{'or': [...]}}, {{'not': ...}} or "
        "{'column': ..., 'op': ..., 'value': ...}"
    )


def _literal(value: Any, where: str) -> Literal:
    if isinstance(value, str) and not valid_unicode(value):
        raise FilterError(f"`where`: {where} holds a lone surrogate: send valid UTF-8 text")
    if isinstance(value, (str, bool, int, float)):
        return value
    raise FilterError(f"`where`: {where} must be a string, number or boolean, not {type(value).__name__}")


def to_json(node: Filter) -> dict[str, Any]:
    """The JSON form of a filter (``from_json(to_json(f)) == f``)."""
    if isinstance(node, And):
        return {"and": [to_json(item) for item in node.items]}
    if isinstance(node, Or):
        return {"or": [to_json(item) for item in node.items]}
    if isinstance(node, Not):
        return {"not": to_json(node.item)}
    out: dict[str, Any] = {"column": node.column, "op": node.op}
    if node.value is not None:
        out["value"] = list(node.value) if isinstance(node.value, tuple) else node.value
    return out


def json_schema(columns: pa.Schema | None, ref: str = "#/components/schemas/") -> dict[str, dict[str, Any]]:
    """The JSON form as JSON Schema, a set of named definitions (``Filter`` refers to itself through ``ref``): what
    ``from_json`` takes, and, for ``columns`` (the kept columns of an index), what ``evaluate`` takes over them: a
    condition names one of them, with values of a type it compares with (numbers, text, true / false, ISO dates);
    a column of another type (binary, lists) takes only ``is null`` / ``is not null``. ``columns`` None: any column
    name, any value. Not stated: the depth (at most ``MAX_DEPTH``) and size (``MAX_NODES``) limits."""
    conditions = [_conditions({"type": "string", "minLength": 1}, LITERAL_SCHEMA)] if columns is None else []
    for field in columns or []:
        conditions.append(_conditions({"type": "string", "enum": [field.name]}, _value_schema(field.type)))

    def connective(key: str) -> dict[str, Any]:
        items = {"type": "array", "minItems": 1, "items": {"$ref": f"{ref}Filter"}}
        return {"type": "object", "properties": {key: items}, "required": [key], "additionalProperties": False}

    return {
        "Filter": {
            "description": "A metadata filter over the columns the index kept: all of, any of, not, or a condition.",
            "anyOf": [{"$ref": f"{ref}{name}"} for name in ("FilterAll", "FilterAny", "FilterNot", "FilterCondition")],
        },
        "FilterAll": connective("and"),
        "FilterAny": connective("or"),
        "FilterNot": {
            "type": "object",
            "properties": {"not": {"$ref": f"{ref}Filter"}},
            "required": ["not"],
            "additionalProperties": False,
        },
        "FilterCondition": {"anyOf": [branch for group in conditions for branch in group]},
    }


LITERAL_SCHEMA: dict[str, Any] = {"type": ["string", "number", "boolean"]}


def _conditions(column: dict[str, Any], value: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The three shapes of a condition on one column: a comparison, a membership, a null test (``value`` None:
    a column nothing compares with, which takes only the null tests)."""

    def shape(ops: tuple[str, ...], value_schema: dict[str, Any] | None) -> dict[str, Any]:
        properties = {"column": column, "op": {"type": "string", "enum": list(ops)}}
        properties["value"] = value_schema if value_schema is not None else {"type": "null"}
        required = ["column", "op"] + (["value"] if value_schema is not None else [])
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    nulls = shape(("is null", "is not null"), None)
    if value is None:
        return [nulls]
    return [
        shape(tuple(COMPARISONS), value),
        shape(("in", "not in"), {"type": "array", "minItems": 1, "items": value}),
        nulls,
    ]


def _value_schema(kind: pa.DataType) -> dict[str, Any] | None:
    """The JSON values ``_scalar`` compares with a column of type ``kind`` (None: none)."""
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return {"type": "number"}
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return {"type": "string"}
    if pa.types.is_boolean(kind):
        return {"type": "boolean"}
    if pa.types.is_date(kind):
        return {"type": "string", "format": "date"}
    if pa.types.is_temporal(kind):
        return {"type": "string", "description": "An ISO 8601 date, or date and time without a zone."}
    return None


def _check_size(node: Filter) -> None:
    count = 0
    stack = [node]
    while stack:
        count += 1
        if count > MAX_NODES:
            raise FilterError(f"`where` has more than {MAX_NODES:,} conditions; simplify it")
        item = stack.pop()
        if isinstance(item, (And, Or)):
            stack.extend(item.items)
        elif isinstance(item, Not):
            stack.append(item.item)


# ----- evaluation ----------------------------------------------------------------------------------------
def columns_of(node: Filter) -> set[str]:
    if isinstance(node, Cond):
        return {node.column}
    if isinstance(node, Not):
        return columns_of(node.item)
    return set().union(*(columns_of(item) for item in node.items))


def evaluate(node: Filter, table: pa.Table | None) -> np.ndarray:
    """One bool per row of ``table`` (the columns an index kept): True where the filter holds. A null compares as
    SQL's unknown: ``year < 2020`` and ``not (year >= 2020)`` both leave out a row without a year."""
    kept = [] if table is None else table.column_names
    unknown = sorted(columns_of(node) - set(kept))
    if unknown:
        have = f"it keeps {', '.join(kept)}" if kept else "it kept no columns (build it with `columns`)"
        raise FilterError(f"`where`: this index has no column {', '.join(map(repr, unknown))}; {have}")
    assert table is not None
    result = pc.fill_null(_evaluate(node, table), False)
    return np.asarray(result.to_numpy(zero_copy_only=False), dtype=bool)


def _evaluate(node: Filter, table: pa.Table) -> Any:
    if isinstance(node, And):
        out = _evaluate(node.items[0], table)
        for item in node.items[1:]:
            out = pc.and_kleene(out, _evaluate(item, table))
        return out
    if isinstance(node, Or):
        out = _evaluate(node.items[0], table)
        for item in node.items[1:]:
            out = pc.or_kleene(out, _evaluate(item, table))
        return out
    if isinstance(node, Not):
        return pc.invert(_evaluate(node.item, table))  # SQL's three values: not null is null, which keeps nothing
    column = table.column(node.column)
    if node.op == "is null":
        return pc.is_null(column)
    if node.op == "is not null":
        return pc.is_valid(column)
    if node.op in ("in", "not in"):
        assert isinstance(node.value, tuple)
        scalars = [_scalar(v, column.type, node.column) for v in node.value]
        # a value the column's type cannot hold (2.5 or 10**30 for an int16 column) equals no row: left out, where
        # a cast would have truncated 2.5 to 2
        values = pa.array([s.as_py() for s in scalars if _holds(column.type, s)], type=column.type)
        found = pc.is_in(column, value_set=values)
        return pc.and_kleene(pc.invert(found), pc.is_valid(column)) if node.op == "not in" else found
    return getattr(pc, COMPARISONS[node.op])(column, _scalar(node.value, column.type, node.column))


def _scalar(value: Any, kind: pa.DataType, column: str) -> pa.Scalar:
    """``value`` as a scalar of the column's type: numbers for numeric columns, text for text, true/false for
    booleans, ISO text for dates and times; anything else is the user's type error, named."""
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
    text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    temporal = pa.types.is_temporal(kind)
    ok = (
        (numeric and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (text and isinstance(value, str))
        or (pa.types.is_boolean(kind) and isinstance(value, bool))
        or (temporal and isinstance(value, str))
    )
    if ok:
        try:
            if temporal:
                return pa.scalar(value).cast(pa.timestamp("us")).cast(kind, safe=False)
            if numeric and not pa.types.is_decimal(kind):
                return _number(value, kind)
            return pa.scalar(value).cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError) as err:
            raise FilterError(f"`where`: {value!r} cannot be compared with column {column!r} ({kind}): {err}") from err
    raise FilterError(f"`where`: column {column!r} holds {kind}; {value!r} ({type(value).__name__}) cannot match it")


def _number(value: int | float, kind: pa.DataType) -> pa.Scalar:
    """A JSON number against a numeric column: of the column's type where it holds the value exactly, else as a
    double, the value compared as it is (2.5 or 1e300 with an int16 column), a whole number beyond even a double's
    range as an infinity: ``year < 10**30`` holds for every year, ``year = 10**30`` for none."""
    if isinstance(value, int) and pa.types.is_integer(kind):
        info = np.iinfo(f"{'u' if pa.types.is_unsigned_integer(kind) else ''}int{kind.bit_width}")  # no pandas
        if info.min <= value <= info.max:
            return pa.scalar(value, kind)
    try:
        return pa.scalar(float(value), pa.float64())
    except OverflowError:
        return pa.scalar(math.inf if value > 0 else -math.inf, pa.float64())


def _holds(kind: pa.DataType, scalar: pa.Scalar) -> bool:
    """Whether a column of type ``kind`` can hold ``scalar``'s value exactly (2020.0 in an int16 column: yes)."""
    if scalar.type == kind:
        return True
    try:
        return bool(scalar.cast(kind).cast(scalar.type).equals(scalar))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        return False
