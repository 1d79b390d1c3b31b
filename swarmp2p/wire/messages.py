"""Control messages: one msgpack map per message, typed by a registry of frozen dataclasses.

A message on the wire is ``{"v": protocol version, "t": type name, "id": request id, **fields}``.
:func:`decode` is strict: it caps the size before unpacking, refuses ext types, non-string map
keys, unknown types, newer versions, unknown fields, missing fields and values of the wrong
type, and names the field in the :class:`WireError` it raises. Fields are checked by
``swarmp2p.schema`` (the one validator of every record): a field may be another record, and a
field annotated ``dict``, ``list`` or ``Any`` takes nested plain data (None, bool, 64-bit int,
float, str, bytes, lists and string-keyed maps), at most :data:`MAX_PLAIN_DEPTH` levels deep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack

from swarmp2p import PROTOCOL_VERSION, schema

MAX_PLAIN_DEPTH = schema.MAX_PLAIN_DEPTH
"""Deepest nesting of lists/maps a plain-data field (``dict``, ``list``, ``Any``) may hold."""

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest encoded control message; larger ones are refused before unpacking."""

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
    OMIT_DEFAULTS: ClassVar[frozenset[str]] = frozenset()
    """Fields left off the wire while they hold their default (:func:`decode` fills it in):
    a field added later keeps the older messages' bytes where it is not used."""

    id: int = 0


_M = TypeVar("_M", bound=Message)

_REGISTRY: dict[str, type[Message]] = {}


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
        for f in dataclasses.fields(cls):
            if f.name in _RESERVED and f.name != "id":
                raise ValueError(f"message {cls.__qualname__}: field name {f.name!r} is reserved")
        schema.fields_of(cls)  # an unsupported field type fails here, at import
        cls.TYPE = type_name
        _REGISTRY[type_name] = cls
        return cls

    return register


def message_types() -> dict[str, type[Message]]:
    """A copy of the registry: type name -> message class."""
    return dict(_REGISTRY)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_error(errors: list[schema.FieldError]) -> str:
    e = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{e.path} {e.message}{more}"


# --- encode / decode ------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """One msgpack map; raises WireError("too_large") past MAX_MESSAGE_BYTES, "bad_field" on bad values."""
    cls = type(msg)
    if cls.TYPE not in _REGISTRY or _REGISTRY[cls.TYPE] is not cls:
        raise WireError("unknown_type", f"{cls.__qualname__} is not registered with @message")
    if not 0 <= msg.id <= MAX_ID:
        raise WireError("bad_field", f"{cls.TYPE}.id must be in 0..2**63-1, got {msg.id}")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": cls.TYPE, "id": msg.id}
    errors: list[schema.FieldError] = []
    omit = _omitted(msg) if cls.OMIT_DEFAULTS else frozenset()
    for f in schema.fields_of(cls):
        if f.name in omit:
            continue
        value = schema.to_data(getattr(msg, f.name))
        f.check(value, f"{cls.TYPE}.{f.name}", errors)
        if f.name != "id":
            body[f.name] = value
    if errors:
        raise WireError("bad_field", _first_error(errors), msg_id=msg.id)
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(
            "too_large",
            f"{cls.TYPE} message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte cap; "
            "send bulk data over a data link instead",
            msg_id=msg.id,
        )
    return data


def _omitted(msg: Message) -> frozenset[str]:
    """``msg``'s OMIT_DEFAULTS fields that hold their defaults."""
    return frozenset(
        f.name
        for f in dataclasses.fields(msg)
        if f.name in msg.OMIT_DEFAULTS and getattr(msg, f.name) == f.default
    )


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
    checkers = {f.name: f for f in schema.fields_of(cls)}
    values: dict[str, Any] = {}
    errors: list[schema.FieldError] = []
    for key, value in obj.items():
        if key in ("v", "t"):
            continue
        if key not in checkers:
            raise WireError(
                "bad_field", f"{type_name} has no field {_describe(key)}", msg_id=msg_id
            )
        out = checkers[key].check(value, f"{type_name}.{key}", errors)
        if not errors:
            values[key] = out
    if errors:
        raise WireError("bad_field", _first_error(errors), msg_id=msg_id)
    for name, f in checkers.items():
        if f.required and name not in values:
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

    node_id: str = schema.field(max_len=128)
    name: str = schema.field(max_len=128)
    versions: list[int] = schema.field(max_len=32)
    capabilities: list[str] = schema.field(max_len=128)
    software: str = schema.field(default="", max_len=64)
    """The swarmp2p release the peer runs, for error messages."""
    swarm_id: str = schema.field(default="", max_len=64)
    """The public swarm id the peer belongs to (``SwarmSecret.swarm_id``)."""
    control_port: int = schema.field(default=0, ge=0, le=65535)
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
