"""Host side of the Triton forward for dense (batched) calls: plans the call's key walk (tile
lists, gathered keys or every tile), assembles the kernel's arguments and launches
:mod:`.forward_kernel`; with ``keep_plan`` it also plans the backward of the call.

A per-key mask whose rows the planner finds mostly uncut runs as two launches
(:func:`_launch_plain_rows`, see :mod:`flash_dmattn.planning.plain_rows`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ...envs import interpret_mode
from ...intmath import cdiv
from ...planning.decode import sm_count
from ...planning.gather import KeyGather, gather_policy, plan_key_gather
from ...planning.key_mask_lists import per_key_eligible
from ...planning.mask_summary import summarize_mask, summary_blocks, wants_summary
from ...planning.plain_rows import plan_plain_rows
from ...planning.plan import NOT_PLANNED, plan_backward
from ...planning.rows import aligned_rows
from ...planning.tiles import TileLists, build_tile_lists
from . import forward_kernel
from .common import (
    LOG2E,
    alloc_output,
    broadcast_strides,
    bwd_blocks,
    dot_upcast,
    fwd_blocks,
    head_block,
    last_dim_contiguous,
    seqlen_bucket,
)
from .dropout_mask import dropout_args


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    tiles: Optional[Union[TileLists, KeyGather]] = None,
    keep_plan: bool = False,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
):
    """Attention forward.

    Args:
        q: ``(B, Lq, H, D)``; k, v: ``(B, Lk, Hkv, D)``, fp16/bf16 (fp32 accepted). Last dim
            contiguous (made so otherwise); other strides arbitrary.
        mask: None or bool ``(Bx, Hx, Qx, Kx)`` view (broadcast dims of size 1), True = attend.
        bias: None or float ``(Bx, Hx, Qx, Kx)`` view (q's dtype or fp32), added after softcap.
        softmax_scale: multiplies q.k (0.0 allowed). is_causal: bottom-right aligned causal.
        softcap: 0.0 = off, else ``softcap * tanh(s / softcap)``.
        tiles: optional prebuilt forward tile lists for :func:`fwd_blocks`, or a prebuilt
            :class:`KeyGather` for its ``block_m`` (planned here if None).
        keep_plan: also plan the backward of this call (after launching the kernel, so the
            host work overlaps it) and return that
            :class:`~flash_dmattn.planning.plan.BackwardPlan` third.
        dropout_p, dropout_rng: attention dropout and the call's int64 ``(seed, offset)``
            tensor on q's device (:mod:`flash_dmattn.dropout`); off when ``dropout_p`` is 0.

    Returns:
        ``out`` ``(B, Lq, H, D)`` in q's dtype (contiguous) and ``lse`` ``(B, H, Lq)`` fp32
        (natural log; -inf and zero output for rows with no visible key); with ``keep_plan``
        also the backward plan (None for an empty call).
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    device = q.device
    out = alloc_output((B, Lq, H, D), q.dtype, device)
    lse = alloc_output((B, H, Lq), torch.float32, device)
    if B * H * Lq == 0 or Lk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse, None) if keep_plan else (out, lse)

    block_m, block_n = fwd_blocks(D)
    mask, mask_pad = aligned_rows(mask, Lq, Lk)
    bias_in = bias
    bias, bias_pad = aligned_rows(bias, Lq, Lk)  # read only: the forward has no dbias
    gather = None
    summary = None
    plain = None  # the uncut-rows decision (plain_rows) of lists planned here
    planned_here = tiles is None
    if isinstance(tiles, KeyGather):
        gather, tiles = tiles, None
    elif tiles is None:
        # A per-query mask is read once, by one kernel, for everything planned from it (with
        # keep_plan at a granularity that also serves the backward's block shapes).
        if wants_summary(mask, Lq, Lk):
            blocks = [(block_m, block_n)] + (list(bwd_blocks(D)) if keep_plan else [])
            summary = summarize_mask(mask, *summary_blocks(*blocks), is_causal)
        gather = plan_key_gather(mask, bias, Lq, Lk, H, is_causal, block_m, block_n,
                                 summary=summary, lagged=True)
        if gather is None:
            if mask is not None and per_key_eligible(mask, block_n):
                plain = plan_plain_rows(
                    (device, tuple(mask.shape), Lq, Lk, bool(is_causal), block_m, block_n),
                    device, cdiv(Lq, block_m) * B * H)
            tiles = build_tile_lists(mask, Lq, Lk, H, is_causal, block_m, block_n, device,
                                     need_fwd=True, need_bwd=False, summary=summary,
                                     with_bits=True,
                                     cut_flag=plain.cut_flag if plain is not None else None)
    use_list = tiles is not None or gather is not None
    if gather is not None:
        idx, cnt, lst, list_hdiv = gather.idx, gather.cnt, gather.list_strides(), gather.head_div
    elif tiles is not None:
        idx, cnt = tiles.fwd_idx, tiles.fwd_cnt
        lst = tiles.fwd_strides()
        list_hdiv = tiles.head_div
    else:
        idx = cnt = q  # never read
        lst = (0, 0, 0, 0, 0, 0)
        list_hdiv = 1

    # A per-key mask's partial tiles are masked from the bits the planner wrote beside the
    # list (one word a tile) rather than from the mask row, a predicated load every step.
    mask_bits = tiles.fwd_bits if tiles is not None and mask is not None else None
    cut = tiles.fwd_cut if mask_bits is not None else None
    if gather is not None:
        mask_arg, ms = gather.gbits, gather.mask_strides(H)
    else:
        mask_arg = mask.view(torch.uint8) if mask is not None else q
        ms = broadcast_strides(mask, H)
    bias_gathered = gather is not None and gather.gbias is not None
    if bias_gathered:
        bias_arg, bs = gather.gbias, gather.bias_strides(H)
    else:
        bias_arg = bias if bias is not None else q
        bs = broadcast_strides(bias, H)
    n_k_tiles = cdiv(Lk, block_n)
    grid = (cdiv(Lq, block_m), B * H)
    has_softcap = softcap > 0.0

    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)

    def kernel_args(cnt, lst):
        return (
            q, k, v, out, lse, mask_arg, bias_arg, idx, cnt,
            mask_bits if mask_bits is not None else q, cut if cut is not None else q, q, q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            *ms, *bs, *lst, list_hdiv, *(tiles.cut_strides() if cut is not None else (0, 0, 0)),
            H, H // Hkv, Lq, Lk, n_k_tiles, 0,
            softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
            seqlen_bucket(Lq), seqlen_bucket(Lk), *drop_args,
        )

    args = kernel_args(cnt, lst)
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        MASK_QB=mask is not None and mask.size(2) == 1,
        MASK_KB=mask is not None and mask.size(3) == 1,
        HAS_BIAS=bias is not None,
        BIAS_QB=bias is not None and bias.size(2) == 1,
        BIAS_KB=bias is not None and bias.size(3) == 1,
        IS_CAUSAL=bool(is_causal), USE_LIST=use_list, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), GATHER=gather is not None, VARLEN=False,
        MASK_PAD=mask_pad and gather is None, BIAS_PAD=bias_pad or bias_gathered,
        BIAS_GATHERED=bias_gathered,
        MASK_BITS=int(mask_bits is not None), DROPOUT=dropout,
    )
    if cut is not None and plain is None:  # prebuilt lists
        plain = plan_plain_rows(None, device, grid[0] * grid[1])
    if cut is not None and plain.split():
        _launch_plain_rows(grid, args, meta, q.device,
                           kernel_args(cut[..., 1:], tiles.plain_strides()))
    else:
        forward_kernel.launch_fwd(grid, args, meta)
    if not keep_plan:
        return out, lse
    bwd = bwd_blocks(D)
    # The dQ kernel plans the same gather as this forward when it has the same block shape
    # and policy: hand over this one (None included: "tile lists").
    reuse = (planned_here and bwd[1] == (block_m, block_n)
             and gather_policy("dq") == gather_policy("forward"))
    # The plan keeps its gbits (1/8 of the mask's bytes at the listed keys): memory well spent,
    # since rebuilding them in the backward costs a few percent of a training step.
    plan = plan_backward(mask, bias_in, Lq, Lk, H, is_causal, bwd, device, summary=summary,
                         fwd_gather=gather if reuse else NOT_PLANNED)
    return out, lse, plan


def _launch_plain_rows(grid, args, meta, device: torch.device, plain_args) -> None:
    """The two-kernel forward of a per-key mask (see :mod:`flash_dmattn.planning.plain_rows`):
    every row without the mask, on counts that give the rows the mask cuts no tile
    (``plain_args``: the arguments with those counts), then a net of about one wave that runs
    the cut rows again, with the mask's bits, over what the first kernel stored for them."""
    forward_kernel.launch_fwd(grid, plain_args, dict(meta, HAS_MASK=False, MASK_BITS=0))
    n_q, n_bh = grid
    if interpret_mode():
        programs, chunk = 2, 2  # small, so the interpreter walks several chunks per program
    else:
        programs, chunk = cdiv(sm_count(device), n_bh), 64
    net_grid = (max(1, min(n_q, programs)), n_bh)
    # Not autotuned: timing a launch that usually has nothing to do would pick at random.
    forward_kernel.launch_fwd_untuned(net_grid, args, dict(meta, CUT_ROWS=True, NET_CHUNK=chunk))
