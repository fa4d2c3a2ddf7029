"""Forward tile lists of a per-key mask, and the mask's bits, in one launch.

A per-key mask ``(Bx, Hx, 1, Lk)`` -- the dynamic-mask case -- gives every query tile the
same row of key tiles, cut at the tile's causal limit. Built from torch reductions and
elementwise ops (:func:`.tiles.build_tile_lists` for other masks) they took about ten small
launches, a visible share of a block-sparse forward on long sequences. This
kernel reads the mask row in two passes per list row and writes the row's list directly, in
the order and encoding of :mod:`.tiles` (full tiles first, then partial ones, each
ascending, entries ``tile * 2 + partial``, zeros after the count).

Beside each entry it writes the tile's ``block_n`` mask bits as one int64 (bit ``i`` = key
``tile * block_n + i`` is live), so the forward kernel masks a partial tile with a scalar
instead of a vector load and layout change in every step (see ``MASK_BITS`` in the triton
backend's forward), and per list row the number of *cut* tiles: live tiles where the mask
hides some in-range key, beside the row's live count for a kernel that runs every row
without the mask (0 where the row has a cut tile). A row with none needs no mask at all --
its partial tiles are partial by causality or a ragged end only -- so the forward can run
such rows in a kernel that never reads the mask (:mod:`.plain_rows`).

Equivalent plain PyTorch (``tile_liveness`` from :mod:`flash_dmattn.block_map`)::

    live, full = tile_liveness(mask, Lq, Lk, block_m, block_n, is_causal)   # (Bx, Hx, nQ|1, nK)
    full[..., -1] &= Lk % block_n == 0               # a ragged last tile is always partial
    idx, cnt = compact_reference(live, live & ~full)
    keys = (idx >> 1)[..., None] * block_n + arange(block_n)
    bits = (mask[..., 0, keys] << arange(block_n)).sum(-1)      # keys past Lk count as 0
    in_range = (Lk - (idx >> 1) * block_n).clamp(max=block_n)
    listed = arange(nK) < cnt[..., :1]
    n_cut = ((mask[..., 0, keys].sum(-1) < in_range) & listed).sum(-1)   # per row
    cut = stack([n_cut, where(n_cut > 0, 0, cnt[..., 0])], -1)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..intmath import cdiv
from ..triton_launch import launch

# Bits of one tile must fit the int64 the kernels load.
MAX_BLOCK_N = 64


def per_key_eligible(mask: torch.Tensor, block_n: int) -> bool:
    """Whether :func:`per_key_lists` serves this mask: one row per (batch, head), key tiles
    narrow enough for their bits to fit one int64."""
    return mask.size(2) == 1 and block_n <= MAX_BLOCK_N


def per_key_lists(
    mask: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    with_bits: bool,
    cut_flag: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx, cnt, bits, cut)`` forward lists of a per-key mask.

    Args:
        mask: bool ``(Bx, Hx, 1, Kx)`` with ``Kx`` = ``seqlen_k`` or 1 (broadcast), any strides.
        is_causal: bottom-right causal; then there is one list row per query tile (``nQ``),
            else one row shared by all of them.
        with_bits: also fill ``bits`` and ``cut`` (else they are 1-element placeholders).
        cut_flag: int32 ``(1,)`` on the mask's device, raised to 1 when the mask cuts a
            listed tile (with ``with_bits``; left as it is otherwise; see :mod:`.plain_rows`).

    Returns:
        ``idx`` int32 ``(Bx, Hx, rows, nK)``, ``cnt`` int32 ``(Bx, Hx, rows, 2)`` (live, full) as
        :func:`.tiles.build_tile_lists` makes them, ``bits`` int64 of ``idx``'s shape: the
        mask bits of the tile each entry names (unspecified past the count), and ``cut``
        int32 ``(Bx, Hx, rows, 2)``: how many listed tiles of the row the mask cuts (some
        key in range hidden), and the row's live count where that is 0, else 0.
    """
    bx, hx = mask.shape[0], mask.shape[1]
    rows = cdiv(seqlen_q, block_m) if is_causal else 1
    n_tiles = cdiv(seqlen_k, block_n)
    device = mask.device
    idx = torch.empty((bx, hx, rows, n_tiles), dtype=torch.int32, device=device)
    cnt = torch.empty((bx, hx, rows, 2), dtype=torch.int32, device=device)
    bits = torch.empty(idx.shape if with_bits else (1,), dtype=torch.int64, device=device)
    cut = torch.empty((bx, hx, rows, 2) if with_bits else (1,), dtype=torch.int32,
                      device=device)
    m = mask.view(torch.uint8)
    stride_k = 0 if mask.size(3) == 1 else m.stride(3)
    stride_b = 0 if bx == 1 else m.stride(0)
    stride_h = 0 if hx == 1 else m.stride(1)
    on_cpu = _interpreted(device)  # the interpreter: small chunks run faster
    words = (stride_k == 1 and seqlen_k % 8 == 0 and m.data_ptr() % 8 == 0
             and stride_b % 8 == 0 and stride_h % 8 == 0 and block_n % 8 == 0)
    if on_cpu:
        chunk = 16
    elif words:
        # 2048 words (256 tiles of 64 keys) over 16 warps: the largest chunk that compiles
        # without spills on sm_90a (4096 spill), and word loads beat byte reads.
        chunk = 2048 * 8 // block_n
    else:
        # Each chunk is one load round trip per pass: 128 tiles of 64 keys per chunk (8 KB of
        # mask) over 16 warps keep a 32K-key row to four per pass without spills (ptxas,
        # sm_90a); smaller chunks over fewer warps take more round trips and are slower.
        chunk = max(16, min(128, 8192 // block_n))
    launch(_per_key_lists_kernel, (bx * hx * rows,),
           (m, idx, cnt, bits, cut, cut_flag if cut_flag is not None else cnt,
            hx, rows, n_tiles, seqlen_q, seqlen_k, stride_b, stride_h, stride_k),
           dict(BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=chunk,
                IS_CAUSAL=bool(is_causal), WITH_BITS=with_bits, WORDS=words,
                WITH_FLAG=with_bits and cut_flag is not None,
                num_warps=4 if on_cpu else 16))
    return idx, cnt, bits, cut


def _interpreted(device: torch.device) -> bool:
    """Whether launches on ``device`` run in the interpreter (CPU tensors). A function so that
    ``tools/compile_check.py`` can capture the GPU's launch shape on a CPU machine."""
    return device.type == "cpu"


@triton.jit
def _tile_states(mask_row, start, n, q_first, offset, seqlen_k, stride_mk,
                 BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 WORDS: tl.constexpr):
    """Tiles ``start + [0, CHUNK)`` of a mask row cut at ``n`` tiles: their indices, mask bits
    (int64, bit ``i`` = key ``i`` of the tile), and which are live, which full and which cut
    (live with a hidden key in range).

    ``WORDS``: the row is read as int64 words of 8 mask bytes (keys contiguous, 8-byte
    aligned, ``seqlen_k % 8 == 0``): an eighth of the loads and registers of a byte read, so
    chunks are larger and a row takes fewer load round trips."""
    t = start + tl.arange(0, CHUNK)
    if WORDS:
        WPT: tl.constexpr = BLOCK_N // 8
        lane = tl.arange(0, WPT)
        word = t[:, None] * WPT + lane[None, :]
        w_ok = (word * 8 < seqlen_k) & (t[:, None] < n)
        w = tl.load(mask_row.to(tl.pointer_type(tl.int64)) + word, mask=w_ok, other=0)
        # Mask bytes are 0 or 1: a multiply sums a word's bytes into its top byte, another
        # gathers their low bits there (bit i from byte i).
        n_on = tl.sum(((w * 0x0101010101010101) >> 56) & 0xFF, 1).to(tl.int32)
        b8 = ((w & 0x0101010101010101) * 0x0102040810204080 >> 56) & 0xFF
        tile_bits = tl.sum(b8 << (lane.to(tl.int64) * 8)[None, :], 1)
    else:
        lane = tl.arange(0, BLOCK_N)
        keys = t[:, None] * BLOCK_N + lane[None, :]
        k_ok = (keys < seqlen_k) & (t[:, None] < n)
        on = tl.load(mask_row + keys.to(tl.int64) * stride_mk, mask=k_ok, other=0) != 0
        n_on = tl.sum(on.to(tl.int32), 1)
        weight = tl.full([BLOCK_N], 1, tl.int64) << lane.to(tl.int64)
        tile_bits = tl.sum(tl.where(on, weight[None, :], 0), 1)
    live = (n_on > 0) & (t < n)
    cut = live & (n_on < tl.minimum(seqlen_k - t * BLOCK_N, BLOCK_N))
    # A ragged last tile has fewer than BLOCK_N keys, so it is never full.
    full = n_on == BLOCK_N
    if IS_CAUSAL:
        full = full & (t * BLOCK_N + BLOCK_N - 1 <= q_first + offset)
    return t, tile_bits, live, full, cut


@triton.jit
def _per_key_lists_kernel(
    Mask, Idx, Cnt, Bits, Cut, CutFlag, n_heads, n_rows, n_tiles, seqlen_q, seqlen_k,
    stride_mb, stride_mh, stride_mk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WITH_BITS: tl.constexpr, WORDS: tl.constexpr,
    WITH_FLAG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = row % n_rows
    b = row // n_rows // n_heads
    h = row // n_rows % n_heads
    mask_row = Mask + b * stride_mb + h * stride_mh
    idx_row = Idx + row * n_tiles
    bits_row = Bits + row * n_tiles
    offset = seqlen_k - seqlen_q  # bottom-right: key j is visible to query i iff j <= i + offset
    q_first = r * BLOCK_M
    n = n_tiles
    if IS_CAUSAL:
        # Tiles past the limit of the row tile's last query are dead: never read or listed.
        q_last = tl.minimum(q_first + BLOCK_M, seqlen_q) - 1
        n = tl.minimum(n, tl.cdiv(tl.maximum(q_last + offset + 1, 0), BLOCK_N))
    base = n * 0
    n_full = base
    n_cut = base
    for want_partial in tl.static_range(2):
        for start in range(0, n, CHUNK):
            t, tile_bits, live, full, cut = _tile_states(mask_row, start, n, q_first, offset,
                                                    seqlen_k, stride_mk, BLOCK_N, CHUNK,
                                                    IS_CAUSAL, WORDS)
            if want_partial == 0:
                sel = live & full
            else:
                sel = live & (full == 0)
            s = sel.to(tl.int32)
            pos = base + tl.cumsum(s, 0) - 1
            tl.store(idx_row + pos, t * 2 + want_partial, mask=sel)
            if WITH_BITS:
                tl.store(bits_row + pos, tile_bits, mask=sel)
                if want_partial == 1:
                    n_cut += tl.sum(cut.to(tl.int32), 0)
            base += tl.sum(s, 0)
        if want_partial == 0:
            n_full = base
    for start in range(base, n_tiles, CHUNK * 16):
        c = start + tl.arange(0, CHUNK * 16)
        tl.store(idx_row + c, tl.zeros([CHUNK * 16], dtype=tl.int32), mask=c < n_tiles)
    tl.store(Cnt + row * 2, base)
    tl.store(Cnt + row * 2 + 1, n_full)
    if WITH_BITS:
        tl.store(Cut + row * 2, n_cut)
        tl.store(Cut + row * 2 + 1, tl.where(n_cut > 0, 0, base))
        if WITH_FLAG:
            # Read first: once raised, the other cut rows do not queue atomics on one word.
            if n_cut > 0:
                if tl.load(CutFlag) == 0:
                    tl.atomic_max(CutFlag, 1)
