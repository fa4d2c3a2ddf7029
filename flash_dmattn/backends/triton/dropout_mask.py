"""Attention dropout inside the Triton kernels: the kernels' dropout arguments
(:func:`dropout_args`) and the device helpers that regenerate the keep-mask of any tile from
its coordinates (:mod:`flash_dmattn.dropout` defines the mask; every kernel and tiling draws
the same one).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...dropout import keep_scale, keep_threshold


def dropout_args(dropout_p: float, dropout_rng: Optional[torch.Tensor], dummy: torch.Tensor):
    """``((Rng, drop_thresh, drop_scale), DROPOUT)``: the kernels' dropout arguments (see
    :mod:`flash_dmattn.dropout`); ``dummy`` stands for the rng tensor when there is none (it
    is never read)."""
    if not dropout_p:
        return (dummy, 0, 1.0), False
    rng = dropout_rng.to(device=dummy.device, dtype=torch.int64).contiguous()
    return (rng, keep_threshold(dropout_p), keep_scale(dropout_p)), True


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

