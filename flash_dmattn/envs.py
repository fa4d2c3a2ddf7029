"""Every environment variable the library reads, in one place.

Each is read when it matters (per call, or per build for the kernel cache), never cached at
import, so a test or a user can change it at run time. The library has no other hidden
configuration: tuning choices that measurements settled are constants next to the code they
steer, with the reason in a comment.

For users (documented in README.md, "Configuration"):

========================== ================================================================
``FLASH_DMATTN_BACKEND``   a backend name: auto-dispatched calls use it (and fail, not fall
                           back, where it cannot run the inputs)
``FLASH_DMATTN_DISABLE``   comma list of backend names that neither auto-dispatch nor an
                           explicit request may use
``FLASH_DMATTN_CACHE_DIR`` where the cuda backend keeps its compiled kernels (default
                           ``$XDG_CACHE_HOME/flash_dmattn`` or ``~/.cache/flash_dmattn``)
``FLASH_DMATTN_HF_VARLEN`` ``auto`` / ``always`` / ``never``: whether the Hugging Face
                           integration runs padded batches as packed sequences
``FLASH_DMATTN_CUDA_AUTO`` ``1``: auto-dispatch prefers the cuda backend on every GPU, not
                           only on the generations it was measured on (see policy.py)
``FLASH_DMATTN_TRITON_AUTOTUNE`` ``0``: the Triton kernels take their first fitting config
                           instead of autotuning (a quicker first call, possibly slower ones)
``TRITON_INTERPRET``       ``1``: Triton's CPU interpreter (Triton's own variable; the
                           triton backend then runs on CPU tensors, slowly)
========================== ================================================================

At install time, ``setup.py`` reads ``FLASH_DMATTN_PREBUILD`` (``all`` or a comma list of
cuda kernel specs to compile into the wheel; see setup.py). For kernel development,
``FLASH_DMATTN_CUDA_FLAGS`` adds nvcc flags to every cuda kernel build (part of the cache key;
see docs/architecture.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Set

BACKEND = "FLASH_DMATTN_BACKEND"
DISABLE = "FLASH_DMATTN_DISABLE"
CACHE_DIR = "FLASH_DMATTN_CACHE_DIR"
HF_VARLEN = "FLASH_DMATTN_HF_VARLEN"
CUDA_AUTO = "FLASH_DMATTN_CUDA_AUTO"
TRITON_AUTOTUNE = "FLASH_DMATTN_TRITON_AUTOTUNE"
CUDA_FLAGS = "FLASH_DMATTN_CUDA_FLAGS"


def _env(name: str) -> Optional[str]:
    """``os.environ.get(name)``. Read on every dispatched call (a decoding step asks a few per
    layer), so it looks in the mapping's own store: CPython's ``os.environ`` keeps its entries
    encoded in ``_data`` (updated by every assignment and deletion through it, as
    ``monkeypatch.setenv`` makes them), where the generic ``Mapping.get`` costs several Python
    calls. A mapping without that store is asked the usual way."""
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None:
        return env.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = env.encodekey(name)
    raw = data.get(key)
    return None if raw is None else env.decodevalue(raw)


_ENV_KEYS: dict = {}  # name -> its key in os.environ._data


def forced_backend() -> Optional[str]:
    """``$FLASH_DMATTN_BACKEND`` stripped, or None when unset or blank."""
    raw = _env(BACKEND)
    return (raw.strip() or None) if raw else None


def disabled_backends() -> Set[str]:
    """The names in ``$FLASH_DMATTN_DISABLE`` (comma separated, blanks ignored)."""
    raw = _env(DISABLE)
    if not raw:  # the usual case, read on every dispatched call: no parsing
        return set()
    return {n.strip() for n in raw.split(",") if n.strip()}


def cache_dir() -> Optional[Path]:
    """``$FLASH_DMATTN_CACHE_DIR`` (``~`` expanded), or None when unset or empty."""
    raw = _env(CACHE_DIR)
    return Path(raw).expanduser() if raw else None


def hf_varlen_mode() -> Optional[str]:
    """``$FLASH_DMATTN_HF_VARLEN`` stripped, or None when unset or blank (the integration
    validates the value)."""
    raw = _env(HF_VARLEN)
    return (raw.strip() or None) if raw else None


def cuda_auto() -> bool:
    """True when ``$FLASH_DMATTN_CUDA_AUTO`` is set and not ``0``."""
    raw = _env(CUDA_AUTO)
    return raw is not None and raw.strip() not in ("", "0")


def triton_autotune() -> bool:
    """False when ``$FLASH_DMATTN_TRITON_AUTOTUNE`` is ``0``: launch the first fitting config."""
    raw = _env(TRITON_AUTOTUNE)
    return raw is None or raw.strip() != "0"


def cuda_extra_flags() -> List[str]:
    """``$FLASH_DMATTN_CUDA_FLAGS`` split on whitespace (extra nvcc flags, kernel development)."""
    return (_env(CUDA_FLAGS) or "").split()


def dispatch_environment() -> tuple:
    """The raw values (None where unset) of the variables auto-dispatch's decision reads:
    ``FLASH_DMATTN_DISABLE``, ``FLASH_DMATTN_CUDA_AUTO``, ``TRITON_INTERPRET`` and
    ``FLASH_DMATTN_BACKEND`` (part of the key its memo keeps decisions by; a forced backend is
    also read before the memo is asked, see :func:`flash_dmattn.registry.select_backend`)."""
    return _raw_values(_DISPATCH_NAMES, _DISPATCH_KEYS)


def kernel_environment() -> tuple:
    """The raw values (None where unset) of the variables that choose a compiled extension:
    ``FLASH_DMATTN_CUDA_FLAGS`` and ``FLASH_DMATTN_CACHE_DIR`` (part of the key of the cuda
    backend's per-call module memo)."""
    return _raw_values(_KERNEL_NAMES, _KERNEL_KEYS)


_DISPATCH_NAMES = (DISABLE, CUDA_AUTO, "TRITON_INTERPRET", BACKEND)
_KERNEL_NAMES = (CUDA_FLAGS, CACHE_DIR)
# Their os.environ._data keys, encoded on first use (the values are read on every call).
_DISPATCH_KEYS: list = []
_KERNEL_KEYS: list = []


def _raw_values(names: tuple, keys: list) -> tuple:
    """The values of ``names`` as stored (None where unset): read on every attention call as
    part of a memo key, so straight from ``os.environ``'s store (see :func:`_env`), where only
    their equality matters. ``keys`` caches the names' encoded store keys."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return tuple(_env(n) for n in names)
    if not keys:
        keys[:] = [os.environ.encodekey(n) for n in names]
    return tuple(map(data.get, keys))


def interpret_mode() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    raw = _env("TRITON_INTERPRET")
    return raw is not None and raw.lower() in ("1", "true", "yes", "on")
