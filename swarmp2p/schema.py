"""One validator for every record that crosses a boundary. Standard library only.

A record is a frozen dataclass; its type hints are its schema. :func:`parse` turns plain data
(decoded JSON or msgpack) into a record and raises one :class:`SchemaError` listing EVERY
problem, each with its field path (``train.steps: must be an integer >= 1, got -3``);
:func:`to_data` turns a record back into plain data, so ``parse(cls, to_data(r)) == r``.
job.json, worker and serve specs, wire messages and HTTP bodies all go through here.

What a hint may be: ``str``, ``int``, ``float``, ``bool``, ``bytes``; ``X | None`` and other
unions (tried in order); ``Literal[...]``; ``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]``;
``dict[str, X]`` (or a ``str`` with bounds as the key: ``dict[DeviceKey, X]``); another record (nested, with its own path); ``dict``, ``list`` or ``Any`` for
plain nested data (bounded depth); or a class with ``from_data(value, path)`` and ``to_data()``
for values with their own syntax (a compression spec that may be a string or a map).

Bounds come from :func:`field` metadata (``ge``, ``gt``, ``le``, ``lt``, ``min_len``,
``max_len``, ``pattern``). Every integer is bounded to a signed 64-bit value even without
them: a peer's msgpack, a numpy array or an SQLite column cannot hold more, and a value past
it must be refused where it enters, not fail later with OverflowError (issue 15).

A field with ``init=False`` is derived: :func:`to_data` writes it for readers, :func:`parse`
accepts and ignores it (the record recomputes it). A record may define
``__schema_prepare__(data) -> data`` (defaults that depend on other
fields, before the fields are checked) and ``__post_init__`` raising ValueError (cross-field
rules, reported at the record's path) or SchemaError (with paths relative to the record).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Data = None | bool | int | float | str | bytes | list["Data"] | dict[str, "Data"]
"""Plain data as JSON and msgpack hold it: what :func:`to_data` makes of a record."""

INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
"""Every integer field fits a signed 64-bit value."""
MAX_PLAIN_DEPTH = 16
"""Deepest nesting of lists/maps a plain-data field (``dict``, ``list``, ``Any``) may hold."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FieldError:
    """One problem in a record: where (``model.lora.r``) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SchemaError(ValueError):
    """Data that is not a valid record; ``errors`` holds every problem with its path."""

    def __init__(self, errors: list[FieldError] | str, *, title: str = "invalid record") -> None:
        if isinstance(errors, str):
            errors = [FieldError(path="", message=errors)]
        self.errors = list(errors)
        self.title = title
        super().__init__(f"{title}:\n" + "\n".join(str(e) for e in self.errors))


def read_json(path: str | os.PathLike[str], error: Callable[[list[FieldError]], Exception]) -> Any:
    """The JSON document in the file at ``path``; ``error`` (e.g. ``JobError``), with one error
    naming the file, when it cannot be read, is not JSON, or nests too deeply to parse."""

    def fail(message: str) -> Exception:
        return error([FieldError(path=str(path), message=message)])

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise fail(f"not valid JSON: {exc}") from None
    except RecursionError:  # e.g. 200,000 nested brackets
        raise fail("not readable JSON: nested too deeply") from None


def field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    min_len: int | None = None,
    max_len: int | None = None,
    pattern: str | None = None,
) -> Any:
    """A record field with bounds that :func:`parse` enforces, naming the field."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "min_len": min_len, "max_len": max_len}
    meta["pattern"] = re.compile(pattern) if pattern is not None else None
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


# --- describing values in messages ------------------------------------------------------------


