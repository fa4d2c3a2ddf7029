"""Triton kernels of flash_dmattn (forward, backward and tile-list construction).

Importing this package never fails without Triton: :func:`triton_unavailable_reason` says why
the kernels cannot be used, and the kernel entry points are imported lazily on first access.
"""
from __future__ import annotations

from typing import Optional


def triton_unavailable_reason() -> Optional[str]:
    """None when the ``triton`` package imports, else a human-readable reason."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # broken installs raise more than ImportError
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    return None


def __getattr__(name):
    # Lazy so that `import flash_dmattn.backends.triton` works without triton installed.
    if name == "attention_forward":
        from .forward import attention_forward

        return attention_forward
    if name == "attention_backward":
        from .backward import attention_backward

        return attention_backward
    if name == "attention_forward_varlen":
        from .forward_varlen import attention_forward_varlen

        return attention_forward_varlen
    if name == "attention_backward_varlen":
        from .backward import attention_backward_varlen

        return attention_backward_varlen
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_forward_varlen",
    "attention_backward_varlen",
    "triton_unavailable_reason",
]
