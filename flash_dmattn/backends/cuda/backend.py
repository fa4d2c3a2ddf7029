"""The ``cuda`` backend: compiled CUDA/CuTe kernels, built per specialisation on first use.

Importing this module touches neither CUDA nor nvcc; :meth:`CudaBackend.probe` (run lazily by
the registry) says precisely why the backend is unavailable, listing every missing piece so one
look at ``python -m flash_dmattn info`` tells what to install. The attention kernels themselves
are not written yet, so ``probe`` reports their sources missing and the backend is never
selected; the build plumbing (:mod:`.spec`, :mod:`.toolchain`, :mod:`.jit`) is complete.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..base import Backend
from . import jit, toolchain
from .spec import KernelSpec


def unavailable_reasons() -> List[str]:
    """Every reason the cuda backend cannot run here (empty = it can)."""
    reasons = []
    cap = toolchain.device_capability()
    if cap is None:
        detail = (f" (torch {torch.__version__} is a CPU-only build)"
                  if torch.version.cuda is None else "")
        reasons.append("no CUDA device" + detail)
    elif cap < toolchain.MIN_CAPABILITY:
        reasons.append(f"GPU {toolchain.device_name()} is {toolchain.arch_name(cap)}; needs "
                       f"compute capability >= 8.0")
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        reasons.append("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    elif torch.version.cuda is not None:  # only a CUDA build of torch can mismatch
        version = toolchain.nvcc_version(nvcc)
        if version is None:
            reasons.append(f"could not read the version of {nvcc}")
        else:
            mismatch = toolchain.cuda_major_mismatch(version)
            if mismatch:
                reasons.append(mismatch)
    if toolchain.find_ninja() is None:
        reasons.append("ninja not found (pip install ninja)")
    if toolchain.find_cutlass_include() is None:
        reasons.append("CUTLASS/CuTe headers not found (pip install 'flash_dmattn[cuda]' "
                       "installs nvidia-cutlass)")
    missing = jit.missing_kernel_sources()
    if missing:
        where = os.path.dirname(missing[0])
        names = ", ".join(os.path.basename(m) for m in missing)
        reasons.append(f"kernel sources not present yet ({where} has no {names}: the CUDA "
                       f"attention kernels are not written in this version)")
    return reasons


class CudaBackend(Backend):
    name = "cuda"

    def probe(self) -> Optional[str]:
        reasons = unavailable_reasons()
        return "; ".join(reasons) if reasons else None

    def version(self) -> str:
        nvcc = toolchain.find_nvcc()
        version = toolchain.nvcc_version(nvcc) if nvcc else None
        return f"nvcc {version}" if version else "-"

    def not_supported_reasons(self, inputs) -> List[str]:
        reasons = []
        if inputs.device.type != "cuda":
            reasons.append(f"tensors on {inputs.device.type} (needs CUDA)")
        try:
            KernelSpec.from_inputs(inputs)
        except ValueError as exc:
            reasons.append(str(exc))
        if inputs.return_attn_probs:
            reasons.append("return_attn_probs is not supported (use torch-reference)")
        if getattr(inputs, "cache_seqlens", None) is not None:
            reasons.append("no KV-cache decoding path (cache_seqlens)")
        if getattr(inputs, "block_table", None) is not None:
            reasons.append("no paged-KV path (block_table)")
        return reasons

    def kernel_module(self, spec: KernelSpec, device=None):
        """The compiled extension for ``spec`` on ``device`` (built and cached on first use)."""
        return jit.load_kernel(spec, toolchain.detect(device))

    def attention(self, inputs):
        # The registry never routes here while probe() reports a reason (the kernel sources
        # are missing in this version); a direct call gets the same typed error as any
        # unavailable backend. The fwd/bwd custom ops land together with the kernels.
        from ...registry import BackendUnavailableError

        raise BackendUnavailableError(
            "backend 'cuda' is unavailable: " + "; ".join(unavailable_reasons())
        )
