"""Tile classification and compact live-tile lists for the Triton kernels.

A (query tile, key tile) pair of one attention call is

* dead    -- no visible element: the boolean mask is all False there, or causally invisible;
* full    -- every in-bounds element visible: the kernel needs no per-element mask;
* partial -- anything else: the kernel loads the mask tile and/or applies the causal compare.

The classification is computed on the mask's device with a handful of torch reductions, once
per call and block shape, and never materialises anything of size (B, H, Lq, Lk): the block map
is at most (Bx, Hx, nQ, nK) with the mask's own broadcast dims kept at size 1 (causal forces the
query-tile dim to nQ because the diagonal depends on it).

The kernels then walk compact lists instead of the map, so a call whose mask leaves 5% of the
tiles alive does ~5% of the work:

* forward lists, per (b, h, query tile): the live key tiles in ascending order;
* backward lists, per (b, h, key tile): the live query tiles in ascending order.

Each list entry is ``tile_index * 2 + partial`` (int32); only the first ``count`` entries of a
row are meaningful. Dims of size 1 (batch, head, and for forward lists the query-tile dim) are
broadcast by the kernels through stride 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class TileLists:
    """Live-tile lists for one block shape.

    ``fwd_idx`` is ``(Bm, Hm, nQm, nK)`` and ``fwd_cnt`` ``(Bm, Hm, nQm)``: for query tile ``m``
    of batch ``b`` and query head ``h`` the row is ``[b or 0, h // head_div, m or 0]``.
    ``bwd_idx`` is ``(Bm, Hm, nK, nQ)`` and ``bwd_cnt`` ``(Bm, Hm, nK)`` (per key tile).
    Either pair may be None when not requested.
    """

    block_m: int
    block_n: int
    num_q_tiles: int
    num_k_tiles: int
    head_div: int
    fwd_idx: Optional[torch.Tensor]
    fwd_cnt: Optional[torch.Tensor]
    bwd_idx: Optional[torch.Tensor]
    bwd_cnt: Optional[torch.Tensor]

    def fwd_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_m, cnt_b, cnt_h, cnt_m) with 0 for broadcast dims."""
        return _row_strides(self.fwd_idx, self.fwd_cnt)

    def bwd_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_n, cnt_b, cnt_h, cnt_n) with 0 for broadcast dims."""
        return _row_strides(self.bwd_idx, self.bwd_cnt)


def _row_strides(idx: torch.Tensor, cnt: torch.Tensor):
    def s(t, d):
        # A size-1 dim is indexed with a possibly larger program index: stride 0 keeps it at 0.
        return 0 if t.size(d) == 1 else t.stride(d)

    return (s(idx, 0), s(idx, 1), s(idx, 2), s(cnt, 0), s(cnt, 1), s(cnt, 2))


def _block_sum(t: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """Sum ``t`` over consecutive blocks of ``block`` along ``dim`` (last block may be short).

    narrow + unflatten of a single dim is always a view, so arbitrary strides (including the
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


def _tile_extent(total: int, block: int, n_tiles: int, device) -> torch.Tensor:
    starts = torch.arange(n_tiles, device=device, dtype=torch.int64) * block
    return torch.clamp(total - starts, max=block)


def classify_tiles(
    mask: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    device: torch.device,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(live, full)`` bool block maps of shape ``(Bm, Hm, nQm, nKm)``.

    ``Bm, Hm`` are the mask's batch/head sizes (1, 1 without a mask); ``nQm`` is 1 when the mask
    is per-key and the call is not causal, else ``cdiv(Lq, block_m)``; ``nKm`` is 1 for a
    per-query mask without causal, else ``cdiv(Lk, block_n)``. Out-of-bounds elements of edge
    tiles are ignored (the kernels bound-check them separately).
    """
    n_q = -(-seqlen_q // block_m)
    n_k = -(-seqlen_k // block_n)
    if mask is not None:
        bx, hx, qx, kx = mask.shape
        cnt = mask
        if kx > 1:
            cnt = _block_sum(cnt, 3, block_n)
        else:
            cnt = cnt.to(torch.int32)
        if qx > 1:
            cnt = _block_sum(cnt, 2, block_m)
        rows = _tile_extent(qx, block_m, cnt.size(2), device) if qx > 1 else torch.ones(1, device=device, dtype=torch.int64)
        cols = _tile_extent(kx, block_n, cnt.size(3), device) if kx > 1 else torch.ones(1, device=device, dtype=torch.int64)
        valid = rows[:, None] * cols[None, :]
        live = cnt > 0
        full = cnt == valid
    else:
        live = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        full = live
    if is_causal:
        i_lo = torch.arange(n_q, device=device, dtype=torch.int64) * block_m
        i_hi = torch.clamp(i_lo + block_m, max=seqlen_q) - 1
        j_lo = torch.arange(n_k, device=device, dtype=torch.int64) * block_n
        j_hi = torch.clamp(j_lo + block_n, max=seqlen_k) - 1
        offset = seqlen_k - seqlen_q  # bottom-right aligned: j <= i + offset
        c_live = j_lo[None, :] <= i_hi[:, None] + offset
        c_full = j_hi[None, :] <= i_lo[:, None] + offset
        live = live & c_live
        full = full & c_full
    return live, full


def _compact(live: torch.Tensor, partial: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last dim: live indices first, ascending, encoded ``index * 2 + partial``."""
    n = live.size(-1)
    ar = torch.arange(n, device=live.device, dtype=torch.int32)
    # Dead tiles sort after every live one; the index breaks ties so live order stays ascending.
    key = (~live).to(torch.int32) * n + ar
    order = torch.sort(key, dim=-1).values % n
    flag = torch.gather(partial.to(torch.int32), -1, order.to(torch.int64))
    idx = (order * 2 + flag).to(torch.int32).contiguous()
    cnt = live.sum(-1, dtype=torch.int32).contiguous()
    return idx, cnt


def build_tile_lists(
    mask: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    num_heads: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    device: torch.device,
    need_fwd: bool = True,
    need_bwd: bool = False,
) -> Optional[TileLists]:
    """Build live-tile lists for ``block_m x block_n`` tiles, or None when every tile is full.

    Returns None without a mask and without causal: kernels then visit every tile densely.
    ``mask`` is the normalised 4-D bool view ``(Bx, Hx, Qx, Kx)``.
    """
    if mask is None and not is_causal:
        return None
    n_q = -(-seqlen_q // block_m)
    n_k = -(-seqlen_k // block_n)
    live, full = classify_tiles(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n, device)
    bm, hm = live.shape[0], live.shape[1]
    head_div = num_heads // hm
    fwd_idx = fwd_cnt = bwd_idx = bwd_cnt = None
    live_k = live.expand(bm, hm, live.size(2), n_k)
    full_k = full.expand(bm, hm, full.size(2), n_k)
    if need_fwd:
        fwd_idx, fwd_cnt = _compact(live_k, live_k & ~full_k)
    if need_bwd:
        live_t = live_k.expand(bm, hm, n_q, n_k).transpose(2, 3)
        full_t = full_k.expand(bm, hm, n_q, n_k).transpose(2, 3)
        bwd_idx, bwd_cnt = _compact(live_t, live_t & ~full_t)
    return TileLists(
        block_m=block_m,
        block_n=block_n,
        num_q_tiles=n_q,
        num_k_tiles=n_k,
        head_div=head_div,
        fwd_idx=fwd_idx,
        fwd_cnt=fwd_cnt,
        bwd_idx=bwd_idx,
        bwd_cnt=bwd_cnt,
    )
