"""The compiled extension of a call (built on first use) and the tensor layouts its kernels
take; shared by the cuda backend's tile-list path (:mod:`.kernels`) and its key-interval path
(:mod:`.intervals`).
"""
from __future__ import annotations

import torch

from . import jit, toolchain
from .spec import KernelSpec


def kernel_module(q: torch.Tensor, has_mask: bool, has_bias: bool, packed: bool = False):
    """The compiled extension for this call's specialisation (built on first use)."""
    spec = KernelSpec.for_call(q.shape[-1], q.dtype, has_mask, has_bias, packed)
    return jit.load_kernel(spec, toolchain.detect(q.device))


def vector_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim and 16-byte aligned rows (copied only if needed)."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        t.size(d) == 1 or t.stride(d) % 8 == 0 for d in range(t.dim() - 1))
    return t if ok else t.contiguous()


def reduce_key_partials(partial: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(B, H, Lk) fp32 per-(batch, head) key sums -> the bias's own shape and dtype."""
    B, H, Lk = partial.shape
    bb, hb, _, kb = bias.shape
    x = partial.view(B, hb, H // hb, Lk).sum(2)
    if bb == 1 and B > 1:
        x = x.sum(0, keepdim=True)
    if kb == 1 and Lk > 1:
        x = x.sum(-1, keepdim=True)
    return x.unsqueeze(2).to(bias.dtype)
