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


def _block_count(t: Tensor, dim: int, block: int) -> Tensor:
    """Count True (or sum) over consecutive blocks of ``block`` along ``dim`` (last may be short).

    ``narrow`` + ``unflatten`` of one dim is always a view, so any strides (including the
    stride-0 views users pass for broadcast masks) are read in place without a copy.
    """
    length = t.size(dim)
    n_full = length // block
    rem = length - n_full * block
    parts = []
    if n_full:
        main = t.narrow(dim, 0, n_full * block).unflatten(dim, (n_full, block))
        parts.append(main.sum(dim + 1, dtype=torch.int32))
    if rem:
        parts.append(t.narrow(dim, n_full * block, rem).sum(dim, keepdim=True, dtype=torch.int32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _tile_extent(total: int, block: int, n_tiles: int, device) -> Tensor:
    starts = torch.arange(n_tiles, device=device, dtype=torch.int64) * block
    return torch.clamp(total - starts, max=block)


def causal_tiles(
    seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, device
) -> Tuple[Tensor, Tensor]:
    """``(any_visible, all_visible)`` of shape ``(nQ, nK)`` for bottom-right causal masking."""
    offset = seqlen_k - seqlen_q  # key j is visible to query i iff j <= i + offset
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
    device=None,
) -> Tuple[Tensor, Tensor]:
    """``(live, full)`` tile maps, 4-D ``(Bm, Hm, nQ|1, nK|1)``, broadcastable to ``(B, H, nQ, nK)``.

    ``live``: some element of the tile may be visible (dead tiles can be skipped entirely).
    ``full``: every in-range element is visible (no per-element mask needed). A tile that is
    neither is partial. The mask is read once (one count per tile); its broadcast dims stay
    size 1, so a per-key mask gives one row of tiles. Equivalent plain PyTorch (materialising,
    which this does not)::

        vis = mask.expand(B, H, Lq, Lk) & causal          # padded to whole tiles with False
        live = vis.unflatten(2, (nQ, bq)).unflatten(4, (nK, bk)).any((3, 5))
    """
    device = mask.device if mask is not None else device
    if mask is not None:
        bx, hx, qx, kx = mask.shape
        count = _block_count(mask, 3, block_k) if kx > 1 else mask.to(torch.int32)
        if qx > 1:
            count = _block_count(count, 2, block_q)
        one = torch.ones(1, device=device, dtype=torch.int64)
        rows = _tile_extent(qx, block_q, count.size(2), device) if qx > 1 else one
        cols = _tile_extent(kx, block_k, count.size(3), device) if kx > 1 else one
        live = count > 0
        full = count == rows[:, None] * cols[None, :]
    else:
        live = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        full = live
    if is_causal:
        c_any, c_all = causal_tiles(seqlen_q, seqlen_k, block_q, block_k, device)
        live = live & c_any
        full = full & c_all
    return live, full
