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

from ...dropout import ROUNDS, keep_scale, keep_threshold

# The stream's Philox rounds (:data:`flash_dmattn.dropout.ROUNDS`), a compile-time constant.
PHILOX_ROUNDS = tl.constexpr(ROUNDS)


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
    (batch * heads + head) ``bh``, for any rows and keys: byte ``rows % 4`` of word ``(rows %
    16) // 4`` of Philox4x32 keyed by ``seed`` at counter ``(cols, rows // 16, bh, offset)``,
    kept iff it reaches ``drop_thresh`` (:mod:`flash_dmattn.dropout`). A pure function of the
    coordinates, so every kernel and tiling regenerates one mask.

    One Philox evaluation per entry: the definition, for checking the kernels' helpers
    (:func:`_dropout_keep_tile` and :func:`_dropout_keep_tile_t`, one evaluation per 16 rows
    of a key), which is what the kernels call."""
    zero = (rows >> 31) + (cols >> 31)
    keys = cols + zero
    rows = rows + zero
    r0, r1, r2, r3 = tl.philox(seed, keys.to(tl.int32), (rows >> 4).to(tl.int32),
                               (zero + bh).to(tl.int32), zero.to(tl.uint32) + offset,
                               n_rounds=PHILOX_ROUNDS)
    pick = (rows >> 2) & 3
    word = tl.where(pick == 0, r0, tl.where(pick == 1, r1, tl.where(pick == 2, r2, r3)))
    byte = (word >> ((rows & 3) * 8).to(tl.uint32)) & 0xFF
    return byte.to(tl.int32) >= drop_thresh


@triton.jit
def _dropout_word_bits(word, drop_thresh):
    """Int32 whose bits 0-3 say whether bytes 0-3 (low first) of the uint32 ``word`` reach
    ``drop_thresh`` (in ``[0, 256]``).

    All four bytes are compared at once inside the word: with ``H`` the bytes' high bits and
    ``t`` the threshold in every byte, ``(word | H) - (t & ~H)`` borrows nothing across bytes
    and its byte high bit says whether the low 7 bits of the byte reach those of ``t``; a byte
    reaches ``t`` iff its high bit is above ``t``'s or equal with that comparison true. The
    four high bits are then gathered into bits 0-3 by one multiply (the partial products land
    on distinct bit positions, so nothing carries into bits 24-27)."""
    t = tl.cast(drop_thresh & 0xFF, tl.uint32) * 0x01010101
    low_ge = (word | 0x80808080) - (t & 0x7F7F7F7F)
    ge = ((word & ~t) | (~(word ^ t) & low_ge)) & 0x80808080
    bits = (((ge >> 7) * 0x01020408) >> 24).to(tl.int32)
    # A threshold of 256 (dropout_p >= 1 - 1/512) keeps nothing; its low byte is 0.
    return tl.where(drop_thresh > 255, 0, bits)


@triton.jit
def _dropout_group_bits(seed, offset, bh, offs_m, cols, drop_thresh):
    """The keep bits of query rows ``offs_m`` (consecutive, the first a multiple of 16: a
    kernel's query tile) and keys ``cols`` (any: a key tile, a gathered list, key-interval
    picks) packed as an int32 ``(M / 16, N)`` tile: bit ``t`` of entry ``(g, n)`` is
    :func:`_dropout_keep` of row ``16 * g + t`` (counted from the tile's first row) and key
    ``cols[n]``. One Philox evaluation per entry serves 16 rows.

    The tile is computed in a compact layout (each entry once) and only the packed words are
    moved to the consumer's layout: the ``join`` / ``max`` below changes no value, but left
    out, the compiler computes the Philox rounds directly in the dot layout, where every
    entry is evaluated by several threads."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    tl.static_assert(BLOCK_M % 16 == 0, "query tiles are whole groups of 16 rows")
    groups = ((tl.min(offs_m, 0) >> 4) + tl.arange(0, BLOCK_M // 16))[:, None]
    keys = cols[None, :]
    # Zero (rows and keys are non-negative), but not to the compiler: every counter word then
    # depends on both, so neither a loop over key tiles (forward, dQ) nor one over query tiles
    # (dK/dV) can hoist the first Philox round of the words it holds fixed out of the loop as
    # a whole tile kept live across it.
    zero = (groups >> 31) + (keys >> 31)
    r0, r1, r2, r3 = tl.philox(seed, (keys + zero).to(tl.int32), (groups + zero).to(tl.int32),
                               (zero + bh).to(tl.int32), zero.to(tl.uint32) + offset,
                               n_rounds=PHILOX_ROUNDS)
    bits = (_dropout_word_bits(r0, drop_thresh) | (_dropout_word_bits(r1, drop_thresh) << 4)
            | (_dropout_word_bits(r2, drop_thresh) << 8)
            | (_dropout_word_bits(r3, drop_thresh) << 12))
    return tl.max(tl.join(bits, bits), 2)


@triton.jit
def _dropout_keep_tile(seed, offset, bh, offs_m, cols, drop_thresh):
    """:func:`_dropout_keep` of rows ``offs_m`` and keys ``cols`` as a ``(M, N)`` tile, for a
    query tile (consecutive rows, the first a multiple of 16) and any keys: the packed bits of
    :func:`_dropout_group_bits`, expanded only here."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    BLOCK_N: tl.constexpr = cols.shape[0]
    bits = _dropout_group_bits(seed, offset, bh, offs_m, cols, drop_thresh)
    full = tl.reshape(tl.broadcast_to(bits[:, None, :], (BLOCK_M // 16, 16, BLOCK_N)),
                      (BLOCK_M, BLOCK_N))
    return ((full >> (offs_m & 15)[:, None]) & 1) != 0


@triton.jit
def _dropout_keep_tile_t(seed, offset, bh, offs_m, cols, drop_thresh):
    """:func:`_dropout_keep_tile` transposed, ``(N, M)``: keys along the first axis (the
    dK/dV kernels' orientation)."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    BLOCK_N: tl.constexpr = cols.shape[0]
    bits = tl.trans(_dropout_group_bits(seed, offset, bh, offs_m, cols, drop_thresh))
    full = tl.reshape(tl.broadcast_to(bits[:, :, None], (BLOCK_N, BLOCK_M // 16, 16)),
                      (BLOCK_N, BLOCK_M))
    return ((full >> (offs_m & 15)[None, :]) & 1) != 0
