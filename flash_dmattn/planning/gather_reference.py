"""Plain-PyTorch twins of the gather plan's builders (:mod:`.gather_build`): the same tensors
from torch ops, with every entry past a tile's count zero. Tests compare the kernels with them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..block_map import block_reduce
from ..intmath import cdiv
from .gather_build import GATHER_ROW_ALIGN


def pack_bits_reference(flags: torch.Tensor) -> torch.Tensor:
    """``(..., C)`` flags as ``(..., ceil(C / 64))`` int64 words, bit ``c % 64`` of word
    ``c // 64`` set where ``flags[..., c]`` is non-zero (the layout of ``gbits``)."""
    c = flags.size(-1)
    words = max(cdiv(c, 64), 1)
    padded = torch.zeros((*flags.shape[:-1], words * 64), dtype=torch.int64, device=flags.device)
    padded[..., :c] = (flags != 0).to(torch.int64)
    shifts = torch.arange(64, device=flags.device, dtype=torch.int64)
    # Distinct bits: their sum is their OR (bit 63 wraps to the sign bit, as in the kernel).
    return (padded.view(*flags.shape[:-1], words, 64) << shifts).sum(-1)


def tile_union_reference(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int,
                         seqlen_k: int, is_causal: bool, block_m: int) -> torch.Tensor:
    """Bool ``(Bx, Hx, nQ, Lk)``: each query tile's live keys, the OR of its union rows cut
    at its causal limit (what :func:`.gather_build.compact_keys` lists)."""
    bx, hx, n_rows, _ = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    rows = torch.zeros((bx, hx, n_q * rows_per_tile, seqlen_k), dtype=torch.bool,
                       device=union_u8.device)
    rows[:, :, :n_rows] = union_u8 != 0
    union = rows.view(bx, hx, n_q, rows_per_tile, seqlen_k).any(3)
    if is_causal:
        q_last = torch.clamp(torch.arange(n_q, device=union.device) * block_m + block_m,
                             max=seqlen_q) - 1
        keys = torch.arange(seqlen_k, device=union.device)
        union = union & (keys[None, :] <= (q_last + (seqlen_k - seqlen_q))[:, None])
    return union


def compact_keys_reference(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int,
                           seqlen_k: int, is_causal: bool, block_m: int, block_n: int,
                           count_tiles: bool):
    """Plain PyTorch :func:`.gather_build.compact_keys` (``idx`` zero past the counts)."""
    union = tile_union_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                 block_m)
    cnt = union.sum(-1, dtype=torch.int32)
    ar = torch.arange(seqlen_k, device=union.device, dtype=torch.int32)
    order = torch.sort((~union).to(torch.int32) * seqlen_k + ar, dim=-1).values % seqlen_k
    idx = torch.where(ar < cnt[..., None], order, 0).to(torch.int32).contiguous()
    totals = None
    if count_tiles:
        live = block_reduce(union, 3, block_n, "any").sum()
        gathered = torch.div(cnt + (block_n - 1), block_n, rounding_mode="floor").sum()
        totals = torch.stack([live, gathered]).to(torch.int32)
    return idx, cnt, totals


def gather_mask_bits_reference(mask_u8: torch.Tensor, union_u8: torch.Tensor,
                               rows_per_tile: int, seqlen_q: int, block_m: int,
                               is_causal: bool,
                               totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain PyTorch :func:`.gather_build.gather_mask_bits` (0 past the counts; ``totals``
    is ignored: the bits are always built)."""
    bx, hx, _, seqlen_k = union_u8.shape
    union = tile_union_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                 block_m)
    n_q = union.size(2)
    idx, cnt, _ = compact_keys_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k,
                                         is_causal, block_m, 64, False)
    idx = idx.long()
    pos = torch.arange(seqlen_k, device=union_u8.device)
    rows = torch.zeros((bx, hx, n_q, block_m, seqlen_k), dtype=torch.uint8,
                       device=union_u8.device)
    for m in range(n_q):
        r0, r1 = m * block_m, min(m * block_m + block_m, seqlen_q)
        src = mask_u8[:, :, r0:r1].expand(bx, hx, r1 - r0, seqlen_k)
        keys = idx[:, :, m, None, :].expand(bx, hx, r1 - r0, seqlen_k)
        got = torch.gather(src, -1, keys)
        keep = pos < cnt[:, :, m, None, None]
        if is_causal:
            row = torch.arange(r0, r1, device=keys.device)
            keep = keep & (keys <= (row + (seqlen_k - seqlen_q))[:, None])
        rows[:, :, m, :r1 - r0] = torch.where(keep, got, 0)
    return pack_bits_reference(rows.view(bx, hx, n_q * block_m, seqlen_k))


def gather_key_bits_reference(key_bits: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                              seqlen_q: int, block_m: int,
                              totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain PyTorch :func:`.gather_build.gather_key_bits` (0 past the counts; ``totals``
    ignored)."""
    bx, hx, n_q, width = idx.shape
    n_bit_rows = key_bits.size(2)
    live = torch.arange(width, device=idx.device) < cnt[..., None]
    keys = torch.where(live, idx, 0).long()
    rows = torch.zeros((bx, hx, n_q * block_m, width), dtype=torch.uint8, device=idx.device)
    for i in range(min(n_q * block_m, n_bit_rows * 64)):
        m, w, bit = i // block_m, i // 64, i % 64
        words = torch.gather(key_bits[:, :, w].expand(bx, hx, -1), -1, keys[:, :, m])
        rows[:, :, i] = torch.where(live[:, :, m], (words >> bit) & 1, 0).to(torch.uint8)
    return pack_bits_reference(rows)


def gather_bias_reference(bias: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                          seqlen_k: int, totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain PyTorch :func:`.gather_build.gather_bias` (0 past the counts; ``totals`` is
    ignored)."""
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, width = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    padded = cdiv(width, GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    rows = bias[:, :, 0, :].expand(bg, hb, seqlen_k).repeat_interleave(hg // hb, dim=1)
    live = torch.arange(width, device=idx.device) < cnt[..., None]
    keys = torch.where(live, idx, 0).expand(bg, hm, n_q, width).repeat_interleave(hg // hm, dim=1)
    out = torch.zeros((bg, hg, n_q, padded), dtype=bias.dtype, device=bias.device)
    picked = torch.gather(rows, -1, keys.reshape(bg, hg, n_q * width).long()).view(bg, hg, n_q, width)
    live = live.expand(bg, hm, n_q, width).repeat_interleave(hg // hm, dim=1)
    out[..., :width] = torch.where(live, picked, torch.zeros((), dtype=bias.dtype, device=bias.device))
    return out
