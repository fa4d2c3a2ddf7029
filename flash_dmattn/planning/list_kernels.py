"""Triton kernels of the planner: writing the per-tile key lists of key-interval masks.

The planner's plain-PyTorch path builds the lists with a sort of every (key, tile) pair; a
kernel that lets each query tile scan its row's live keys writes them in position order
directly, without the sort and its (key, tile)-sized temporaries.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the planner then uses its plain-PyTorch twins
    triton = None

SCAN_BLOCK = 512


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def available(device: torch.device) -> bool:
    """Whether the list kernels run for tensors on ``device``."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


if triton is not None:

    @triton.jit
    def _upper_bound(seq, n, value):
        """How many of the first ``n`` (ascending) entries of ``seq`` are ``<= value``."""
        lo = n * 0
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            below = tl.load(seq + mid) <= value
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        return lo

    @triton.jit
    def _fill_kernel(CIdx, CLo, CHi, NLive, TileStart, Keys, Lq, pos_off, n_tiles, Lk,
                     BLOCK_M: tl.constexpr, SCAN: tl.constexpr, CAUSAL: tl.constexpr):
        m = tl.program_id(0)
        r = tl.program_id(1)
        q0 = m * BLOCK_M
        q1 = tl.minimum(q0 + BLOCK_M, Lq)
        n = tl.load(NLive + r)
        row_idx = CIdx + r * Lk
        if CAUSAL:
            # Keys after the tile's last query position are hidden from the whole tile.
            n = _upper_bound(row_idx, n, q1 - 1 - pos_off)
        out = Keys + tl.load(TileStart + r * n_tiles + m)
        count = 0
        for c0 in range(0, n, SCAN):
            offs = c0 + tl.arange(0, SCAN)
            ok = offs < n
            lo = tl.load(CLo + r * Lk + offs, mask=ok, other=0)
            hi = tl.load(CHi + r * Lk + offs, mask=ok, other=0)
            meets = ok & (lo < q1) & (hi > q0)
            at = tl.cumsum(meets.to(tl.int32), 0) - 1
            idx = tl.load(row_idx + offs, mask=ok, other=0)
            tl.store(out + count + at, idx, mask=meets)
            count += tl.sum(meets.to(tl.int32), 0)


def fill_tile_lists(c_idx, c_lo, c_hi, n_live, tile_start, keys, seqlen_q, pos_off, block_m,
                    is_causal):
    """Write each (tile, row) list at ``keys[tile_start[row, tile]:]``.

    ``c_idx``/``c_lo``/``c_hi`` ``(R, Lk)`` int32: each row's live keys in position order
    (their index and query range), the first ``n_live[row]`` entries valid and the rest
    holding ``Lk`` (so the index column stays sorted). ``pos_off = Lq - Lk`` maps a key
    position to the query index at the same position.
    """
    rows, lk = c_idx.shape
    n_tiles = tile_start.shape[1]
    if keys.numel() == 0:
        return
    _fill_kernel[(n_tiles, rows)](
        c_idx, c_lo, c_hi, n_live, tile_start, keys, seqlen_q, pos_off, n_tiles, lk,
        BLOCK_M=block_m, SCAN=SCAN_BLOCK, CAUSAL=bool(is_causal), num_warps=4,
    )
