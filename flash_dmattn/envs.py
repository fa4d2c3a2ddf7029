"""Validated choices read from environment variables (the backends' experiment switches)."""
from __future__ import annotations

import os
from typing import Sequence


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """``$name`` lower-cased, ``default`` when unset or blank; ValueError unless in ``choices``.

    Plain-Python equivalent: ``os.environ.get(name, "").strip().lower() or default``, checked.
    """
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def interpret_mode() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