def show(value: Any) -> str:
    """A value as an error message prints it: JSON-like, cut at 60 characters."""
    if value is None:
        text = "null"
    elif value is True or value is False:
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    elif isinstance(value, (int, float)):
        text = repr(value)
    elif isinstance(value, (bytes, bytearray)):
        text = f"{len(value)} bytes"
    elif isinstance(value, Mapping):
        text = "an object"
    elif isinstance(value, (list, tuple)):
        text = f"a list of {len(value)}"
    else:
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def join(path: str, key: str | int) -> str:
    """``path`` extended by a key (``a.b``) or an index (``a[0]``)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


# --- checkers ---------------------------------------------------------------------------------
# A checker takes (value, path, errors) and returns the value to store, or _BAD after
# appending to errors. Checkers are built once per record class and cached.

_BAD: Any = object()
Checker = Callable[[Any, str, list[FieldError]], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bound_text(meta: Mapping[str, Any], noun: str) -> str:
    parts = []
    for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        bound = meta.get(key)
        if bound is not None:
            parts.append(f"{sign} {bound:g}" if isinstance(bound, float) else f"{sign} {bound}")
    return f"{noun} " + " and ".join(parts) if parts else noun


def _bounds(meta: Mapping[str, Any]) -> Callable[[float], bool]:
    """Whether a number lies within ``meta``'s bounds (built once per field: it runs for
    every number of every message)."""
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    if ge is None and gt is None and le is None and lt is None:
        return lambda value: True
    return lambda value: (
        not (
            (ge is not None and value < ge)
            or (gt is not None and value <= gt)
            or (le is not None and value > le)
            or (lt is not None and value >= lt)
        )
    )


def _int_checker(meta: Mapping[str, Any]) -> Checker:
    want = _bound_text(meta, "an integer")
    in_bounds = _bounds(meta)

    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if not _is_int(value) or not in_bounds(value):
            errors.append(FieldError(path=path, message=f"must be {want}, got {show(value)}"))
            return _BAD
        if not INT_MIN <= value <= INT_MAX:
            errors.append(
                FieldError(
                    path=path, message=f"must be {want} that fits 64 bits, got {show(value)}"
                )
            )
            return _BAD
        return value

    return check


def _float_checker(meta: Mapping[str, Any]) -> Checker:
    want = _bound_text(meta, "a number")
    in_bounds = _bounds(meta)

    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and _is_int(value) and not INT_MIN <= value <= INT_MAX:
            ok = False
        if not ok or not math.isfinite(value) or not in_bounds(value):
            errors.append(FieldError(path=path, message=f"must be {want}, got {show(value)}"))
            return _BAD
        return float(value)

    return check


def _sized(check: Checker, meta: Mapping[str, Any]) -> Checker:
    min_len, max_len, pattern = meta.get("min_len"), meta.get("max_len"), meta.get("pattern")
    if min_len is None and max_len is None and pattern is None:
        return check

    def sized(value: Any, path: str, errors: list[FieldError]) -> Any:
        out = check(value, path, errors)
        if out is _BAD or out is None:
            return out
        short = min_len is not None and len(out) < min_len
        if min_len == 1 and isinstance(out, str) and not out.strip():
            short = True  # a name of spaces is no name
        if short:
            what = "a non-empty" if min_len == 1 else f"at least {min_len} long:"
            noun = "string" if isinstance(out, str) else "list"
            errors.append(
                FieldError(path=path, message=f"must be {what} {noun}, got {show(value)}")
            )
            return _BAD
        if max_len is not None and len(out) > max_len:
            errors.append(
                FieldError(path=path, message=f"has length {len(out)}, at most {max_len} allowed")
            )
            return _BAD
        if pattern is not None and isinstance(out, str) and not pattern.fullmatch(out):
            errors.append(
                FieldError(path=path, message=f"{show(value)} does not match {pattern.pattern}")
            )
            return _BAD
        return out

    return sized


def _scalar(kind: type, meta: Mapping[str, Any]) -> Checker:
    if kind is int:
        return _int_checker(meta)
    if kind is float:
        return _float_checker(meta)
    noun = {str: "a string", bool: "true or false", bytes: "bytes"}[kind]

    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if type(value) is not kind:
            errors.append(FieldError(path=path, message=f"must be {noun}, got {show(value)}"))
            return _BAD
        return value

    return _sized(check, meta)


def plain(value: Any, path: str, errors: list[FieldError], depth: int = 0) -> Any:
    """Check nested plain data: None, bool, int (64-bit), finite-or-not float, str, bytes,
    lists and string-keyed maps, at most MAX_PLAIN_DEPTH levels deep."""
    if depth > MAX_PLAIN_DEPTH:
        errors.append(FieldError(path=path, message=f"nests deeper than {MAX_PLAIN_DEPTH} levels"))
        return _BAD
    if value is None or type(value) in (bool, float, str, bytes):
        return value
    if type(value) is int:
        if not INT_MIN <= value <= INT_MAX:
            errors.append(
                FieldError(path=path, message=f"integer {show(value)} does not fit 64 bits")
            )
            return _BAD
        return value
    if type(value) in (list, tuple):
        out = [plain(v, join(path, i), errors, depth + 1) for i, v in enumerate(value)]
        return _BAD if any(v is _BAD for v in out) else out
    if type(value) is dict:
        result = {}
        for k, v in value.items():
            if type(k) is not str:
                errors.append(FieldError(path=path, message=f"has a non-string key {show(k)}"))
                return _BAD
            result[k] = plain(v, join(path, k), errors, depth + 1)
        return _BAD if any(v is _BAD for v in result.values()) else result
    errors.append(
        FieldError(path=path, message=f"holds {type(value).__name__}, which is not plain data")
    )
    return _BAD


def _plain_of(kind: type | None) -> Checker:
    noun = {dict: "an object", list: "a list"}.get(kind)  # type: ignore[arg-type]

    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if kind is not None and not (
            type(value) is kind or (kind is list and type(value) is tuple)
        ):
            errors.append(FieldError(path=path, message=f"must be {noun}, got {show(value)}"))
            return _BAD
        return plain(value, path, errors)

    return check


def _literal(allowed: tuple) -> Checker:
    shown = ", ".join(show(a) for a in allowed)

    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if not any(type(value) is type(a) and value == a for a in allowed):
            errors.append(
                FieldError(path=path, message=f"must be one of {shown}, got {show(value)}")
            )
            return _BAD
        return value

    return check


def _optional(inner: Checker) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        return None if value is None else inner(value, path, errors)

    return check


def _union(options: list[tuple[Any, Checker]]) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        tried: list[FieldError] = []
        for _hint, opt in options:
            attempt: list[FieldError] = []
            out = opt(value, path, attempt)
            if out is not _BAD:
                return out
            tried.extend(attempt)
        # one message per alternative, joined: "must be "auto" or an integer >= 1"
        wants = [e.message.split(", got ")[0].removeprefix("must be ") for e in tried]
        errors.append(
            FieldError(path=path, message=f"must be {' or '.join(wants)}, got {show(value)}")
        )
        return _BAD

    return check


def _sequence(item: Checker, as_tuple: bool, meta: Mapping[str, Any]) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if type(value) not in (list, tuple):
            errors.append(FieldError(path=path, message=f"must be a list, got {show(value)}"))
            return _BAD
        # each item's path is written out only when one is wrong: a model's shape holds
        # lists of hundreds of numbers, checked in every message that carries it
        scratch: list[FieldError] = []
        out = [item(v, path, scratch) for v in value]
        if scratch or any(v is _BAD for v in out):
            for i, v in enumerate(value):
                item(v, join(path, i), errors)
            return _BAD
        return tuple(out) if as_tuple else out

    return _sized(check, meta)


def _as_set(value: Any) -> Any:
    return value if value is _BAD else frozenset(value)


def _fixed_tuple(items: list[Checker]) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if type(value) not in (list, tuple) or len(value) != len(items):
            errors.append(
                FieldError(path=path, message=f"must be a list of {len(items)}, got {show(value)}")
            )
            return _BAD
        out = tuple(c(v, join(path, i), errors) for i, (c, v) in enumerate(zip(items, value)))
        return _BAD if any(v is _BAD for v in out) else out

    return check


def _mapping(val: Checker, meta: Mapping[str, Any], key: Checker | None = None) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        if type(value) is not dict:
            errors.append(FieldError(path=path, message=f"must be an object, got {show(value)}"))
            return _BAD
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                errors.append(FieldError(path=path, message=f"has a non-string key {show(k)}"))
                return _BAD
            if key is not None and key(k, path, errors) is _BAD:
                return _BAD  # the key's own rule (``dict[DeviceKey, int]``), at the map's path
            out[k] = val(v, join(path, k), errors)
        return _BAD if any(v is _BAD for v in out.values()) else out

    return _sized(check, meta)


def _custom(cls: type) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        try:
            return cls.from_data(value, path)
        except SchemaError as exc:
            errors.extend(exc.errors)
        except ValueError as exc:
            errors.append(FieldError(path=path, message=str(exc)))
        return _BAD

    return check


def _record(cls: type) -> Checker:
    def check(value: Any, path: str, errors: list[FieldError]) -> Any:
        return _parse_record(cls, value, path, errors)

    return check


_NONE = type(None)


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """Bounds carried by a type: ``JobId = Annotated[str, Bounds(pattern=...)]`` names a kind
    of value once, and every field of that type is checked the same way."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_len: int | None = None
    max_len: int | None = None
    pattern: str | None = None

    def meta(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("ge", "gt", "le", "lt", "min_len", "max_len")}
        out["pattern"] = re.compile(self.pattern) if self.pattern is not None else None
        return out


