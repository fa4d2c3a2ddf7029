"""The backward's tile lists and gather plan, and how a forward hands them over.

A training step reads the mask to plan twice: the forward summarises it and plans its key
gather, the backward summarises it again (at its own block shapes), plans the dQ kernel's
gather -- the same plan as the forward's, both use 128 x 64 tiles for head dims up to 128 --
and builds the dK/dV kernel's lists. On a per-query top-k mask that second round is a
noticeable part of the step, mostly small launches and one host sync with the GPU idle.

:func:`plan_backward` is that planning, used by the backward when nothing was handed over;
a forward that knows a backward will follow (the eager autograd path of
:class:`flash_dmattn.ops.AttentionOp`) calls it right after launching its own kernel -- the
host work then overlaps the forward kernel -- and keeps the result as a
:class:`BackwardPlan` (small: lists, a summary of the mask, about 1/64 of its size, and for a
gathered dQ the mask's bits at the listed keys, at most 1/8 of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .gather import KeyGather, gather_policy, plan_key_gather
from .mask_summary import MaskSummary, summarize_mask, summary_blocks, wants_summary
from .tiles import TileLists, build_tile_lists

# ``fwd_gather`` default: the caller has no dQ gather plan to offer.
NOT_PLANNED = object()


@dataclass(frozen=True)
class BackwardPlan:
    """What :func:`plan_backward` worked out for one call, kept by its forward.

    ``gather`` is the dQ kernel's key gather (None: the dQ kernel walks tile lists);
    ``tiles`` holds the dK/dV lists (and the dQ lists when both kernels share a block shape);
    ``tiles_q`` the dQ lists otherwise. ``policy`` is the dQ gather policy it
    was planned under: a backward run under another one plans again.
    """

    policy: str
    gather: Optional[KeyGather]
    tiles: Optional[TileLists]
    tiles_q: Optional[TileLists]


def plan_backward(
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    num_heads: int,
    is_causal: bool,
    blocks: Tuple[Tuple[int, int], Tuple[int, int]],
    device: torch.device,
    run_dq: bool = True,
    run_dkdv: bool = True,
    summary: Optional[MaskSummary] = None,
    fwd_gather=NOT_PLANNED,
) -> BackwardPlan:
    """Tile lists and gather plan of the backward kernels.

    Args:
        mask: the row-aligned mask view the kernels read (``aligned_rows``), or None.
        blocks: ``((BLOCK_M, BLOCK_N) of dK/dV, (BLOCK_M, BLOCK_N) of dQ)`` (``bwd_blocks``).
        device: where the lists go (the query's device).
        run_dq / run_dkdv: which kernels will run (the other's lists are not built).
        summary: a :class:`MaskSummary` of ``mask`` at a granularity dividing every block
            shape (made here when the mask is worth one and none is given).
        fwd_gather: the forward's :class:`KeyGather` (or None for "the forward chose tile
            lists") when it was planned for the dQ kernel's block shape under the dQ policy;
            then it is reused instead of planned again.
    """
    (block_m, block_n), (block_m2, block_n2) = blocks
    if summary is None and wants_summary(mask, seqlen_q, seqlen_k):
        # A per-query mask is read once (one kernel) for the dK/dV lists, the dQ lists and
        # the dQ gather plan; torch reductions would read it once per question.
        summary = summarize_mask(mask, *summary_blocks((block_m, block_n), (block_m2, block_n2)),
                                 causal=is_causal)
    if not run_dq:
        gather = None
    elif fwd_gather is not NOT_PLANNED:
        gather = fwd_gather
    else:
        # dQ is query-major like the forward: it can walk gathered key lists. (dK/dV cannot:
        # the union of a key tile's live queries is wide whenever one of its keys is popular.)
        gather = plan_key_gather(mask, bias, seqlen_q, seqlen_k, num_heads, is_causal, block_m2,
                                 block_n2, kernel="dq", summary=summary, lagged=True)
    same_blocks = (block_m, block_n) == (block_m2, block_n2) and gather is None
    tiles = None
    if run_dkdv or same_blocks:
        tiles = build_tile_lists(mask, seqlen_q, seqlen_k, num_heads, is_causal, block_m,
                                 block_n, device, need_fwd=run_dq and same_blocks,
                                 need_bwd=run_dkdv, summary=summary)
    if same_blocks:
        tiles_q = tiles
    elif run_dq and gather is None:
        tiles_q = build_tile_lists(mask, seqlen_q, seqlen_k, num_heads, is_causal, block_m2,
                                   block_n2, device, need_fwd=True, need_bwd=False,
                                   summary=summary)
    else:
        tiles_q = None
    return BackwardPlan(policy=gather_policy("dq"), gather=gather, tiles=tiles, tiles_q=tiles_q)
