"""Score tiles of the forward and backward kernels: ``S = Q K^T`` scaled (or softcapped), plus
the bias, with masked, out-of-range and causally hidden elements at ``-inf``; the mask and
bias tile loads of broadcast operands, and the key tiles an unlisted loop visits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _tanh
from .varlen import _varlen_need_elem


@triton.jit
def _load_bcast(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c,
                R_BCAST: tl.constexpr, C_BCAST: tl.constexpr, other):
    """Load a 2-D tile of a broadcastable mask/bias; a broadcast dim loads as size 1."""
    return _load_tile(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c, R_BCAST, C_BCAST,
                      other, True)


@triton.jit
def _load_mask_tile(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c,
                    R_BCAST: tl.constexpr, C_BCAST: tl.constexpr, pred):
    """A mask tile as ``_load_bcast`` reads it, fetched only where the scalar ``pred`` holds.

    The kernels call this outside their ``if need_elem:`` branch, with ``pred=need_elem``:
    Triton software-pipelines only loads in the loop body proper, so a mask load inside the
    branch would stall every partial tile (every tile, for a per-query top-k mask) for the
    full memory latency. Out-of-range and unfetched elements read as 1; callers bound the
    keys separately.
    """
    return _load_tile(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c, R_BCAST, C_BCAST,
                      1, pred)


@triton.jit
def _load_tile(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c,
               R_BCAST: tl.constexpr, C_BCAST: tl.constexpr, other, pred):
    if R_BCAST:
        r = tl.zeros([1, 1], dtype=tl.int32)
        r_ok = r == 0
    else:
        r = offs_r[:, None]
        r_ok = r < lim_r
    if C_BCAST:
        c = tl.zeros([1, 1], dtype=tl.int32)
        c_ok = c == 0
    else:
        c = offs_c[None, :]
        c_ok = c < lim_c
    # pred may be a Python bool or a scalar tensor; make it a (1, 1) int1 tile.
    fetch = (tl.zeros([1, 1], dtype=tl.int32) + pred) != 0
    return tl.load(base + r * stride_r + c * stride_c, mask=r_ok & c_ok & fetch, other=other)


@triton.jit
def _scores(q, kt, bias_base, mask_base, offs_m, offs_n, n_ok, mask_cols, mask_lim, need_elem,
            bias_klim, mask_bits,
            stride_bm, stride_bn, stride_mm, stride_mn,
            seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
            HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
            HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
            IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_UPCAST: tl.constexpr,
            ELEM: tl.constexpr, BIAS_GATHERED: tl.constexpr = False,
            MASK_BITS: tl.constexpr = False):
    """Scores (queries x keys) in log2 units, plus tanh (for the softcap chain).

    ``ELEM``: 1 -- masked per element always (gather mode); 2 -- decided per tile by
    ``need_elem`` at run time (listed, dense and varlen loops).

    ``mask_cols`` / ``mask_lim``: the mask's column index and bound (the key index and Lk,
    or in gather mode the position in the gathered list and its length).
    ``BIAS_GATHERED``: the bias is a KeyGather's ``gbias`` row, read at ``mask_cols`` too.
    ``MASK_BITS``: the mask is given as ``mask_bits`` and not loaded (kernels that do not use
    it pass 0): 1 -- a per-key mask's tile bits, an int64 scalar with bit ``i`` for key ``i``
    of the tile; 2 -- one int64 per row with bit ``i`` for column ``i`` (see ``_hide``).
    """
    s = _dot(q, kt, DOT_UPCAST)
    if HAS_SOFTCAP:
        th = _tanh(s * cap_scale)
        s = (softcap * 1.4426950408889634) * th
    else:
        th = s
        s = s * qk_scale
    if HAS_BIAS:
        if BIAS_GATHERED:
            bias_cols = mask_cols
        else:
            bias_cols = offs_n
        bv = _load_bcast(bias_base, offs_m, bias_cols, stride_bm, stride_bn, seqlen_q,
                         bias_klim, BIAS_QB, BIAS_KB, 0.0)
        s = s + bv.to(tl.float32) * 1.4426950408889634
    if MASK_BITS:
        mv = mask_bits
    elif HAS_MASK:  # outside the branch so it is pipelined (see _load_mask_tile)
        mv = _load_mask_tile(mask_base, offs_m, mask_cols, stride_mm, stride_mn, seqlen_q,
                             mask_lim, MASK_QB, MASK_KB, need_elem)
    else:
        mv = 1
    if ELEM == 1:
        s = _hide(s, mv, n_ok, offs_m, offs_n, seqlen_q, seqlen_k, HAS_MASK, IS_CAUSAL, MASK_BITS)
    elif ELEM == 2:
        if need_elem:
            s = _hide(s, mv, n_ok, offs_m, offs_n, seqlen_q, seqlen_k, HAS_MASK, IS_CAUSAL,
                      MASK_BITS)
    return s, th


@triton.jit
def _bit_set(words, lane):
    """Whether bit ``lane`` (0..63) of the int64 ``words`` is set, broadcasting the two; the
    32-bit halves keep the shifts in 32-bit ops."""
    half = tl.where(lane < 32, words.to(tl.int32), (words >> 32).to(tl.int32))
    return ((half >> (lane & 31)) & 1) != 0


@triton.jit
def _hide(s, mv, n_ok, offs_m, offs_n, seqlen_q, seqlen_k, HAS_MASK: tl.constexpr,
          IS_CAUSAL: tl.constexpr, MASK_BITS: tl.constexpr = False):
    """-inf where a (query, key) element is out of range, masked or causally hidden.

    ``mv``: the mask tile (non-zero = live); with ``MASK_BITS == 1`` the tile's bits (an int64
    scalar; key tiles start at multiples of their width, so a key's bit is its index modulo
    the width); with ``MASK_BITS == 2`` one int64 per row, bit ``i`` for the tile's column
    ``i`` (gathered keys: a KeyGather's gbits, which also hold range and causality)."""
    if MASK_BITS == 2:
        # Gathered keys: the row's bits are the whole answer -- the planner leaves them 0 past
        # the list's count and past the row's causal limit -- so no range or causal test.
        # (An if / else, not an early return: the compiler would still build the rest.)
        vis = _bit_set(mv[:, None], tl.arange(0, offs_n.shape[0])[None, :])
    else:
        vis = n_ok[None, :]
        if MASK_BITS == 1:
            # Tile widths are powers of two <= 64: a key's lane is its index modulo the width.
            vis = vis & _bit_set(mv, offs_n & (offs_n.shape[0] - 1))[None, :]
        elif HAS_MASK:
            vis = vis & (mv != 0)
        if IS_CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _gathered_row_bits(bits_rows, t, BLOCK_N: tl.constexpr):
    """Gathered tile ``t``'s mask bits of each row (bit ``i`` for its column ``i``) from the
    rows' gbits words (64 listed keys each)."""
    tl.static_assert(64 % BLOCK_N == 0, "a gathered tile's bits must lie in one gbits word")
    words = tl.load(bits_rows + ((t * BLOCK_N) >> 6))
    if BLOCK_N < 64:
        words = words >> ((t * BLOCK_N) & 63)
    return words


@triton.jit
def _key_tile(t, offs_n0, start_m, seqlen_q, seqlen_k,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
              IS_CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """Key tile ``t`` of an unlisted loop (dense or varlen), for the forward and dQ kernels.

    Returns ``(offs_n, n_ok, need_elem)``: the key indices, which are in range and whether the
    tile needs per-element masking (a ragged edge; in varlen calls also mask / diagonal).
    """
    start_n = t * BLOCK_N
    need_elem = start_n + BLOCK_N > seqlen_k
    if VARLEN:
        need_elem = _varlen_need_elem(need_elem, start_m, start_n, seqlen_q, seqlen_k,
                                      BLOCK_M, BLOCK_N, HAS_MASK, IS_CAUSAL)
    offs_n = start_n + offs_n0
    return offs_n, offs_n < seqlen_k, need_elem


@triton.jit
def _key_bounds(stride_mm, stride_bm, seqlen_k, MASK_PAD: tl.constexpr, BIAS_PAD: tl.constexpr):
    """Key bounds of the mask and bias reads: the row stride for padded row copies
    (:func:`aligned_rows`, a multiple of 16 the compiler can see), else ``seqlen_k``."""
    mask_klim = seqlen_k
    bias_klim = seqlen_k
    if MASK_PAD:
        mask_klim = stride_mm
    if BIAS_PAD:
        bias_klim = stride_bm
    return mask_klim, bias_klim

