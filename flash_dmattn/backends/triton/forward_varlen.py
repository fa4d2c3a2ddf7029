"""Host side of the Triton forward over packed sequences (``cu_seqlens``): assembles the
:mod:`.forward_kernel` arguments of a varlen call (the kernel's ``VARLEN`` mode) and launches it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...intmath import cdiv
from . import forward_kernel
from .common import (
    LOG2E,
    alloc_output,
    broadcast_strides,
    dot_upcast,
    fwd_blocks,
    head_block,
    last_dim_contiguous,
    seqlen_bucket,
)
from .dropout_mask import dropout_args
from .varlen import varlen_aux_4d, varlen_list_args, varlen_tail_rows


def attention_forward_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward over packed sequences (docs/contract.md §4).

    Args:
        q: ``(total_q, H, D)``; k, v: ``(total_k, Hkv, D)``; sequence ``i`` owns query rows
            ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows likewise (int32 offsets on the
            tensors' device, non-decreasing; not validated here, that would need a host sync).
        max_seqlen_q / max_seqlen_k: upper bounds of the per-sequence lengths (they size the
            grid; a sequence longer than ``max_seqlen_q`` leaves rows unwritten).
        mask: None or bool ``(1|Hkv|H, total_k)``; bias: None or float ``(1|Hkv|H, total_k)``,
            one value per key for every query of its sequence.
        softmax_scale, is_causal (bottom-right per sequence), softcap, dropout_p,
            dropout_rng: as :func:`attention_forward` (dropout's batch is the sequence).

    Returns:
        ``out (total_q, H, D)`` in q's dtype and ``lse (H, total_q)`` fp32. Rows with no
        visible key, empty sequences and rows past ``cu_seqlens_q[-1]`` give 0 / -inf.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    total_q, H, D = q.shape
    Hkv = k.shape[1]
    n_seqs = cu_seqlens_q.numel() - 1
    device = q.device
    out = alloc_output((total_q, H, D), q.dtype, device)
    lse = alloc_output((H, total_q), torch.float32, device)
    if n_seqs <= 0 or H * total_q == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    block_m, block_n = fwd_blocks(D)
    mask4, bias4 = varlen_aux_4d(mask), varlen_aux_4d(bias)
    mask_arg = mask4.view(torch.uint8) if mask4 is not None else q
    bias_arg = bias4 if bias4 is not None else q
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    idx, cnt, lst = varlen_list_args(mask, cu_k, max_seqlen_k, H, block_n, q)
    has_softcap = softcap > 0.0
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    # The packed tensors are batch 1 (batch strides 0); programs offset by their sequence start.
    args = (
        q, k, v, out, lse, mask_arg, bias_arg, idx, cnt, q, q, cu_q, cu_k,
        0, q.stride(0), q.stride(1),
        0, k.stride(0), k.stride(1),
        0, v.stride(0), v.stride(1),
        0, out.stride(0), out.stride(1),
        *broadcast_strides(mask4, H), *broadcast_strides(bias4, H), *lst, 0, 0, 0,
        H, H // Hkv, max_seqlen_q, max_seqlen_k, cdiv(max_seqlen_k, block_n), lse.stride(0),
        softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
        seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_k), *drop_args,
    )
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, MASK_QB=True, MASK_KB=False,
        HAS_BIAS=bias is not None, BIAS_QB=True, BIAS_KB=False,
        IS_CAUSAL=bool(is_causal), USE_LIST=mask is not None, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), GATHER=False, VARLEN=True, DROPOUT=dropout,
    )
    grid = (cdiv(max_seqlen_q, block_m), n_seqs * H)
    forward_kernel.launch_fwd(grid, args, meta)
    tail = varlen_tail_rows(cu_q, total_q)
    out.masked_fill_(tail[:, None, None], 0.0)
    lse.masked_fill_(tail[None, :], float("-inf"))
    return out, lse
