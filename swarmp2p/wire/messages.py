"""Control messages: one msgpack map per message, typed by a registry of frozen dataclasses.

A message on the wire is ``{"v": protocol version, "t": type name, "id": request id, **fields}``.
:func:`decode` is strict: it caps the size before unpacking, refuses ext types, non-string map
keys, unknown types, newer versions, unknown fields, missing fields and values of the wrong
type, and names the field in the :class:`WireError` it raises. A field annotated ``dict``,
``list`` or ``Any`` takes nested plain data (None, bool, int, float, str, bytes, lists and
string-keyed maps), at most :data:`MAX_PLAIN_DEPTH` levels deep.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack

from swarmp2p import PROTOCOL_VERSION

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest encoded control message; larger ones are refused before unpacking."""

MAX_PLAIN_DEPTH = 16
"""Deepest nesting of lists/maps a plain-data field (``dict``, ``list``, ``Any``) may hold."""

MAX_ID = 2**63 - 1
"""Request ids are non-negative and fit a signed 64-bit integer."""

_RESERVED = frozenset({"v", "t", "id"})

WIRE_ERROR_CODES = ("too_large", "malformed", "unknown_type", "version", "bad_field")
"""The codes a :class:`WireError` carries."""


class WireError(ValueError):
    """Bytes that are not a valid message; ``code`` is one of :data:`WIRE_ERROR_CODES`.

    ``msg_id`` is the request id when the envelope was readable, so a server can address its
    error reply to the request that caused it.
    """

    def __init__(self, code: str, detail: str, *, msg_id: int | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.msg_id = msg_id


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """Base of every control message; ``id`` pairs a reply with its request (0: none)."""

    TYPE: ClassVar[str] = ""

    id: int = 0


_M = TypeVar("_M", bound=Message)

_REGISTRY: dict[str, type[Message]] = {}
_CHECKERS: dict[type[Message], dict[str, tuple[Callable[[Any, str], Any], bool]]] = {}


def message(type_name: str) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: make ``cls`` a frozen kw_only slots dataclass and register it as ``type_name``."""

    def register(cls: type[_M]) -> type[_M]:
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise TypeError(f"@message({type_name!r}) needs a subclass of Message, got {cls!r}")
        if not type_name or not isinstance(type_name, str):
            raise ValueError(f"message type name must be a non-empty string, got {type_name!r}")
        if type_name in _REGISTRY:
            raise ValueError(
                f"message type {type_name!r} is already registered by "
                f"{_REGISTRY[type_name].__qualname__}; pick another name"
            )
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        if not params.frozen:
            raise TypeError(f"message {cls.__qualname__} must be a frozen dataclass")
        hints = typing.get_type_hints(cls)
        checkers: dict[str, tuple[Callable[[Any, str], Any], bool]] = {}
        for f in dataclasses.fields(cls):
            if f.name in _RESERVED and f.name != "id":
                raise ValueError(f"message {cls.__qualname__}: field name {f.name!r} is reserved")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            check = _checker(hints[f.name], f"{cls.__qualname__}.{f.name}")
            meta = f.metadata
            check = _bounded(check, meta.get("min"), meta.get("max"), meta.get("max_len"))
            checkers[f.name] = (check, required)
        cls.TYPE = type_name
        _REGISTRY[type_name] = cls
        _CHECKERS[cls] = checkers
        return cls

    return register


def wire_field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    min: float | None = None,
    max: float | None = None,
    max_len: int | None = None,
) -> Any:
    """A message field with a range (``min``/``max``, numbers) or ``max_len`` (str, bytes,
    list, dict) that :func:`encode` and :func:`decode` enforce, naming the field."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={"min": min, "max": max, "max_len": max_len},
    )


def _bounded(
    check: Callable[[Any, str], Any], lo: Any, hi: Any, max_len: Any
) -> Callable[[Any, str], Any]:
    if lo is None and hi is None and max_len is None:
        return check

    def bounded(value: Any, path: str) -> Any:
        value = check(value, path)
        if value is None:
            return value
        if lo is not None and value < lo:
            raise _Bad(f"{path} must be >= {lo}, got {_describe(value)}")
        if hi is not None and value > hi:
            raise _Bad(f"{path} must be <= {hi}, got {_describe(value)}")
        if max_len is not None and len(value) > max_len:
            raise _Bad(f"{path} has length {len(value)}, at most {max_len} allowed")
        return value

    return bounded


