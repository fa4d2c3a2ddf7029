"""Tile classification: which (query tile, key tile) pairs are dead, full or partial.

Built from the compact (broadcast) mask without expanding it: a per-key mask ``(…, 1, Lk)``
yields one row of tiles shared by every query tile. The result is a block map of at most
``(B, H, nQ, nK)`` booleans (SPEC §5 allows block maps), usually far smaller.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_reduce(x: Tensor, dim: int, block: int, reduce_all: bool) -> Tensor:
    """Reduce ``x`` along ``dim`` in consecutive blocks (the last may be short).

    A size-1 (broadcast) dim stays size 1: the same value holds for every tile.
    """
    n = x.shape[dim]
    if n == 1:
        return x
    op = torch.all if reduce_all else torch.any
    whole = (n // block) * block
    parts = []
    if whole:
        parts.append(op(x.narrow(dim, 0, whole).unflatten(dim, (whole // block, block)), dim=dim + 1))
    if n > whole:
        parts.append(op(x.narrow(dim, whole, n - whole), dim=dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def causal_tiles(
    seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, device
) -> Tuple[Tensor, Tensor]:
    """``(any_visible, all_visible)`` of shape ``(nQ, nK)`` for bottom-right causal masking."""
    offset = seqlen_k - seqlen_q
    q_start = torch.arange(0, seqlen_q, block_q, device=device)
    q_last = torch.clamp(q_start + block_q, max=seqlen_q) - 1
    k_start = torch.arange(0, seqlen_k, block_k, device=device)
    k_last = torch.clamp(k_start + block_k, max=seqlen_k) - 1
    any_visible = k_start.unsqueeze(0) <= (q_last + offset).unsqueeze(1)
    all_visible = k_last.unsqueeze(0) <= (q_start + offset).unsqueeze(1)
    return any_visible, all_visible


def tile_liveness(
    mask: Optional[Tensor],
    seqlen_q: int,
    seqlen_k: int,
    block_q: int,
    block_k: int,
    is_causal: bool,
) -> Tuple[Tensor, Tensor]:
    """``(live, full)`` tile maps, 4-D ``(Bm, Hm, nQ|1, nK|1)``, broadcastable to ``(B, H, nQ, nK)``.

    ``live``: some element of the tile may be visible (dead tiles can be skipped entirely).
    ``full``: every in-range element is visible (no per-element mask needed). A tile that is
    neither is partial. Equivalent plain PyTorch (materialising, which this does not)::

        vis = mask.expand(B, H, Lq, Lk) & causal          # padded to whole tiles with False
        live = vis.unflatten(2, (nQ, bq)).unflatten(4, (nK, bk)).any((3, 5))
    """
    if mask is None:
        live = torch.ones(1, 1, 1, 1, dtype=torch.bool)
        full = live
        device = None
    else:
        device = mask.device
        live = _block_reduce(_block_reduce(mask, 3, block_k, False), 2, block_q, False)
        full = _block_reduce(_block_reduce(mask, 3, block_k, True), 2, block_q, True)
    if is_causal:
        c_any, c_all = causal_tiles(seqlen_q, seqlen_k, block_q, block_k, device)
        live = live.to(c_any.device) & c_any
        full = full.to(c_all.device) & c_all
    return live, full
