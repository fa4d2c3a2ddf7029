"""What the triton backend's kernels share: device helpers (score tiles, mask and bias loads,
varlen bounds), block shapes, output allocation, launch with or without autotuning, and the
varlen kernels' list arguments.

:mod:`.forward`, :mod:`.backward`, :mod:`.decode` and :mod:`.intervals` import from here and not
from each other's launchers, so each kernel module can be read (and imported) on its own.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...dropout import keep_scale, keep_threshold
from ...envs import interpret_mode, triton_autotune
from ...intmath import next_power_of_2
from ...planning.tiles import build_varlen_key_lists

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tests flip this to fill kernel-written outputs with NaN first, so unwritten elements show.
DEBUG_POISON = False


def alloc_output(shape, dtype, device) -> torch.Tensor:
    """``torch.empty`` that the kernels must fully overwrite (NaN-poisoned in debug mode)."""
    if DEBUG_POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot fp32 copies (bf16 under the interpreter)."""
    return interpret_mode() and dtype == torch.bfloat16


def head_block(head_dim: int) -> int:
    """Padded head dim: next power of two, at least 16 (tl.dot's minimum K)."""
    return max(16, next_power_of_2(head_dim))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def seqlen_bucket(n: int) -> int:
    """Autotune key bucket: sequence lengths within a power of two share tuned configs."""
    return next_power_of_2(max(n, 1))


def dropout_args(dropout_p: float, dropout_rng: Optional[torch.Tensor], dummy: torch.Tensor):
    """``((Rng, drop_thresh, drop_scale), DROPOUT)``: the kernels' dropout arguments (see
    :mod:`flash_dmattn.dropout`); ``dummy`` stands for the rng tensor when there is none (it
    is never read)."""
    if not dropout_p:
        return (dummy, 0, 1.0), False
    rng = dropout_rng.to(device=dummy.device, dtype=torch.int64).contiguous()
    return (rng, keep_threshold(dropout_p), keep_scale(dropout_p)), True


def broadcast_strides(t: Optional[torch.Tensor], num_heads: int):
    """(stride_b, stride_h, stride_q, stride_k, head_div) for a 4-D mask/bias view.

    Size-1 dims get stride 0 so the kernels can index them with the full program index; the
    head index is ``h // head_div`` which maps query heads to 1, Hkv or H mask heads.
    """
    if t is None:
        return 0, 0, 0, 0, 1
    st = [0 if t.size(d) == 1 else t.stride(d) for d in range(4)]
    return st[0], st[1], st[2], st[3], num_heads // t.size(1)


# ------------------------------------------------------------------------------------------
# Device helpers of the forward, backward, decode and interval kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The CPU interpreter's tl.dot mishandles bfloat16 operands; it gets them as fp32 (exact).
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # fp32 inputs (testing only) must not silently drop to tf32 on the GPU.
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _dropout_seed(Rng, DROPOUT: tl.constexpr):
    """The call's dropout ``(seed, offset)`` (see :mod:`flash_dmattn.dropout`), read once per
    program from the int64 rng tensor ``Rng``; zeros without dropout (nothing is read)."""
    if DROPOUT:
        seed = tl.load(Rng)
        offset = (tl.load(Rng + 1) & 0xFFFFFFFF).to(tl.uint32)
    else:
        seed = tl.zeros([], dtype=tl.int64)
        offset = tl.zeros([], dtype=tl.uint32)
    return seed, offset


