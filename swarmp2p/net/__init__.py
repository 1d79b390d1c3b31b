"""ZeroMQ and zeroconf: swarm secrets, CURVE with ZAP, links, RPC, discovery. No torch."""
