"""Stage runtimes, resolved by name; importing this package imports no framework."""

from swarmp2p.runtime.registry import available_runtimes, get_runtime, register_runtime

__all__ = ["available_runtimes", "get_runtime", "register_runtime"]
