"""ZeroMQ and zeroconf: swarm secrets, CURVE with ZAP, links, RPC, discovery. No torch."""

from swarmp2p.net.auth import (
    AsyncSecureContext,
    SecureContext,
    make_client_socket,
    make_server_socket,
)
from swarmp2p.net.rpc import RpcClient, RpcError, RpcServer, RpcTimeout, request_sync
from swarmp2p.net.security import SwarmSecret

__all__ = [
    "AsyncSecureContext",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "RpcTimeout",
    "SecureContext",
    "SwarmSecret",
    "make_client_socket",
    "make_server_socket",
    "request_sync",
]
