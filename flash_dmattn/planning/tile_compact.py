"""One-launch compaction of live-tile maps into the lists of :mod:`.tiles`.

Equivalent plain PyTorch (:func:`.tiles.compact_reference`), per row of the last dim::

    full = live & ~partial
    idx = cat([nonzero(full) * 2, nonzero(partial) * 2 + 1])   # then zeros
    cnt = (live.sum(), full.sum())
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..triton_launch import launch


def compact_tiles(live: torch.Tensor, partial: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(idx, cnt)`` of 4-D bool maps ``live`` / ``partial`` (same shape, any strides,
    broadcast dims included; ``partial`` implies ``live``): ``idx`` int32 of their shape,
    contiguous, each row the full tiles' indices ``* 2`` ascending, then the partial ones'
    ``* 2 + 1`` ascending, then zeros; ``cnt`` int32 ``(..., 2)`` = (live, full)."""
    bx, hx, rows, n = live.shape
    idx = torch.empty((bx, hx, rows, n), dtype=torch.int32, device=live.device)
    cnt = torch.empty((bx, hx, rows, 2), dtype=torch.int32, device=live.device)
    if idx.numel() == 0:
        cnt.zero_()
        return idx, cnt
    lv, pt = live.view(torch.uint8), partial.view(torch.uint8)
    on_cpu = live.device.type == "cpu"
    launch(_compact_tiles_kernel, (bx * hx * rows,),
           (lv, pt, idx, cnt, hx, rows, n,
            lv.stride(0), lv.stride(1), lv.stride(2), lv.stride(3),
            pt.stride(0), pt.stride(1), pt.stride(2), pt.stride(3)),
           dict(BLOCK=16 if on_cpu else 1024, num_warps=4))
    return idx, cnt


@triton.jit
def _compact_tiles_kernel(
    Live, Partial, Idx, Cnt, n_heads, n_rows, n,
    sl_b, sl_h, sl_r, sl_c, sp_b, sp_h, sp_r, sp_c,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = row % n_rows
    b = row // n_rows // n_heads
    h = row // n_rows % n_heads
    live_row = Live + b * sl_b + h * sl_h + r * sl_r
    part_row = Partial + b * sp_b + h * sp_h + r * sp_r
    idx_row = Idx + row * n
    # Full tiles first, then partial ones, each ascending (the order build_tile_lists promises).
    base = 0
    for want_partial in tl.static_range(2):
        for start in range(0, n, BLOCK):
            c = start + tl.arange(0, BLOCK)
            ok = c < n
            lv = tl.load(live_row + c * sl_c, mask=ok, other=0) != 0
            pt = tl.load(part_row + c * sp_c, mask=ok, other=0) != 0
            if want_partial == 0:
                sel = lv & (pt == 0)
            else:
                sel = lv & pt
            s = sel.to(tl.int32)
            tl.store(idx_row + base + tl.cumsum(s, 0) - 1, c * 2 + want_partial, mask=sel)
            base += tl.sum(s, 0)
        if want_partial == 0:
            n_full = base
    for start in range(base, n, BLOCK):
        c = start + tl.arange(0, BLOCK)
        tl.store(idx_row + c, tl.zeros([BLOCK], dtype=tl.int32), mask=c < n)
    tl.store(Cnt + row * 2, base)
    tl.store(Cnt + row * 2 + 1, n_full)
