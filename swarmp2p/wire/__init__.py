"""What crosses the network: msgpack control messages, tensor frames and codecs. No torch."""

from swarmp2p.wire.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    WIRE_ERROR_CODES,
    ErrorReply,
    Hello,
    Message,
    WireError,
    common_version,
    decode,
    encode,
    message,
    message_types,
    shared_capabilities,
    unpack_plain,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "WIRE_ERROR_CODES",
    "ErrorReply",
    "Hello",
    "Message",
    "WireError",
    "common_version",
    "decode",
    "encode",
    "message",
    "message_types",
    "shared_capabilities",
    "unpack_plain",
]
