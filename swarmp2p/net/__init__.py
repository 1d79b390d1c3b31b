"""ZeroMQ and zeroconf: swarm secrets, CURVE with ZAP, links, RPC, discovery. No torch."""

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
