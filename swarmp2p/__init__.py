"""swarmp2p: pipeline-parallel training and serving of causal LMs across the machines of a LAN."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
"""Version of the wire protocol and of the plan format; peers refuse a mismatch."""

__all__ = ["PROTOCOL_VERSION", "__version__"]
