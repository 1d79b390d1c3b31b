"""ZeroMQ and zeroconf: swarm secrets, CURVE with ZAP, links, RPC, discovery. No torch.

Each name below is imported from its submodule on first use (PEP 562): reading a secret
(``net.security``, `swarm token`) loads neither the sockets, the RPC nor the wire codec."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_SUBMODULE = {
    "AsyncSecureContext": "auth",
    "ClientKeys": "auth",
    "KeyCheck": "auth",
    "SecureContext": "auth",
    "ServerKeys": "auth",
    "make_client_socket": "auth",
    "make_server_socket": "auth",
    "InProcLink": "links",
    "Link": "links",
    "LinkClosed": "links",
    "LinkTimeout": "links",
    "ZmqLink": "links",
    "stop_zero_copy_collector": "links",
    "RpcClient": "rpc",
    "RpcError": "rpc",
    "RpcServer": "rpc",
    "RpcTimeout": "rpc",
    "request_sync": "rpc",
    "NodeKey": "security",
    "SwarmSecret": "security",
    "fingerprint": "security",
}


def __getattr__(name: str) -> Any:
    module = _SUBMODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULE})


if TYPE_CHECKING:
    from swarmp2p.net.auth import (
        AsyncSecureContext,
        ClientKeys,
        KeyCheck,
        SecureContext,
        ServerKeys,
        make_client_socket,
        make_server_socket,
    )
    from swarmp2p.net.links import (
        InProcLink,
        Link,
        LinkClosed,
        LinkTimeout,
        ZmqLink,
        stop_zero_copy_collector,
    )
    from swarmp2p.net.rpc import RpcClient, RpcError, RpcServer, RpcTimeout, request_sync
    from swarmp2p.net.security import NodeKey, SwarmSecret, fingerprint

__all__ = [
    "AsyncSecureContext",
    "ClientKeys",
    "InProcLink",
    "KeyCheck",
    "Link",
    "LinkClosed",
    "LinkTimeout",
    "NodeKey",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "RpcTimeout",
    "SecureContext",
    "ServerKeys",
    "SwarmSecret",
    "ZmqLink",
    "fingerprint",
    "make_client_socket",
    "make_server_socket",
    "request_sync",
    "stop_zero_copy_collector",
]
