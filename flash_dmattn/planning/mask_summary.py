"""One pass over a per-query mask that answers every tile question a call asks.

A per-query mask ``(Bx, Hx, Lq, Lk)`` is the one input whose classification costs real time:
the forward's live/full tile map, the backward's transposed map and the gather planner's
per-query-tile key unions are each a reduction over the whole mask (a bool per query and
key: 256 MiB for four mask heads at L 8K), and with plain torch reductions a forward + backward read it ten times. This
module reads it once per direction, with one Triton kernel, into two small summaries at a
fine ``(row_block, key_block)`` granularity:

* ``row_any``  ``(Bx, Hx, nQf, Lk)`` -- for each block of ``row_block`` rows, whether each key
  is live in any of them (``row_block`` times smaller than the mask);
* ``tile_all`` ``(Bx, Hx, nQf, nKf)`` -- whether every in-range element of each fine tile is
  live.

Every coarser question is then a reduction of these: tile maps for any block shape that is a
multiple of the fine one, and the gather planner's unions over ``block_m`` rows. Equivalent
plain PyTorch for the two summaries (what the torch fallback computes)::

    row_any  = block_reduce(mask, 2, row_block, "any")
    tile_all = block_reduce(block_reduce(mask, 2, row_block, "all"), 3, key_block, "all")

On request the same pass also writes the mask as **key bits** (``key_bits``), what the cuda
backward's dK/dV kernel reads instead of transposing each 64-query mask tile itself:

* ``key_bits`` ``(Bx, Hx, ceil(Lq / 64), ceil(Lk / 128) * 128)`` int64 -- bit ``q % 64`` of
  ``key_bits[b, h, q // 64, k]`` is ``mask[b, h, q, k]``, and 0 where key ``k`` lies past
  query ``q``'s bottom-right causal limit (causal summaries); 0 for keys ``>= Lk`` and rows
  ``>= Lq``. An eighth of the mask's size (see :func:`key_bits_reference`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..block_map import block_reduce
from ..intmath import cdiv
from ..triton_launch import launch


@dataclass(frozen=True)
class MaskSummary:
    """Fine-grained liveness of one per-query mask (see the module docstring)."""

    row_block: int
    key_block: int
    seqlen_q: int
    seqlen_k: int
    row_any: torch.Tensor
    tile_all: torch.Tensor
    key_bits: Optional[torch.Tensor] = None

    def tiles(self, block_q: int, block_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(live, full)`` maps ``(Bx, Hx, nQ, nK)`` of ``block_q x block_k`` tiles (no causal)."""
        if block_q % self.row_block or block_k % self.key_block:
            raise ValueError(f"tiles {block_q}x{block_k} are not multiples of the summary's "
                             f"{self.row_block}x{self.key_block}")
        live = self.row_union(block_q)
        live = block_reduce(live, 3, block_k, "any")
        full = self.tile_all
        if block_q > self.row_block:
            full = block_reduce(full, 2, block_q // self.row_block, "all")
        if block_k > self.key_block:
            full = block_reduce(full, 3, block_k // self.key_block, "all")
        return live, full

    def row_union(self, block_q: int) -> torch.Tensor:
        """``(Bx, Hx, nQ, Lk)``: key j is live in some row of query tile m (no causal)."""
        if block_q % self.row_block:
            raise ValueError(f"{block_q}-row tiles are not a multiple of {self.row_block}")
        if block_q == self.row_block:
            return self.row_any
        return block_reduce(self.row_any, 2, block_q // self.row_block, "any")


# Key bits cover 64 queries a word and are padded to whole 128-key tiles (the dK/dV kernel's
# key tile; its 16-byte copies never cross a row's end).
KEY_BITS_ROWS = 64
KEY_BITS_KEY_PAD = 128


def key_bits_reference(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain-PyTorch ``key_bits`` of a 4-D bool mask (see the module docstring)."""
    bx, hx, seqlen_q, seqlen_k = mask.shape
    n_w = cdiv(seqlen_q, KEY_BITS_ROWS)
    width = cdiv(seqlen_k, KEY_BITS_KEY_PAD) * KEY_BITS_KEY_PAD
    live = mask.to(torch.bool)
    if causal:
        q = torch.arange(seqlen_q, device=mask.device)[:, None]
        k = torch.arange(seqlen_k, device=mask.device)[None, :]
        live = live & (k <= q + (seqlen_k - seqlen_q))
    padded = torch.zeros((bx, hx, n_w * KEY_BITS_ROWS, width), dtype=torch.int64, device=mask.device)
    padded[:, :, :seqlen_q, :seqlen_k] = live.to(torch.int64)
    shifts = torch.arange(KEY_BITS_ROWS, device=mask.device, dtype=torch.int64)[:, None]
    # Distinct bits: the sum over a word's 64 rows is their OR (bit 63 wraps to the sign).
    return (padded.view(bx, hx, n_w, KEY_BITS_ROWS, width) << shifts).sum(3)


def summary_blocks(*shapes: Tuple[int, int]) -> Tuple[int, int]:
    """The finest ``(row_block, key_block)`` every given ``(block_q, block_k)`` is a multiple of."""
    rows = math.gcd(*(s[0] for s in shapes))
    keys = math.gcd(*(s[1] for s in shapes))
    return rows, keys


def wants_summary(mask: Optional[torch.Tensor], seqlen_q: int, seqlen_k: int) -> bool:
    """Only a mask that varies along both queries and keys is worth one fused pass."""
    return (mask is not None and seqlen_q > 1 and seqlen_k > 1
            and mask.size(2) == seqlen_q and mask.size(3) == seqlen_k)


@triton.jit
def _where_seen(fetch, first_row, BLOCK_Q: tl.constexpr, first_key, seqlen_q, seqlen_k):
    """``fetch`` where some row of the tile sees its first key (bottom-right causal), else
    all False. The tile-wide predicate is widened to a (1, 1) tile: the interpreter rejects
    a scalar predicate in a tensor mask."""
    last_row = tl.minimum(first_row + BLOCK_Q, seqlen_q) - 1
    seen = (first_key <= last_row + (seqlen_k - seqlen_q)).to(tl.int32)
    return fetch & ((tl.zeros([1, 1], dtype=tl.int32) + seen) != 0)


@triton.jit
def _tile_setup(num_heads_m, seqlen_q, seqlen_k, n_cols, n_row_blocks, KEYS_PER_COL: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Where a summary program works: ``(pid_k, pid_q, b, h, row, offs_m, offs_c, m_ok, c_ok,
    fetch)`` for the tile ``(pid_q, pid_k)`` of mask head ``pid_bh``; columns are keys
    (``KEYS_PER_COL`` 1) or 4-key words (4), ``n_cols`` of them; ``row`` indexes the summary
    rows; ``fetch`` is what to load (in range, and with ``IS_CAUSAL`` seen by some row)."""
    pid_k = tl.program_id(0)
    pid_q = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // num_heads_m).to(tl.int64)
    h = (pid_bh % num_heads_m).to(tl.int64)
    offs_m = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_c = pid_k * BLOCK_C + tl.arange(0, BLOCK_C)
    m_ok = offs_m < seqlen_q
    c_ok = offs_c < n_cols
    fetch = m_ok[:, None] & c_ok[None, :]
    if IS_CAUSAL:
        fetch = _where_seen(fetch, pid_q * BLOCK_Q, BLOCK_Q, pid_k * BLOCK_C * KEYS_PER_COL,
                            seqlen_q, seqlen_k)
    row = pid_bh.to(tl.int64) * n_row_blocks + pid_q
    return pid_k, pid_q, b, h, row, offs_m, offs_c, m_ok, c_ok, fetch


# Masks that are not whole 4-key words (odd Lk, strided keys): one program per fine tile
# (row_block x key_block), one load of the whole tile. Word layouts take the rows kernel
# below (8 x 512-key strips, 16-byte loads), which is faster than this tile kernel on words
# and several times faster when it also writes key bits; strips of byte loads were far slower
# than either.
@triton.jit
def _mask_summary_kernel(
    Mask, RowAny, TileAll, KeyBits,
    stride_mb, stride_mh, stride_mm, stride_mn,
    num_heads_m, seqlen_q, seqlen_k, n_row_blocks, n_key_blocks, n_bit_rows, bits_width,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, IS_CAUSAL: tl.constexpr,
    KEY_BITS: tl.constexpr,
):
    # IS_CAUSAL: a tile no row of which can see any key (bottom-right aligned) is not read and
    # summarised as dead; causal callers discard it anyway, and it is half of a square mask.
    pid_k, pid_q, b, h, row, offs_m, offs_n, m_ok, n_ok, fetch = _tile_setup(
        num_heads_m, seqlen_q, seqlen_k, seqlen_k, n_row_blocks, 1, BLOCK_Q, BLOCK_K, IS_CAUSAL)
    ok = m_ok[:, None] & n_ok[None, :]
    ptrs = Mask + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    live = (tl.load(ptrs, mask=fetch, other=0) != 0).to(tl.int32)
    tl.store(RowAny + row * seqlen_k + offs_n, tl.max(live, 0).to(tl.uint8), mask=n_ok)
    # Out-of-range elements do not make a ragged edge tile partial.
    full = tl.min(tl.min(tl.where(ok, live, 1), 1), 0)
    tl.store(TileAll + row * n_key_blocks + pid_k, full.to(tl.uint8))
    if KEY_BITS:
        _store_key_bits(KeyBits, live, offs_m, offs_n, pid_q, seqlen_q, seqlen_k, n_bit_rows,
                        bits_width, num_heads_m, b, h, BLOCK_Q, IS_CAUSAL)


@triton.jit
def _store_key_bits(KeyBits, live, offs_m, keys, pid_q, seqlen_q, seqlen_k, n_bit_rows,
                    bits_width, num_heads_m, b, h, BLOCK_Q: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Key bits (module docstring) of a tile's keys ``keys`` from ``live`` (int32 0/1,
    ``(BLOCK_Q, len(keys))``, 0 outside the mask): one word per key per 64 rows."""
    WORDS: tl.constexpr = BLOCK_Q // 64
    if IS_CAUSAL:
        live = tl.where(keys[None, :] <= (offs_m + (seqlen_k - seqlen_q))[:, None], live, 0)
    bits = live.to(tl.int64) << (tl.arange(0, BLOCK_Q) % 64).to(tl.int64)[:, None]
    words = tl.sum(tl.reshape(bits, (WORDS, 64, keys.shape[0])), 1)
    wrow = pid_q * WORDS + tl.arange(0, WORDS)
    base = ((b * num_heads_m + h) * n_bit_rows + wrow.to(tl.int64)) * bits_width
    tl.store(KeyBits + base[:, None] + keys[None, :], words,
             mask=(wrow < n_bit_rows)[:, None] & (keys < bits_width)[None, :])


def summarize_mask(mask: torch.Tensor, row_block: int, key_block: int,
                   causal: bool = False, key_bits: bool = False) -> MaskSummary:
    """Read a 4-D bool mask ``(Bx, Hx, Lq, Lk)`` (any strides) once into a :class:`MaskSummary`.

    ``causal``: the summary is only used together with bottom-right causal masking, so tiles
    that no query of theirs can see are not read (they summarise as dead: no live key, not
    full). ``key_bits``: also write the mask's key bits (module docstring) in the same pass;
    ``row_block`` must then be a multiple of 64.
    """
    bx, hx, seqlen_q, seqlen_k = mask.shape
    n_q = cdiv(seqlen_q, row_block)
    n_k = cdiv(seqlen_k, key_block)
    device = mask.device
    row_any = torch.empty((bx, hx, n_q, seqlen_k), dtype=torch.uint8, device=device)
    tile_all = torch.empty((bx, hx, n_q, n_k), dtype=torch.uint8, device=device)
    bits = None
    n_bit_rows, bits_width = cdiv(seqlen_q, KEY_BITS_ROWS), 0
    if key_bits:
        if row_block % KEY_BITS_ROWS:
            raise ValueError(f"key bits need row blocks that are multiples of {KEY_BITS_ROWS}, "
                             f"not {row_block}")
        bits_width = cdiv(seqlen_k, KEY_BITS_KEY_PAD) * KEY_BITS_KEY_PAD
        bits = torch.empty((bx, hx, n_bit_rows, bits_width), dtype=torch.int64, device=device)
    bits_arg = bits if bits is not None else tile_all
    words = _as_words(mask, key_block)
    if row_any.numel() and words is not None and row_block % 8 == 0:
        # One warp's lanes across the chunk (4 words each), 8 rows in registers; short
        # chunks on the interpreter (quicker, and tests cover several chunks a row).
        chunk_w = max(16 if device.type == "cpu" else 128, key_block // 4)
        n_c = cdiv(n_k * key_block // 4, chunk_w)
        if bits is not None and n_c * chunk_w * 4 < bits_width:
            bits[..., n_c * chunk_w * 4:].zero_()
        launch(_mask_summary_rows_kernel, (n_c, n_q, bx * hx),
               (words, row_any.view(torch.int32), tile_all, bits_arg,
                words.stride(0), words.stride(1), words.stride(2),
                hx, seqlen_q, seqlen_k, seqlen_k // 4, n_q, n_k, n_bit_rows, bits_width),
               dict(BLOCK_Q=row_block, BLOCK_W=key_block // 4, CHUNK_W=chunk_w,
                    IS_CAUSAL=bool(causal), KEY_BITS=bits is not None, num_warps=1))
    elif row_any.numel():
        if bits is not None and n_k * key_block < bits_width:
            # Keys past the last summary tile (key_block < 128): padding no program writes.
            bits[..., n_k * key_block:].zero_()
        mask_u8 = mask.view(torch.uint8)
        launch(_mask_summary_kernel, (n_k, n_q, bx * hx),
               (mask_u8, row_any, tile_all, bits_arg,
                mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2), mask_u8.stride(3),
                hx, seqlen_q, seqlen_k, n_q, n_k, n_bit_rows, bits_width),
               dict(BLOCK_Q=row_block, BLOCK_K=key_block, IS_CAUSAL=bool(causal),
                    KEY_BITS=bits is not None, num_warps=4))
    elif bits is not None:
        bits.zero_()
    return MaskSummary(row_block=row_block, key_block=key_block, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, row_any=row_any.view(torch.bool),
                       tile_all=tile_all.view(torch.bool), key_bits=bits)


def _as_words(mask: torch.Tensor, key_block: int) -> Optional[torch.Tensor]:
    """The mask as int32 words of 4 keys each, when its layout allows (else None).

    A bool is one byte holding 0 or 1, so OR-ing the words of a tile's rows gives every key's
    "any row" as a byte of the result, and AND-ing them its "all rows": the reductions run on
    a quarter of the elements.
    """
    if mask.size(3) % 4 or key_block % 4 or mask.stride(3) != 1 or mask.data_ptr() % 4:
        return None
    if any(mask.stride(d) % 4 for d in range(3)):
        return None
    return mask.view(torch.uint8).view(torch.int32)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _and(a, b):
    return a & b


@triton.jit
def _mask_summary_rows_kernel(
    Words, RowAnyW, TileAll, KeyBits,
    stride_wb, stride_wh, stride_wm,
    num_heads_m, seqlen_q, seqlen_k, n_words, n_row_blocks, n_key_blocks, n_bit_rows, bits_width,
    BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK_W: tl.constexpr,
    IS_CAUSAL: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """The summary of ``BLOCK_Q`` rows x ``CHUNK_W`` 4-key words (a whole number of key
    blocks of ``BLOCK_W`` words) on :func:`_as_words`, walked 8 rows at a time.

    Eight rows across a chunk wide enough for one warp's lanes keep every reduction inside a
    thread: the tile kernel's 64 x 64 tiles put rows on lanes and warps, and the key bits'
    row reductions then cost shuffles and barriers, several times the time the memory
    traffic needs. Key bits: shifting row ``r``'s word left by ``r % 8`` moves its
    four keys' flags to bit ``r % 8`` of bytes 0-3, so OR-ing 8 rows gives a word whose
    byte ``j`` holds key ``j``'s 8 row bits, and a 64-row key word is 8 such bytes; the
    causal limit is then one mask a key word.
    """
    pid_c = tl.program_id(0)
    pid_q = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // num_heads_m).to(tl.int64)
    h = (pid_bh % num_heads_m).to(tl.int64)
    # n_words (Lk / 4) is an argument so that its divisibility reaches the compiler: the
    # loads' masks are then whole 16-byte vectors.
    causal_off = seqlen_k - seqlen_q
    first_row = pid_q * BLOCK_Q
    offs_w = pid_c * CHUNK_W + tl.arange(0, CHUNK_W)
    w_ok = offs_w < n_words
    cols = w_ok
    if IS_CAUSAL:
        # Key blocks no row of the block can see are not read (summarised as dead), as in
        # the tile kernel: whole blocks, so that row_any is not cut at each row's limit.
        last_row = tl.minimum(first_row + BLOCK_Q, seqlen_q) - 1
        block_key = (offs_w // BLOCK_W) * (4 * BLOCK_W)
        cols = cols & (block_key <= last_row + causal_off)
    base = Words + b * stride_wb + h * stride_wh + offs_w[None, :]
    any_w = tl.zeros([CHUNK_W], dtype=tl.int32)
    all_w = tl.full([CHUNK_W], 0x01010101, dtype=tl.int32)
    r8 = tl.arange(0, 8)
    # Rows in runs of up to 64 (one key-bits word each): a loop, not unrolled, so that the
    # compiler does not hoist every run's loads into registers at once (BLOCK_Q 128 spilled).
    RUN: tl.constexpr = 64 if BLOCK_Q >= 64 else BLOCK_Q
    for run in range(BLOCK_Q // RUN):
        k0 = tl.zeros([CHUNK_W], dtype=tl.int64)
        k1 = tl.zeros([CHUNK_W], dtype=tl.int64)
        k2 = tl.zeros([CHUNK_W], dtype=tl.int64)
        k3 = tl.zeros([CHUNK_W], dtype=tl.int64)
        for g in tl.static_range(RUN // 8):
            rows = first_row + run * RUN + g * 8 + r8
            r_ok = rows < seqlen_q
            x = tl.load(base + rows.to(tl.int64)[:, None] * stride_wm,
                        mask=r_ok[:, None] & cols[None, :], other=0)
            any_w = any_w | tl.reduce(x, 0, _or)
            # Rows past Lq do not make a ragged edge block partial.
            all_w = all_w & tl.reduce(tl.where(r_ok[:, None], x, 0x01010101), 0, _and)
            if KEY_BITS:
                eight = tl.reduce(x << r8[:, None], 0, _or)
                k0 = k0 | ((eight & 0xFF).to(tl.int64) << (8 * g))
                k1 = k1 | (((eight >> 8) & 0xFF).to(tl.int64) << (8 * g))
                k2 = k2 | (((eight >> 16) & 0xFF).to(tl.int64) << (8 * g))
                k3 = k3 | (((eight >> 24) & 0xFF).to(tl.int64) << (8 * g))
        if KEY_BITS:
            # Key k's 64 rows from R0, in key order (join's pairs (0, 2) | (1, 3)).
            words = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (4 * CHUNK_W,))
            keys = pid_c * (4 * CHUNK_W) + tl.arange(0, 4 * CHUNK_W)
            wrow = first_row // 64 + run
            if IS_CAUSAL:
                # Rows below R0 + k - (Lk - Lq) cannot see key k: clear the word's bits below
                # that row (one mask a key word, not a test an element).
                cut = keys - causal_off - wrow * 64
                low = (1 << tl.minimum(tl.maximum(cut, 0), 63).to(tl.int64)) - 1
                words = tl.where(cut >= 64, 0, words & ~low)
            dst = KeyBits + ((b * num_heads_m + h) * n_bit_rows + wrow) * bits_width + keys
            # (a tensor: the interpreter rejects a scalar predicate in a tensor mask)
            ok = (tl.zeros([4 * CHUNK_W], dtype=tl.int32) + wrow) < n_bit_rows
            tl.store(dst, words, mask=ok & (keys < bits_width))
    row = pid_bh.to(tl.int64) * n_row_blocks + pid_q
    tl.store(RowAnyW + row * n_words + offs_w, any_w, mask=w_ok)
    BLOCKS: tl.constexpr = CHUNK_W // BLOCK_W
    whole = tl.where(w_ok, (all_w == 0x01010101).to(tl.int32), 1)
    full = tl.min(tl.reshape(whole, (BLOCKS, BLOCK_W)), 1)
    kb = pid_c * BLOCKS + tl.arange(0, BLOCKS)
    tl.store(TileAll + row * n_key_blocks + kb, full.to(tl.uint8), mask=kb < n_key_blocks)