@triton.jit
def _dropout_keep(seed, offset, bh, rows, cols, drop_thresh):
    """Whether the dropout keeps the entries of query rows ``rows`` and keys ``cols`` (int
    tiles that broadcast to the 2-D result, e.g. ``(M, 1)`` and ``(1, N)``, or transposed) of
    (batch * heads + head) ``bh``, for any keys (gathered ones too): byte ``cols % 4`` of word
    ``(cols // 4) % 4`` of Philox4x32 keyed by ``seed`` at counter ``(cols // 16, rows, bh,
    offset)``, kept iff it reaches ``drop_thresh`` (:mod:`flash_dmattn.dropout`). A pure
    function of the coordinates, so every kernel and tiling regenerates one mask.

    One Philox evaluation per entry, whose four-word state is live until its last round: the
    tile is evaluated as its even and its odd columns one after the other (a thread's
    neighbouring columns in the dot layouts), which halves the state live at once."""
    zero = rows * 0 + cols * 0
    R: tl.constexpr = zero.shape[0]
    C: tl.constexpr = zero.shape[1]
    rows_e, rows_o = tl.split(tl.reshape(rows + zero, (R, C // 2, 2)))
    cols_e, cols_o = tl.split(tl.reshape(cols + zero, (R, C // 2, 2)))
    keep_e = _dropout_keep_each(seed, offset, bh, rows_e, cols_e, drop_thresh)
    keep_o = _dropout_keep_each(seed, offset, bh, rows_o, cols_o, drop_thresh)
    return tl.reshape(tl.join(keep_e, keep_o), (R, C))


@triton.jit
def _dropout_keep_each(seed, offset, bh, rows, cols, drop_thresh):
    """:func:`_dropout_keep` of same-shaped ``rows`` and ``cols``, all entries at once."""
    # Zero (rows and keys are non-negative), but not to the compiler: every counter word then
    # depends on both, so a loop over query or key tiles cannot hoist the first Philox round
    # of the other's invariant words out of the loop as a whole tile kept live across it.
    zero = (rows >> 31) + (cols >> 31)
    keys = cols + zero
    r0, r1, r2, r3 = tl.philox(seed, (keys >> 4).to(tl.int32), (rows + zero).to(tl.int32),
                               (zero + bh).to(tl.int32), zero.to(tl.uint32) + offset)
    pick = (keys >> 2) & 3
    word = tl.where(pick == 0, r0, tl.where(pick == 1, r1, tl.where(pick == 2, r2, r3)))
    byte = (word >> ((keys & 3) * 8).to(tl.uint32)) & 0xFF
    return byte.to(tl.int32) >= drop_thresh


@triton.jit
def _dropout_word_bits(word, drop_thresh):
    """Int32 whose bits 0-3 say whether bytes 0-3 (low first) of ``word`` reach
    ``drop_thresh``."""
    b0 = ((word & 0xFF).to(tl.int32) >= drop_thresh).to(tl.int32)
    b1 = (((word >> 8) & 0xFF).to(tl.int32) >= drop_thresh).to(tl.int32)
    b2 = (((word >> 16) & 0xFF).to(tl.int32) >= drop_thresh).to(tl.int32)
    b3 = ((word >> 24).to(tl.int32) >= drop_thresh).to(tl.int32)
    return b0 | (b1 << 1) | (b2 << 2) | (b3 << 3)


@triton.jit
def _dropout_group_bits(seed, offset, bh, offs_m, offs_n, drop_thresh):
    """The keep bits of rows ``offs_m`` and keys ``offs_n`` (consecutive, the first a multiple
    of 16: a kernel's key tile) packed as an int32 ``(N / 16, M)`` tile: bit ``i`` of entry
    ``(g, r)`` is :func:`_dropout_keep` of key ``16 * g + i`` (counted from the tile's first
    key) and row ``r``. One Philox evaluation per entry serves 16 keys.

    The tile is computed in a compact layout (each entry once) and only the packed words are
    moved to the consumer's layout: the ``join`` / ``max`` below changes no value, but left
    out, the compiler computes the Philox rounds directly in the dot layout, where every
    entry is evaluated by 4 (query-major) or 8 (key-major) threads."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    tl.static_assert(BLOCK_N % 16 == 0, "key tiles are whole groups of 16 keys")
    groups = (tl.min(offs_n, 0) >> 4) + tl.arange(0, BLOCK_N // 16)
    rows = offs_m[None, :]
    # Zero (rows are non-negative), but it ties the key-only counter words to the rows: the
    # dK/dV kernel's loop over query tiles would otherwise hoist their first Philox round and
    # keep it live across the loop.
    zero = groups[:, None] * 0 + (rows >> 31)
    r0, r1, r2, r3 = tl.philox(seed, (groups[:, None] + zero).to(tl.int32),
                               (rows + zero).to(tl.int32), (zero + bh).to(tl.int32),
                               zero.to(tl.uint32) + offset)
    bits = (_dropout_word_bits(r0, drop_thresh) | (_dropout_word_bits(r1, drop_thresh) << 4)
            | (_dropout_word_bits(r2, drop_thresh) << 8)
            | (_dropout_word_bits(r3, drop_thresh) << 12))
    return tl.max(tl.join(bits, bits), 2)


@triton.jit
def _dropout_keep_tile(seed, offset, bh, offs_m, offs_n, drop_thresh):
    """:func:`_dropout_keep` of rows ``offs_m`` and keys ``offs_n`` as a ``(M, N)`` tile, for
    a key tile (consecutive keys, the first a multiple of 16): the packed bits of
    :func:`_dropout_group_bits`, expanded only here."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    bits = tl.trans(_dropout_group_bits(seed, offset, bh, offs_m, offs_n, drop_thresh))
    full = tl.reshape(tl.broadcast_to(bits[:, :, None], (BLOCK_M, BLOCK_N // 16, 16)),
                      (BLOCK_M, BLOCK_N))
    return ((full >> (offs_n & 15)[None, :]) & 1) != 0


@triton.jit
def _dropout_keep_tile_t(seed, offset, bh, offs_m, offs_n, drop_thresh):
    """:func:`_dropout_keep_tile` transposed, ``(N, M)``: keys along the first axis (the
    dK/dV kernel's orientation)."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    bits = _dropout_group_bits(seed, offset, bh, offs_m, offs_n, drop_thresh)
    full = tl.reshape(tl.broadcast_to(bits[:, None, :], (BLOCK_N // 16, 16, BLOCK_M)),
                      (BLOCK_N, BLOCK_M))
    return ((full >> (offs_n & 15)[:, None]) & 1) != 0


@triton.jit
def _tanh(x):
    # tanh via exp2: saturates cleanly to +-1 for large |x| (exp2 -> inf or 0), no NaN.
    e = tl.exp2(x * 2.8853900817779268)
    return 1.0 - 2.0 / (e + 1.0)


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


# ------------------------------------------------------------------------------------------
# Block shapes and launches
# ------------------------------------------------------------------------------------------


def fwd_blocks(head_dim: int) -> Tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the forward kernel; the tile lists are built for this shape.

    Block sizes are fixed per head dim (not autotuned) because the live-tile lists depend on
    them; autotuning covers num_warps / num_stages. Chosen from sm_90 register/smem reports of
    ahead-of-time compiles (no spills at 8 warps with mask + bias + softcap enabled).
    """
    if interpret_mode():
        return 16, 16
    if head_block(head_dim) <= 128:
        return 128, 64
    return 64, 64


def bwd_blocks(head_dim: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """Block shapes ``((BLOCK_M, BLOCK_N) of dK/dV, (BLOCK_M, BLOCK_N) of dQ)``.

    The dK/dV kernel keeps a long key tile resident (K, V and two fp32 accumulators) and streams
    short query tiles; the dQ kernel is forward-shaped (long query tile, short key tile), so for
    head dims up to 128 it uses the forward's blocks. The shapes match what FlexAttention picks
    on sm_90 (the same register budget); D=256 halves the
    long side because the fp32 accumulators alone fill the register file.
    """
    if interpret_mode():
        return (16, 16), (16, 16)
    bd = head_block(head_dim)
    if bd <= 128:
        # 128-key dK/dV tiles: a 64-key tile halves the accumulators but doubles the programs,
        # each re-reading Q and dO, and measured slower (benchmarks/results/nvidia-h200/).
        return (64, 128), (128, 64)
    return (64, 64), (64, 64)


def launch_tuned(kernel, tuned, grid, args, meta, autotune: bool = True) -> None:
    """Launch ``tuned`` (an autotuner over ``kernel``), or ``kernel`` with fixed settings under
    the interpreter, with autotuning switched off, or without ``autotune``: the first of
    ``tuned``'s (pruned) configs this GPU can fit. During CUDA-graph capture a specialisation
    the autotuner has not timed yet also takes the first config: timing synchronises the
    device, which capture forbids (its choice is used once it has one)."""
    if interpret_mode():
        kernel[grid](*args, **meta, num_warps=4, num_stages=1)
    elif (not autotune or not triton_autotune()
          or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
              and not _autotuned(tuned, args, meta))):
        configs = tuned.configs
        prune = getattr(tuned, "early_config_prune", None)
        if prune is not None:
            configs = prune(configs, dict(zip(kernel.arg_names, args)), **meta)
        # Like the autotuner, skip configs this GPU cannot fit (shared memory, registers).
        for i, cfg in enumerate(configs):
            try:
                kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                return
            except triton.runtime.errors.OutOfResources:
                if i == len(configs) - 1:
                    raise
    else:
        tuned[grid](*args, **meta)


def _autotuned(tuned, args, meta) -> bool:
    """Whether ``tuned`` has a timed config for these arguments (its cache key, built as
    Triton's ``Autotuner.run`` builds it: the key arguments, then every tensor's dtype)."""
    if len(tuned.configs) <= 1:
        return True
    try:
        named = {k: v for k, v in {**dict(zip(tuned.arg_names, args)), **meta}.items()
                 if k in tuned.arg_names}
        key = [named[k] for k in tuned.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key) in tuned.cache
    except Exception:  # noqa: BLE001  (another Triton's internals: take the safe branch)
        return False


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