def checker(hint: Any, meta: Mapping[str, Any] | None = None, where: str = "") -> Checker:
    """The checker of one type hint (with field bounds ``meta``); TypeError if unsupported."""
    meta = meta or {}
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        merged = dict(meta)
        for extra in extras:
            if isinstance(extra, Bounds):
                merged.update({k: v for k, v in extra.meta().items() if v is not None})
        return checker(base, merged, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (str, int, float, bool, bytes):
        return _scalar(hint, meta)
    if hint is Any or hint is object:
        return _plain_of(None)
    if hint in (dict, list):
        return _sized(_plain_of(hint), meta)
    if isinstance(hint, type) and hasattr(hint, "from_data"):
        return _custom(hint)
    if dataclasses.is_dataclass(hint):
        return _record(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not _NONE]
        if len(inner) == 1:
            check = checker(inner[0], meta, where)
        else:
            check = _union([(a, checker(a, meta, where)) for a in inner])
        return _optional(check) if len(inner) < len(args) else check
    if origin is typing.Literal:
        return _literal(args)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = checker(args[0], None, where) if args else _plain_of(None)
        return _sequence(item, origin is tuple, meta)
    if origin in (set, frozenset):  # written as a list; order is not meaning
        seq = _sequence(checker(args[0], None, where), True, meta)
        return lambda value, path, errors: _as_set(seq(value, path, errors))
    if origin is tuple:
        return _fixed_tuple([checker(a, None, where) for a in args])
    if origin is dict or origin is Mapping:
        keyed = args and typing.get_origin(args[0]) is typing.Annotated
        if not args or (args[0] is not str and not (keyed and typing.get_args(args[0])[0] is str)):
            raise TypeError(f"{where}: map fields need str keys, got {hint!r}")
        key = checker(args[0], None, where) if keyed else None
        return _mapping(checker(args[1], None, where), meta, key)
    raise TypeError(f"{where}: unsupported field type {hint!r} for a record")


# --- records ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    check: Checker
    required: bool


_PLANS: dict[type, tuple[_Field, ...]] = {}


def fields_of(cls: type) -> tuple[_Field, ...]:
    """The checked fields of a record class (built once)."""
    plan = _PLANS.get(cls)
    if plan is None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass record")
        hints = typing.get_type_hints(cls, include_extras=True)
        plan = tuple(
            _Field(
                name=f.name,
                check=checker(hints[f.name], f.metadata, f"{cls.__qualname__}.{f.name}"),
                required=f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        )
        _PLANS[cls] = plan
    return plan


def _parse_record(cls: type, data: Any, path: str, errors: list[FieldError]) -> Any:
    if not isinstance(data, Mapping):
        errors.append(FieldError(path=path, message=f"must be an object, got {show(data)}"))
        return _BAD
    prepare = getattr(cls, "__schema_prepare__", None)
    if prepare is not None:
        data = prepare(dict(data))
    plan = fields_of(cls)
    known = {f.name for f in plan}
    derived = {f.name for f in dataclasses.fields(cls) if not f.init}
    before = len(errors)
    for key in data:
        if key not in known and key not in derived:  # derived values are recomputed
            errors.append(
                FieldError(
                    path=join(path, str(key)) if path else str(key),
                    message=f"unknown key; known: {', '.join(f.name for f in plan)}",
                )
            )
    values = {}
    for f in plan:
        if f.name not in data:
            if f.required:
                errors.append(FieldError(path=join(path, f.name), message="required"))
            continue
        out = f.check(data[f.name], join(path, f.name), errors)
        if out is not _BAD:
            values[f.name] = out
    if len(errors) > before:
        return _BAD
    try:
        return cls(**values)
    except SchemaError as exc:
        errors.extend(
            FieldError(path=join(path, e.path) if e.path else path, message=e.message)
            for e in exc.errors
        )
    except (ValueError, TypeError) as exc:
        errors.append(FieldError(path=path, message=str(exc)))
    return _BAD


_R = typing.TypeVar("_R")
_C = typing.TypeVar("_C", bound=type)


def registered(registry: dict[str, type], name: str, *, attr: str, what: str) -> Callable[[_C], _C]:
    """Class decorator: ``cls`` made a frozen kw_only slots record, its ``attr`` set to
    ``name`` and registered in ``registry`` (table events by name, API requests by op)."""

    def register(cls: _C) -> _C:
        cls = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
        if name in registry:
            raise ValueError(f"{what} {name!r} is registered twice")
        setattr(cls, attr, name)
        registry[name] = cls
        return cls

    return register


def parse(cls: type[_R], data: Any, *, title: str | None = None) -> _R:
    """A ``cls`` record from plain data; SchemaError listing every problem with its path."""
    errors: list[FieldError] = []
    out = _parse_record(cls, data, "", errors)
    if out is _BAD:
        raise SchemaError(errors, title=title or f"invalid {cls.__name__}")
    return out


def check_value(hint: Any, value: Any, path: str, **meta: Any) -> Any:
    """Check one value against a type hint (and bounds); SchemaError naming ``path``."""
    errors: list[FieldError] = []
    if "pattern" in meta and isinstance(meta["pattern"], str):
        meta["pattern"] = re.compile(meta["pattern"])
    out = checker(hint, meta, path)(value, path, errors)
    if out is _BAD:
        raise SchemaError(errors, title=f"invalid {path}")
    return out


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})
_KINDS: dict[type, tuple[str, tuple[str, ...]]] = {}
"""How ``to_data`` takes each class it has met (a class's answer never changes)."""


