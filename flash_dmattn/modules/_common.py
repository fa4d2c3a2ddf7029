"""Small argument checks shared by the modules in this package."""
from __future__ import annotations

from typing import Callable, Optional

from .. import registry
from ..api import flash_dmattn_func_auto


def check_positive_int(name: str, value) -> int:
    # bool is a subclass of int; accepting True as "1" would hide caller bugs.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_backend_name(backend: Optional[str]) -> Optional[str]:
    """Reject unknown names at construction; availability is checked at call time.

    Availability is deliberately not checked here: a model is often built on a machine
    (or device) other than the one it runs on, e.g. constructed on CPU and moved to a GPU.
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend not in registry.PRIORITY:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(registry.PRIORITY)}")
    return backend


def attention_function(backend: Optional[str]) -> Callable:
    """The attention function for ``backend`` (``None``: per-call auto-dispatch)."""
    return flash_dmattn_func_auto(backend)