def message_types() -> dict[str, type[Message]]:
    """A copy of the registry: type name -> message class."""
    return dict(_REGISTRY)


# --- field checkers -------------------------------------------------------------------------
# A checker takes a decoded value and the field path and returns the value to store (lists may
# become tuples), or raises _Bad naming the path.


class _Bad(Exception):
    pass


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _scalar(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, path: str) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not kind:
            raise _Bad(
                f"{path} must be {kind.__name__}, got {type(value).__name__} {_describe(value)}"
            )
        return value

    return check


def _plain(value: Any, path: str, depth: int = 0) -> Any:
    if depth > MAX_PLAIN_DEPTH:
        raise _Bad(f"{path} nests deeper than {MAX_PLAIN_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if type(value) is list:
        return [_plain(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is dict:
        for k in value:
            if type(k) is not str:
                raise _Bad(f"{path} has a non-string key {_describe(k)}")
        return {k: _plain(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    raise _Bad(f"{path} holds {type(value).__name__}, which is not plain data")


def _plain_of(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, path: str) -> Any:
        if kind is not object and type(value) is not kind:
            raise _Bad(f"{path} must be {kind.__name__}, got {type(value).__name__}")
        return _plain(value, path)

    return check


def _checker(hint: Any, where: str) -> Callable[[Any, str], Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint in (str, int, float, bool, bytes):
        return _scalar(hint)
    if hint is Any:
        return _plain_of(object)
    if hint in (dict, list):
        return _plain_of(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"{where}: only `X | None` unions are supported, got {hint!r}")
        check_inner = _checker(inner[0], where)
        return lambda value, path: None if value is None else check_inner(value, path)
    if origin is typing.Literal:
        allowed = args

        def check_literal(value: Any, path: str) -> Any:
            if not any(type(value) is type(a) and value == a for a in allowed):
                raise _Bad(f"{path} must be one of {list(allowed)}, got {_describe(value)}")
            return value

        return check_literal
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = _checker(args[0], where) if args else _plain
        as_tuple = origin is tuple

        def check_seq(value: Any, path: str) -> Any:
            if type(value) not in (list, tuple):
                raise _Bad(f"{path} must be a list, got {type(value).__name__}")
            out = [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(out) if as_tuple else out

        return check_seq
    if origin is dict:
        if not args or args[0] is not str:
            raise TypeError(f"{where}: dict fields need str keys, got {hint!r}")
        val = _checker(args[1], where)

        def check_map(value: Any, path: str) -> Any:
            if type(value) is not dict:
                raise _Bad(f"{path} must be a map, got {type(value).__name__}")
            out = {}
            for k, v in value.items():
                if type(k) is not str:
                    raise _Bad(f"{path} has a non-string key {_describe(k)}")
                out[k] = val(v, f"{path}.{k}")
            return out

        return check_map
    raise TypeError(f"{where}: unsupported field type {hint!r} for a wire message")


# --- encode / decode ------------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> bytes:
    """One msgpack map; raises WireError("too_large") past MAX_MESSAGE_BYTES, "bad_field" on bad values."""
    cls = type(msg)
    if cls not in _CHECKERS:
        raise WireError("unknown_type", f"{cls.__qualname__} is not registered with @message")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": cls.TYPE, "id": msg.id}
    for name, (check, _required) in _CHECKERS[cls].items():
        value = getattr(msg, name)
        try:
            check(value, f"{cls.TYPE}.{name}")
        except _Bad as e:
            raise WireError("bad_field", str(e), msg_id=msg.id) from None
        if name != "id":
            body[name] = _to_wire(value)
    if not 0 <= msg.id <= MAX_ID:
        raise WireError("bad_field", f"{cls.TYPE}.id must be in 0..2**63-1, got {msg.id}")
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(
            "too_large",
            f"{cls.TYPE} message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte cap; "
            "send bulk data over a data link instead",
            msg_id=msg.id,
        )
    return data


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def unpack_plain(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Strictly unpack one msgpack object: size-capped, no ext types, str/bytes keys only."""
    if len(data) > max_bytes:
        raise WireError("too_large", f"{len(data)} bytes is over the {max_bytes}-byte cap")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
            max_ext_len=0,
            ext_hook=_no_ext,
        )
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise WireError("malformed", f"not a msgpack object: {type(e).__name__}: {e}") from None


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message; raises WireError naming what is wrong."""
    data = bytes(data)
    obj = unpack_plain(data)
    if type(obj) is not dict:
        raise WireError("malformed", f"a message is a msgpack map, got {type(obj).__name__}")
    msg_id = obj.get("id")
    if type(msg_id) is not int or not 0 <= msg_id <= MAX_ID:
        raise WireError(
            "malformed", f"field 'id' must be an integer in 0..2**63-1, got {_describe(msg_id)}"
        )
    version = obj.get("v")
    if type(version) is not int:
        raise WireError(
            "malformed", f"field 'v' must be an integer, got {_describe(version)}", msg_id=msg_id
        )
    if version > PROTOCOL_VERSION or version < 1:
        raise WireError(
            "version",
            f"message is protocol version {version}, this node speaks 1..{PROTOCOL_VERSION}; "
            "run the same swarmp2p version on every node",
            msg_id=msg_id,
        )
    type_name = obj.get("t")
    if type(type_name) is not str:
        raise WireError(
            "malformed", f"field 't' must be a string, got {_describe(type_name)}", msg_id=msg_id
        )
    cls = _REGISTRY.get(type_name)
    if cls is None:
        raise WireError(
            "unknown_type", f"unknown message type {_describe(type_name)}", msg_id=msg_id
        )
    checkers = _CHECKERS[cls]
    values: dict[str, Any] = {}
    for key, value in obj.items():
        if key in ("v", "t"):
            continue
        if key not in checkers:
            raise WireError(
                "bad_field", f"{type_name} has no field {_describe(key)}", msg_id=msg_id
            )
        try:
            values[key] = checkers[key][0](value, f"{type_name}.{key}")
        except _Bad as e:
            raise WireError("bad_field", str(e), msg_id=msg_id) from None
    for name, (_check, required) in checkers.items():
        if required and name not in values:
            raise WireError("bad_field", f"{type_name} is missing field {name!r}", msg_id=msg_id)
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise WireError("bad_field", f"{type_name}: {e}", msg_id=msg_id) from None


# --- the messages every peer speaks ---------------------------------------------------------


@message("error")
class ErrorReply(Message):
    """A request failed; ``code`` is a WireError code or one a handler chose (e.g. "internal")."""

    code: str
    detail: str


@message("hello")
class Hello(Message):
    """What a peer says first: who it is, which protocol versions and features it speaks."""

    node_id: str = wire_field(max_len=128)
    name: str = wire_field(max_len=128)
    versions: list[int] = wire_field(max_len=32)
    capabilities: list[str] = wire_field(max_len=128)
    software: str = wire_field(default="", max_len=64)
    """The swarmp2p release the peer runs, for error messages."""
    swarm_id: str = wire_field(default="", max_len=64)
    """The public swarm id the peer belongs to (``SwarmSecret.swarm_id``)."""
    control_port: int = wire_field(default=0, min=0, max=65535)
    """The peer's RPC port (0: not listening)."""

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        if not self.versions or any(v < 1 for v in self.versions):
            raise ValueError(
                f"versions must be a non-empty list of versions >= 1, got {self.versions}"
            )


def common_version(ours: list[int] | tuple[int, ...], theirs: list[int] | tuple[int, ...]) -> int:
    """The highest protocol version both sides speak; ValueError naming both lists if none."""
    shared = set(ours) & set(theirs)
    if not shared:
        raise ValueError(
            f"no common protocol version: this node speaks {sorted(ours)}, the peer {sorted(theirs)}; "
            "upgrade the older node"
        )
    return max(shared)


def shared_capabilities(ours: Hello, theirs: Hello) -> frozenset[str]:
    """Features both peers declared; a feature is used only when it is in this set."""
    return frozenset(ours.capabilities) & frozenset(theirs.capabilities)