def _kind(cls: type) -> tuple[str, tuple[str, ...]]:
    if hasattr(cls, "to_data"):  # a value with its own syntax (``from_data``)
        kind = ("own", ())
    elif dataclasses.is_dataclass(cls):  # derived (init=False) fields travel too, for readers
        kind = ("record", tuple(f.name for f in dataclasses.fields(cls)))
    elif issubclass(cls, (list, tuple)):
        kind = ("list", ())
    elif issubclass(cls, (set, frozenset)):
        kind = ("set", ())
    elif issubclass(cls, Mapping):
        kind = ("map", ())
    else:
        kind = ("plain", ())
    _KINDS[cls] = kind
    return kind


def to_data(value: Any) -> Any:
    """A record (or any value holding records) as plain data: maps, lists and scalars. It runs
    for every table write and status answer, so each class is looked at once (``_KINDS``)."""
    cls = type(value)
    if cls in _PLAIN or isinstance(value, type):
        return value
    kind, names = _KINDS.get(cls) or _kind(cls)
    if kind == "record":
        return {name: to_data(getattr(value, name)) for name in names}
    if kind == "list":
        return [to_data(v) for v in value]
    if kind == "map":
        return {k: to_data(v) for k, v in value.items()}
    if kind == "own":
        return value.to_data()
    if kind == "set":
        return sorted(to_data(v) for v in value)
    return value


def replace_errors(exc: SchemaError, prefix: str) -> list[FieldError]:
    """``exc``'s errors with ``prefix`` joined in front of each path."""
    return [
        FieldError(path=join(prefix, e.path) if e.path else prefix, message=e.message)
        for e in exc.errors
    ]


__all__ = [
    "INT_MAX",
    "INT_MIN",
    "Bounds",
    "Data",
    "FieldError",
    "SchemaError",
    "check_value",
    "checker",
    "field",
    "fields_of",
    "join",
    "parse",
    "plain",
    "registered",
    "show",
    "to_data",
]
