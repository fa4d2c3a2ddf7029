"""Finding what a CUDA kernel build needs: nvcc, ninja, the CUTLASS/CuTe headers, the GPU arch.

Nothing here runs at import time. Discovery results are cached per process
(:func:`clear_caches` forgets them, e.g. after changing ``CUDA_HOME``); the GPU is queried only
when a function that needs it is called.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import torch

MIN_CAPABILITY = (8, 0)
_EXE = ".exe" if os.name == "nt" else ""


class ToolchainError(RuntimeError):
    """Something a CUDA kernel build needs is missing; the message says what."""


@functools.lru_cache(maxsize=None)
def find_nvcc() -> Optional[str]:
    """Path of nvcc: ``$CUDA_HOME`` / ``$CUDA_PATH``, then torch's ``CUDA_HOME``, then ``PATH``.

    The order is the one ``torch.utils.cpp_extension`` uses to pick the compiler it will run,
    so the version reported (and hashed into cache keys) is that of the nvcc that builds.
    """
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if torch.version.cuda is not None:
        # Importing cpp_extension is slow-ish and pointless for a CPU-only torch build.
        from torch.utils.cpp_extension import CUDA_HOME as torch_cuda_home

        homes.append(torch_cuda_home)
    for home in homes:
        if home:
            candidate = Path(home) / "bin" / f"nvcc{_EXE}"
            if candidate.is_file():
                return str(candidate)
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> Optional[str]:
    """``"12.4.131"`` from ``nvcc --version`` (None when it cannot be run or parsed)."""
    try:
        res = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+), V(\d+(?:\.\d+)*)", res.stdout)
    if match:
        return match.group(2)
    match = re.search(r"release (\d+\.\d+)", res.stdout)
    return match.group(1) if match else None


@functools.lru_cache(maxsize=None)
def find_ninja() -> Optional[str]:
    """Path of ninja (``torch.utils.cpp_extension.load`` builds through it)."""
    return shutil.which("ninja")


@functools.lru_cache(maxsize=None)
def find_cutlass_include() -> Optional[str]:
    """The CUTLASS/CuTe include dir: ``$CUTLASS_PATH/include``, else the ``nvidia-cutlass``
    package's ``cutlass_library/source/include`` (the ``cuda`` extra installs it).

    Uses ``find_spec`` so the package is located without being imported.
    """
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(Path(os.environ["CUTLASS_PATH"]) / "include")
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "source" / "include")
    for inc in candidates:
        if (inc / "cute" / "tensor.hpp").is_file() and (inc / "cutlass" / "cutlass.h").is_file():
            return str(inc)
    return None


def device_capability(device=None) -> Optional[Tuple[int, int]]:
    """Compute capability of ``device`` (default: the current one), or None without a GPU.

    Queried lazily: this initialises CUDA, so only call it when CUDA is about to be used.
    """
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def device_name(device=None) -> str:
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no GPU"


def arch_name(capability: Tuple[int, int]) -> str:
    """``(9, 0) -> "sm_90"``."""
    return f"sm_{capability[0]}{capability[1]}"


def gencode_flags(capability: Tuple[int, int]) -> List[str]:
    """nvcc flags that compile for exactly this arch (SASS only: the cache is per arch).

    Hopper (9.0) builds for ``sm_90a``, the arch-specific target whose wgmma instructions the
    Hopper forward kernels (csrc/flash_fwd_sm90*.cu) need, and tells the sources so with
    ``FLASH_DMATTN_SM90=1``.
    """
    cc = f"{capability[0]}{capability[1]}"
    if tuple(capability) == (9, 0):
        return ["-gencode", "arch=compute_90a,code=sm_90a", "-DFLASH_DMATTN_SM90=1"]
    return ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]


def cuda_major_mismatch(nvcc_ver: Optional[str]) -> Optional[str]:
    """Why nvcc cannot build extensions for this torch (major CUDA versions differ), or None.

    ``torch.utils.cpp_extension`` refuses such builds; saying so up front beats a failed build.
    """
    if torch.version.cuda is None or not nvcc_ver:
        return None
    if nvcc_ver.split(".")[0] != torch.version.cuda.split(".")[0]:
        return (f"nvcc {nvcc_ver} does not match the CUDA {torch.version.cuda} torch was built "
                f"with (major versions must agree)")
    return None


def clear_caches() -> None:
    """Forget cached discovery results (after changing CUDA_HOME, PATH or installs)."""
    for fn in (find_nvcc, nvcc_version, find_ninja, find_cutlass_include):
        fn.cache_clear()


@dataclass(frozen=True)
class Toolchain:
    """Everything a build depends on besides the sources and the spec."""

    nvcc: str
    nvcc_version: str
    cutlass_include: str
    capability: Tuple[int, int]
    torch_version: str = field(default_factory=lambda: torch.__version__)

    @property
    def arch(self) -> str:
        return arch_name(self.capability)

    def gencode_flags(self) -> List[str]:
        return gencode_flags(self.capability)


def detect(device=None) -> Toolchain:
    """The toolchain for building kernels for ``device``; ``ToolchainError`` says what is missing."""
    cap = device_capability(device)
    if cap is None:
        raise ToolchainError("no CUDA device")
    if cap < MIN_CAPABILITY:
        raise ToolchainError(f"needs a GPU of compute capability >= 8.0, found {arch_name(cap)}")
    nvcc = find_nvcc()
    if nvcc is None:
        raise ToolchainError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    version = nvcc_version(nvcc)
    if version is None:
        raise ToolchainError(f"could not read the version of {nvcc}")
    inc = find_cutlass_include()
    if inc is None:
        raise ToolchainError("CUTLASS/CuTe headers not found (pip install nvidia-cutlass)")
    return Toolchain(nvcc=nvcc, nvcc_version=version, cutlass_include=inc, capability=cap)
