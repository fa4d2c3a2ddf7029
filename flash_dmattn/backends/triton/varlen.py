"""Packed sequences (varlen) in the Triton kernels: each sequence's rows and bounds, the key
tiles a query tile visits, the per-key mask's shared key-tile lists (device helpers), and
the host arguments that describe them to a kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...planning.tiles import build_varlen_key_lists


@triton.jit
def _varlen_seq(CuQ, CuK, b):
    """(q_start (int64), seqlen_q, k_start (int64), seqlen_k) of packed sequence ``b``."""
    q0 = tl.load(CuQ + b)
    k0 = tl.load(CuK + b)
    return q0.to(tl.int64), tl.load(CuQ + b + 1) - q0, k0.to(tl.int64), tl.load(CuK + b + 1) - k0


@triton.jit
def _varlen_key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      IS_CAUSAL: tl.constexpr):
    """Key tiles a query tile of one packed sequence visits (0 past the sequence's end).

    Without a mask varlen calls have no tile lists: every key tile up to the causal limit of
    the tile's last row is visited. With a per-key mask this is the limit that
    :func:`_varlen_list_len` applies to the sequence's list.
    """
    n = tl.cdiv(seqlen_k, BLOCK_N)
    if IS_CAUSAL:
        # the last row sees keys < start_m + BLOCK_M + seqlen_k - seqlen_q (bottom-right)
        n = tl.minimum(n, tl.cdiv(tl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0), BLOCK_N))
    return tl.where(start_m < seqlen_q, n, 0)


@triton.jit
def _varlen_need_elem(need_elem, start_m, start_n, seqlen_q, seqlen_k,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Whether a varlen (query tile, key tile) pair needs per-element masking.

    Without tile lists nothing classified the tile: a per-key mask is always applied (one
    vector load), the causal compare only on tiles that cross the diagonal. (The host builds
    lists whenever a varlen call has a mask; see :func:`_varlen_list_need_elem`.)
    """
    if HAS_MASK:
        need_elem = start_n >= 0
    elif IS_CAUSAL:
        need_elem = need_elem | (start_n + BLOCK_N - 1 > start_m + (seqlen_k - seqlen_q))
    return need_elem


@triton.jit
def _list_lower_bound(row, n, tile):
    """How many of the first ``n`` entries of the ascending tile list ``row`` (entries
    ``tile * 2 + partial``) lie below key tile ``tile``: a binary search of ~log2(n) scalar
    loads, so a query tile stops at its causal limit without scanning the list."""
    lo = n * 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        below = (tl.load(row + mid) >> 1) < tile
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _varlen_list_len(row, n, start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Entries of a varlen key-tile list (``n`` live, ascending) that a query tile visits.

    The list is shared by every query tile of the sequence, so the causal limit of this
    tile is applied here; 0 past the sequence's end.
    """
    n_tiles = _varlen_key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    if IS_CAUSAL:
        n = _list_lower_bound(row, n, n_tiles)
    else:
        # Every listed tile lies inside the sequence: only the past-the-end check is left.
        n = tl.where(n_tiles > 0, n, 0)
    return n


@triton.jit
def _query_tile_keys(ListIdx, ListCnt, b, h, pid_m, list_hdiv, stride_lb, stride_lh, stride_lm,
                     stride_cb, stride_ch, stride_cm, n_k_tiles, seqlen_q, seqlen_k,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     USE_LIST: tl.constexpr, VARLEN: tl.constexpr):
    """``(offset, steps)`` of query tile ``pid_m``'s walk over the keys, for the forward and
    the dQ kernels: with ``USE_LIST`` the offset of its row in the key lists (``ListIdx``, and
    the mask bits laid out like them) and that row's length (``ListCnt``), else offset 0 and
    ``n_k_tiles`` key tiles; with ``VARLEN`` cut at the tile's causal limit in its sequence."""
    if USE_LIST:
        lh = h // list_hdiv
        list_off = b * stride_lb + lh * stride_lh + pid_m * stride_lm
        n_iter = tl.load(ListCnt + b * stride_cb + lh * stride_ch + pid_m * stride_cm)
    else:
        list_off = pid_m * 0
        n_iter = n_k_tiles
    if VARLEN:
        if USE_LIST:
            # The (sequence, mask head) row of live key tiles, cut at this tile's causal limit.
            n_iter = _varlen_list_len(ListIdx + list_off, n_iter, pid_m * BLOCK_M, seqlen_q,
                                      seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
        else:
            n_iter = _varlen_key_tiles(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                       IS_CAUSAL)
    return list_off, n_iter


@triton.jit
def _varlen_tile_state(row, n, tile):
    """``(live, partial)`` of key tile ``tile`` in a varlen key-tile list (``n`` live)."""
    pos = _list_lower_bound(row, n, tile)
    entry = tl.load(row + pos, mask=pos < n, other=-1)
    return (entry >> 1) == tile, (entry & 1) != 0


@triton.jit
def _varlen_list_need_elem(partial, start_m, start_n, seqlen_q, seqlen_k,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           IS_CAUSAL: tl.constexpr):
    """Per-element masking of a listed varlen tile: the list's partial flag (mask not all
    True, or a ragged edge), or -- the list being shared across query tiles -- a causal
    diagonal crossing this query tile."""
    need_elem = partial
    if IS_CAUSAL:
        need_elem = need_elem | (start_n + BLOCK_N - 1 > start_m + (seqlen_k - seqlen_q))
    return need_elem



# ------------------------------------------------------------------------------------------
# Host arguments
# ------------------------------------------------------------------------------------------


def varlen_aux_4d(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A varlen per-key mask/bias ``(1|Hkv|H, total_k)`` as the kernels' 4-D view.

    ``(1, Hx, 1, total_k)``: batch 1 and one query row (broadcast), indexed by packed key.
    """
    return None if t is None else t[None, :, None, :]


def varlen_tail_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Bool ``(total,)``: packed rows past ``cu_seqlens[-1]``, which no sequence owns.

    Computed on the device (no host sync); the kernels never visit those rows.
    """
    return torch.arange(total, device=cu_seqlens.device) >= cu_seqlens[-1]


def varlen_list_args(mask: Optional[torch.Tensor], cu_seqlens_k: torch.Tensor,
                     max_seqlen_k: int, num_heads: int, block_n: int, dummy: torch.Tensor):
    """``(idx, cnt, list strides + head_div)`` kernel arguments of a varlen call.

    With a per-key mask: its :class:`~flash_dmattn.planning.tiles.VarlenKeyLists` for
    ``block_n`` key tiles, so
    the kernels skip key tiles with no live key and the mask load on all-live ones. Without
    one: placeholders (``dummy`` is never read) and ``USE_LIST`` must be False.
    """
    if mask is None:
        return dummy, dummy, (0, 0, 0, 0, 0, 0, 1)
    lists = build_varlen_key_lists(mask, cu_seqlens_k, max_seqlen_k, num_heads, block_n)
    return lists.idx, lists.cnt, (*lists.strides(), lists.head_div)

