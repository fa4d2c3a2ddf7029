"""The compiled extension of a call (built on first use) and the tensor layouts its kernels
take; shared by the cuda backend's tile-list path (:mod:`.kernels`) and its key-interval path
(:mod:`.intervals`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import envs
from . import jit, toolchain
from .spec import KernelSpec


def kernel_module(q: torch.Tensor, has_mask: bool, has_bias: bool, packed: bool = False, *,
                  op: str):
    """The compiled extension of operation ``op`` (``fwd``, ``bwd`` or ``decode``, see
    :data:`.jit.OPS`) for this call's specialisation, built on first use: a call loads only
    the operation it runs.

    Memoised by the call's raw attributes (head dim, dtype, flags, device and the variables
    that choose a build): the specialisation, the toolchain and the loader's key cost a
    device query, a path expansion and a few dozen Python calls, paid by every attention
    call otherwise."""
    key = (q.shape[-1], q.dtype, has_mask, has_bias, packed, op, q.get_device(),
           envs.kernel_environment())
    module = jit.BY_ATTRIBUTES.get(key)
    if module is None:
        spec = KernelSpec.for_call(q.shape[-1], q.dtype, has_mask, has_bias, packed)
        module = jit.load_kernel(spec, op, toolchain.detect(q.device))
        jit.BY_ATTRIBUTES[key] = module
    return module


def kernel_modules(q: torch.Tensor, has_mask: bool, has_bias: bool, packed: bool = False, *,
                   ops):
    """``{op: module}`` for several operations of this call's specialisation; those not built
    yet build side by side (a training step's forward asks for its backward's too)."""
    spec = KernelSpec.for_call(q.shape[-1], q.dtype, has_mask, has_bias, packed)
    return jit.load_kernels(spec, tuple(ops), toolchain.detect(q.device))


def vector_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim and 16-byte aligned rows (copied only if needed)."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        t.size(d) == 1 or t.stride(d) % 8 == 0 for d in range(t.dim() - 1))
    return t if ok else t.contiguous()


def kernel_bias(bias, dtype: torch.dtype):
    """``bias`` as the kernels read it: in the inputs' ``dtype`` (fp16 / bf16).

    A float32 bias (docs/contract.md §3.2) is converted once per call, its stored elements
    only: broadcast (stride-0) dims stay broadcast, so the copy has the bias's own size at
    half its bytes. Finite values beyond ``dtype``'s range saturate at its largest finite value
    instead of becoming infinite, so a row of large negative finite values (an additive mask
    built with ``torch.finfo(torch.float32).min``) keeps its meaning; ``+-inf`` and NaN stay as
    they are. Equivalent plain PyTorch::

        big = torch.finfo(dtype).max
        torch.where(bias.isinf(), bias, bias.clamp(-big, big)).to(dtype)

    The gradient of such a bias is summed in fp32 and returned in float32 (the callers'
    ``dbias_dtype``)."""
    if bias is None or bias.dtype == dtype:
        return bias
    base = bias.detach()
    for dim in range(base.dim()):
        if base.size(dim) > 1 and base.stride(dim) == 0:
            base = base.narrow(dim, 0, 1)
    out = base.to(dtype)
    big = torch.finfo(dtype).max
    over = out.isinf() & base.isfinite()
    out.masked_fill_(over & (base > 0), big).masked_fill_(over & (base < 0), -big)
    return out.expand(bias.shape)


NO_DROPOUT = (None, 0, 1.0, 0, 0, 0)


def dropout_args(dropout_p: float, dropout_rng: Optional[torch.Tensor], batch0: int = 0,
                 head0: int = 0, heads: int = 0) -> tuple:
    """The extension's trailing dropout arguments ``(drop_rng, drop_threshold, drop_scale,
    drop_b0, drop_h0, drop_heads)`` of a call (:mod:`flash_dmattn.dropout`; threshold and
    scale computed here, as for every implementation). A call on batches ``batch0 ..`` and
    query heads ``head0 ..`` of a larger one with ``heads`` query heads (0: the call's own)
    draws that call's keep-mask."""
    if not dropout_p:
        return NO_DROPOUT
    from ...dropout import keep_scale, keep_threshold

    rng = dropout_rng.to(dtype=torch.int64).contiguous()
    return (rng, keep_threshold(dropout_p), keep_scale(dropout_p), int(batch0), int(head0),
            int(heads))


def reduce_key_partials(partial: torch.Tensor, bias: torch.Tensor,
                        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(B, H, Lk) fp32 per-(batch, head) key sums -> the bias's own shape, in ``dtype``
    (default: the bias's dtype)."""
    B, H, Lk = partial.shape
    bb, hb, _, kb = bias.shape
    x = partial.view(B, hb, H // hb, Lk).sum(2)
    if bb == 1 and B > 1:
        x = x.sum(0, keepdim=True)
    if kb == 1 and Lk > 1:
        x = x.sum(-1, keepdim=True)
    return x.unsqueeze(2).to(dtype or bias.dtype)
