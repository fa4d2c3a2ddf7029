"""The backend registry and the dispatch rules of SPEC §6.

Priority order is ``cuda, triton, flex, torch-reference``. Environment:

* ``FLASH_DMATTN_BACKEND=<name>`` forces that backend for auto-dispatched calls;
* ``FLASH_DMATTN_DISABLE=a,b`` removes backends from both auto-dispatch and explicit use.

Auto-dispatch runs the first backend that supports the inputs and has no preference
against them (``auto_skip_reasons``); a backend skipped only for preference still runs when
nothing else can. When none can, one ``RuntimeError`` lists every backend's reasons. An explicitly requested backend never falls
back: it raises ``ValueError`` with its own reasons.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .inputs import AttentionInputs, VarlenInputs

if TYPE_CHECKING:  # the backends package registers its backends here: no import back
    from .backends.base import Backend

logger = logging.getLogger("flash_dmattn")

PRIORITY = ("cuda", "triton", "flex", "torch-reference")

# Devices on which landing on the reference is a performance problem worth a warning.
ACCELERATED_DEVICE_TYPES = {"cuda"}

NOT_BUILT = "not part of this version of flash_dmattn yet"

_BACKENDS: Dict[str, Backend] = {}
_logged_choices: set = set()
_warned_fallbacks: set = set()


class BackendUnavailableError(RuntimeError):
    """A backend was requested by name but cannot run in this environment."""


def register_backend(backend: Backend) -> Backend:
    if backend.name not in PRIORITY:
        raise ValueError(f"unknown backend name {backend.name!r}; expected one of {PRIORITY}")
    _BACKENDS[backend.name] = backend
    return backend


def registered_backends() -> List[Backend]:
    """Every registered backend in priority order, available or not."""
    return [_BACKENDS[n] for n in PRIORITY if n in _BACKENDS]


def disabled_names() -> set:
    raw = os.environ.get("FLASH_DMATTN_DISABLE", "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def forced_name() -> Optional[str]:
    raw = os.environ.get("FLASH_DMATTN_BACKEND", "").strip()
    return raw or None


def unavailable_reason(backend: Backend) -> Optional[str]:
    if backend.name in disabled_names():
        return "disabled by FLASH_DMATTN_DISABLE"
    return backend.unavailable_reason()


def get_available_backends() -> List[str]:
    """Names of the backends usable in this environment, in priority order.

    Example: ``["triton", "flex", "torch-reference"]`` on a GPU machine without nvcc.
    """
    return [b.name for b in registered_backends() if unavailable_reason(b) is None]


def get_backend(name: str) -> Backend:
    """The backend called ``name``, or an error that says why it cannot be used."""
    if name not in PRIORITY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(PRIORITY)}")
    if name not in _BACKENDS:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {NOT_BUILT}")
    backend = _BACKENDS[name]
    reason = unavailable_reason(backend)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    return backend


Inputs = Union[AttentionInputs, VarlenInputs]


def can_run(name: str, inputs: Inputs) -> bool:
    """Whether backend ``name`` is available and supports ``inputs`` (preferences ignored)."""
    backend = _BACKENDS.get(name)
    if backend is None or unavailable_reason(backend) is not None:
        return False
    return not _reasons(backend, inputs)


def _reasons(backend: Backend, inputs: Inputs) -> List[str]:
    if isinstance(inputs, VarlenInputs):
        return list(backend.varlen_not_supported_reasons(inputs))
    return list(backend.not_supported_reasons(inputs))


def check_explicit(backend: Backend, inputs: Inputs) -> Backend:
    """Raise ValueError when an explicitly chosen backend cannot run ``inputs``."""
    reasons = _reasons(backend, inputs)
    if reasons:
        raise ValueError(
            f"backend {backend.name!r} cannot run these inputs ({inputs.describe()}): "
            + "; ".join(reasons)
        )
    return backend


def select_backend(inputs: Inputs) -> Backend:
    """The backend auto-dispatch runs for ``inputs`` (SPEC §6)."""
    forced = forced_name()
    if forced is not None:
        return check_explicit(get_backend(forced), inputs)

    declined: List[Tuple[str, List[str]]] = []
    runnable: List[Backend] = []  # could run, but asked auto-dispatch to prefer a later one
    for name in PRIORITY:
        backend = _BACKENDS.get(name)
        if backend is None:
            declined.append((name, [f"unavailable: {NOT_BUILT}"]))
            continue
        reason = unavailable_reason(backend)
        if reason is not None:
            declined.append((name, [f"unavailable: {reason}"]))
            continue
        reasons = _reasons(backend, inputs)
        if not reasons:
            # Preferences apply to packed (varlen) calls too: e.g. the Triton interpreter on CPU.
            preference = list(backend.auto_skip_reasons(inputs))
            if preference:
                runnable.append(backend)
                declined.append((name, preference))
                continue
        if reasons:
            declined.append((name, reasons))
            continue
        return _chosen(backend, inputs, declined)
    if runnable:
        return _chosen(runnable[0], inputs, declined)
    raise RuntimeError(
        f"no flash_dmattn backend can run these inputs ({inputs.describe()}):\n"
        + _format_declines(declined)
    )


def _chosen(backend: Backend, inputs: Inputs, declined) -> Backend:
    if not torch.compiler.is_compiling():
        _note_choice(backend, inputs, declined)
    return backend


def _format_declines(declined: Iterable[Tuple[str, List[str]]]) -> str:
    return "\n".join(f"  {name}: {'; '.join(reasons)}" for name, reasons in declined)


def _note_choice(backend: Backend, inputs: Inputs, declined) -> None:
    key = (backend.name, inputs.device.type, type(inputs).__name__)
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.info("flash_dmattn: using backend %r for %s inputs", backend.name, inputs.device.type)
    if backend.name == "torch-reference" and inputs.device.type in ACCELERATED_DEVICE_TYPES:
        wkey = (inputs.device.type, tuple((n, tuple(r)) for n, r in declined))
        if wkey not in _warned_fallbacks:
            _warned_fallbacks.add(wkey)
            warnings.warn(
                "flash_dmattn fell back to the slow torch-reference backend on "
                f"{inputs.device.type} ({inputs.describe()}) because the faster backends "
                "declined:\n" + _format_declines(declined),
                RuntimeWarning,
                stacklevel=4,
            )


def reset_dispatch_notes() -> None:
    """Forget which choices were logged / warned (tests use this)."""
    _logged_choices.clear()
    _warned_fallbacks.clear()
