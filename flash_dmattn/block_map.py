"""Tile classification: which (query tile, key tile) pairs are dead, full or partial.

Built from the compact (broadcast) mask without expanding it: a per-key mask ``(…, 1, Lk)``
yields one row of tiles shared by every query tile. The result is a block map of at most
``(B, H, nQ, nK)`` booleans (docs/contract.md §5 allows block maps), usually far smaller.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def block_reduce(t: Tensor, dim: int, block: int, op: str) -> Tensor:
    """``any`` / ``all`` over consecutive blocks of ``block`` along ``dim`` (last may be short).

    Boolean reductions read the mask as it is: a counting ``sum(dtype=int32)`` would first make
    an int32 copy of the whole mask (1 GiB for a (1, 4, 8192, 8192) mask). ``narrow`` +
    ``unflatten`` of one dim is always a view, so any strides (including the stride-0 views
    users pass for broadcast masks) are read in place.
    """
    reduce = torch.any if op == "any" else torch.all
    length = t.size(dim)
    n_full = length // block
    rem = length - n_full * block
    parts = []
    if n_full:
        main = t.narrow(dim, 0, n_full * block).unflatten(dim, (n_full, block))
        parts.append(reduce(main, dim + 1))
    if rem:
        parts.append(reduce(t.narrow(dim, n_full * block, rem), dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


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
    neither is partial. The mask is read twice (an ``any`` and an ``all`` pass, no copies);
    its broadcast dims stay size 1, so a per-key mask gives one row of tiles. Equivalent plain PyTorch (materialising,
    which this does not)::

        vis = mask.expand(B, H, Lq, Lk) & causal          # padded to whole tiles with False
        live = vis.unflatten(2, (nQ, bq)).unflatten(4, (nK, bk)).any((3, 5))
    """
    device = mask.device if mask is not None else device
    if mask is not None:
        bx, hx, qx, kx = mask.shape
        live, full = mask, mask
        if qx > 1:
            # Rows first: the (Bx, Hx, nQ, Lk) intermediates are block_q times smaller.
            live = block_reduce(live, 2, block_q, "any")
            full = block_reduce(full, 2, block_q, "all")
        if kx > 1:
            live = block_reduce(live, 3, block_k, "any")
            full = block_reduce(full, 3, block_k, "all")
    else:
        live = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        full = live
    if is_causal:
        c_any, c_all = causal_tiles(seqlen_q, seqlen_k, block_q, block_k, device)
        live = live & c_any
        full = full & c_all
    return live, full
