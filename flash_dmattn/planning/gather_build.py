"""Host side of the gather plan's kernels (:mod:`.gather_kernels`): the tensors of a
:class:`~.gather.KeyGather` allocated and filled on the mask's device, one launch each.

Each builder that runs after the count takes the plan's ``totals`` and leaves its output
unwritten when they chose tile skipping (:func:`.gather_verdicts.prefers_tiles`). Their
plain-PyTorch twins are in :mod:`.gather_reference`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..block_map import block_reduce
from ..intmath import cdiv
from ..triton_launch import launch
from .gather_kernels import (
    _compact_keys_kernel,
    _gather_bias_kernel,
    _gather_key_bits_kernel,
    _gather_mask_bits_kernel,
)
from .gather_verdicts import GATHER_MAX_RATIO
from .mask_summary import MaskSummary


# gbias rows are padded to a multiple of every BLOCK_N the gathered kernels use, so a tile
# never reads past its row.
GATHER_ROW_ALIGN = 64


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The plan's partly written outputs (tests replace it to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def tile_union(mask: torch.Tensor, summary: Optional[MaskSummary],
               block_m: int) -> Tuple[torch.Tensor, int]:
    """``(union_u8, rows_per_tile)``: contiguous uint8 ``(Bx, Hx, nR, Lk)`` live-key flags of
    row blocks, ``rows_per_tile`` of which make a query tile (their OR is its union; not cut
    at the causal limit). A summary's ``row_any`` serves when its row block divides
    ``block_m``; otherwise the mask is reduced here."""
    if summary is not None and block_m % summary.row_block == 0:
        return summary.row_any.contiguous().view(torch.uint8), block_m // summary.row_block
    return block_reduce(mask, 2, block_m, "any").contiguous().view(torch.uint8), 1


def bias_per_key(bias: Optional[torch.Tensor], seqlen_k: int) -> bool:
    """Whether ``bias`` has one value per key (``(Bb, Hb, 1, Lk)``): the plan gathers it too."""
    return bias is not None and bias.size(2) == 1 and bias.size(3) == seqlen_k and seqlen_k > 1


def gather_bias(bias: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor, seqlen_k: int,
                totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A per-key bias ``(Bb, Hb, 1, Lk)`` gathered to each query tile's key list:
    ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]`` at ``(max(Bb, Bm), max(Hb, Hm))``
    (each head count divides the larger one). Written for ``c`` below the tile's count rounded
    up to GATHER_ROW_ALIGN (0 past the count), which is all the kernels read: rows are padded
    so they read aligned vectors, software-pipelined like the gathered mask; reading the bias
    at the gathered keys themselves was a synchronous load every step, a large share of the
    gathered forward. ``totals``: skip the work when :func:`.gather_verdicts.prefers_tiles`.
    """
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, width = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    width = cdiv(width, GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    out = _empty((bg, hg, n_q, width), bias.dtype, bias.device)

    def bstride(t, d):  # broadcast dims read through stride 0
        return 0 if t.size(d) == 1 else t.stride(d)

    num, den = GATHER_MAX_RATIO
    launch(_gather_bias_kernel, (n_q, bg * hg),
           (bias, idx, cnt, out, totals if totals is not None else cnt,
            bstride(bias, 0), bstride(bias, 1), bias.stride(3),
            bstride(idx, 0), bstride(idx, 1), idx.stride(2), bstride(cnt, 0), bstride(cnt, 1),
            hg, hg // hm, hg // hb, width, n_q),
           dict(BLOCK_C=32 if bias.device.type == "cpu" else 256, ALIGN=GATHER_ROW_ALIGN,
                CHECK_TOTALS=totals is not None, RATIO_NUM=num, RATIO_DEN=den, num_warps=4))
    return out


def compact_keys(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int, seqlen_k: int,
                 is_causal: bool, block_m: int, block_n: int,
                 count_tiles: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(idx, cnt, totals)`` of each query tile's union (see :func:`tile_union`), cut at
    the tile's causal limit when ``is_causal``; one Triton kernel. ``idx`` is ``Lk`` wide
    (the largest causal limit) and written up to ``cnt``. ``totals`` (with ``count_tiles``):
    int32 ``[live block_n-key tiles, gathered tiles]`` summed over every tile. Equivalent
    plain PyTorch: :func:`.gather_reference.compact_keys_reference`."""
    bx, hx, n_rows, _ = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    device = union_u8.device
    idx = _empty((bx, hx, n_q, seqlen_k), torch.int32, device)
    cnt = torch.empty((bx, hx, n_q), dtype=torch.int32, device=device)
    totals = torch.zeros(2, dtype=torch.int32, device=device) if count_tiles else None
    chunk = 32 if device.type == "cpu" else 1024  # short chunks on the interpreter: tests cover several
    launch(_compact_keys_kernel, (n_q, bx * hx),
           (union_u8, idx, cnt, totals if count_tiles else cnt,
            seqlen_q, seqlen_k, n_rows, n_q),
           dict(IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, ROWS_PER_TILE=rows_per_tile,
                BLOCK_N=block_n, BLOCK_K=max(chunk, block_n), COUNT_TILES=count_tiles,
                num_warps=4))
    return idx, cnt, totals


def gather_mask_bits(mask_u8: torch.Tensor, union_u8: torch.Tensor, rows_per_tile: int,
                     seqlen_q: int, block_m: int, is_causal: bool,
                     totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gbits`` (see :mod:`.gather`) from the unions (see :func:`tile_union`), the lists'
    definition: ``ceil(Lk / 64)`` words a row, written up to the tile's count (the kernels
    read no further; rows past ``Lq`` are 0). ``totals``: skip the work when
    :func:`.gather_verdicts.prefers_tiles`. Equivalent plain PyTorch:
    :func:`.gather_reference.gather_mask_bits_reference`."""
    bx, hx, n_rows, seqlen_k = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    on_cpu = mask_u8.device.type == "cpu"
    words = max(cdiv(seqlen_k, 64), 1)
    gbits = _empty((bx, hx, n_q * block_m, words), torch.int64, mask_u8.device)
    # Walks the mask rows in order, 256 keys a step, reading them whole (coalesced) and
    # compressing each row's bits at the union's keys into a running word: walking the output
    # instead, reading the mask byte by byte at the listed keys, is issue-bound on scattered
    # byte loads. 64 rows per program measured a little faster than 32.
    block_r = min(block_m, 8 if on_cpu else 64)
    num, den = GATHER_MAX_RATIO
    launch(_gather_mask_bits_kernel, (n_q * (block_m // block_r), bx * hx),
           (mask_u8, union_u8, gbits, totals if totals is not None else gbits,
            mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2), mask_u8.stride(3),
            hx, seqlen_q, seqlen_k, n_rows, n_q, words),
           dict(IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, BLOCK_R=block_r,
                ROWS_PER_TILE=rows_per_tile, CHECK_TOTALS=totals is not None,
                RATIO_NUM=num, RATIO_DEN=den, num_warps=4, num_stages=3))
    return gbits


def gather_key_bits(key_bits: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                    seqlen_q: int, block_m: int,
                    totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gbits`` (see :mod:`.gather`) from a summary's key bits (``MaskSummary.key_bits``, which
    already hold the causal limit) and the compacted lists: for each 64 rows and 64 listed
    keys, the keys' words are loaded (512 bytes, where the mask rows were 4 KB) and turned
    into the rows' words, a 64 x 64 bit transpose. Written up to each tile's count;
    ``block_m`` a multiple of 64. ``totals``: skip the work when
    :func:`.gather_verdicts.prefers_tiles`. Equivalent plain PyTorch: :func:`.gather_reference.gather_key_bits_reference`."""
    bx, hx, n_q, width = idx.shape
    n_bit_rows = key_bits.size(2)
    words = max(cdiv(width, 64), 1)
    gbits = _empty((bx, hx, n_q * block_m, words), torch.int64, idx.device)
    # Four words a program: 32 contiguous bytes of each row's output, and every load of a
    # program in flight at once (no loop whose steps wait on each other's loads).
    chunks = 4
    num, den = GATHER_MAX_RATIO
    launch(_gather_key_bits_kernel, (n_q * (block_m // 64), cdiv(words, chunks), bx * hx),
           (key_bits, idx, cnt, gbits, totals if totals is not None else cnt,
            key_bits.stride(0) if key_bits.size(0) > 1 else 0,
            key_bits.stride(1) if key_bits.size(1) > 1 else 0, key_bits.stride(2),
            hx, n_bit_rows, n_q, words, width),
           dict(BLOCK_M=block_m, CHUNKS=chunks, CHECK_TOTALS=totals is not None,
                RATIO_NUM=num, RATIO_DEN=den, num_warps=4))
    return gbits
