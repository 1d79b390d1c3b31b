"""Runtimes by name: resolving one imports its framework, listing them imports nothing."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

RuntimeFactory = Callable[[], Any]
"""A zero-argument callable returning a runtime object; called once, on first use."""

_BUILTIN: dict[str, str] = {"torch": "swarmp2p.runtime.torch:TorchRuntime"}
"""Built-in runtimes as ``module:attribute``, imported only when first resolved."""

_lock = threading.Lock()
_factories: dict[str, RuntimeFactory] = {}
_instances: dict[str, Any] = {}


def _import_builtin(target: str) -> RuntimeFactory:
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def register_runtime(name: str, factory: RuntimeFactory, *, replace: bool = False) -> None:
    """Make ``get_runtime(name)`` return ``factory()``; refuses to shadow a name unless ``replace``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"runtime name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"runtime {name!r}: factory must be callable, got {type(factory).__name__}")
    with _lock:
        if not replace and (name in _factories or name in _BUILTIN):
            raise ValueError(
                f"runtime {name!r} is already registered; pass replace=True to override it"
            )
        _factories[name] = factory
        _instances.pop(name, None)


def available_runtimes() -> list[str]:
    """Names ``get_runtime`` accepts, sorted; imports no framework."""
    with _lock:
        return sorted(set(_BUILTIN) | set(_factories))


def get_runtime(name: str) -> Any:
    """The runtime called ``name``, built on first use and then shared."""
    with _lock:
        if name in _instances:
            return _instances[name]
        factory = _factories.get(name)
    if factory is None:
        target = _BUILTIN.get(name)
        if target is None:
            raise ValueError(
                f"unknown runtime {name!r}; available: {', '.join(available_runtimes())}"
            )
        try:
            factory = _import_builtin(target)
        except ImportError as error:
            raise ImportError(
                f"runtime {name!r} needs packages that are not installed ({error}); "
                "install them with `pip install 'swarmp2p[runtime]'` or `./install.sh`"
            ) from error
    instance = factory()
    with _lock:
        return _instances.setdefault(name, instance)
