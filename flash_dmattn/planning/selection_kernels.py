"""Triton kernels of the causal top-W selection (:func:`flash_dmattn.planning.selection.topk_intervals`).

The plain-PyTorch path answers the per-key queries "W-th smallest position among the keys that
outrank key j" with a radix wavelet tree built and walked by a few dozen small torch ops per
level. Here the same tree is built by one kernel per level and walked by one kernel for all
levels, so a causal call is a handful of launches:

1. ``_score_kernel``: candidate mask and sort key (``-inf`` for non-candidates, ``-0.0`` made
   ``+0.0``), one pass over the bias.
2. ``torch.sort`` (stable, descending): ``order``, the key positions in rank order.
3. ``_prep_kernel``: ``order`` as int32 (the level-0 sequence) and per-block digit counts of
   level 0; it also zeroes the count tables of the later levels and the rank tables' masks.
4. ``_partition_kernel``, once per level but the last: the stable partition of every node of
   the level by digit (the next level's sequence), the next level's per-block digit counts
   (integer atomics, so the result does not depend on their order) and the level's rank
   table: every ``CHECK`` entries of the sequence, the count of each digit before them and,
   for each digit, a bit mask of its entries among them (OR atomics into words the prep
   kernel zeroed).
5. ``_query_kernel``: every key walks all levels (one row of the rank table gives every
   digit's prefix count: a count plus the set bits of a mask; a level costs one load, a scan
   and two reductions) and writes its interval bounds directly.

Keys of a row are processed in blocks of ``n_sub * SUB`` entries: one program per block, so
that at most ``MAX_BLOCKS`` blocks precede any entry (a program sums their counts itself; no
separate scan launch) while a row of up to 1M keys still has enough programs.

Host work per call is kept small (the call is often host bound): the sizes and grids of a
``(L, rows)`` problem are computed once (:func:`_layout`, cached), the sequences and count
tables of all levels share one int32 workspace (one allocation; kernels take the level as an
integer, no tensor views), the bias is read through its strides (no copy, no view), and
every launch passes all of its kernel's parameters to :func:`flash_dmattn.triton_launch.launch`
(Triton's argument specialisation once per launch signature, not once per launch).

Everything is exact integer work on the same tree as the torch path, so the results are equal
bit for bit.
"""
from __future__ import annotations

import functools
import struct

import torch

from ..envs import interpret_mode
from ..triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the selection then uses its plain-PyTorch path
    triton = None

# Entries of the one-hot (entry, digit) tile a partition step holds: SUB = _TILE // R.
# All these sizes are powers of two, and CHECK divides SUB.
_TILE = 4096
# At most this many blocks per row (each program sums the counts of the blocks before it).
MAX_BLOCKS = 128
# Entries per row of a level's rank table: a count per digit and a CHECK-bit mask per digit
# (one int32 word, so at most 32).
CHECK = 32
# Keys per query program, and its warps.
QUERY_BLOCK = 64
QUERY_WARPS = 8
# Elementwise block of the score kernel.
SCORE_BLOCK = 1024
# Bounds of a key every query sees (as selection._ALWAYS).
_ALWAYS = 1 << 30
# Rows (batch * heads) are the second grid dimension, which CUDA limits to 65535.
MAX_ROWS = 65535
# Keys per row: the tree walk packs a count below 2 ** 24 with a digit into one int32.
MAX_LENGTH = (1 << 24) - 1


def available(device: torch.device, rows: int = 1, length: int = 1) -> bool:
    """Whether the selection kernels run for ``rows`` (batch, head) rows of ``length`` keys
    on ``device``."""
    if triton is None or rows > MAX_ROWS or length > MAX_LENGTH:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


def radix_bits(length: int) -> int:
    """Bits per level: 5 where that saves a level over 4 (fewer launches), else 4. The kernels
    take at most 5 (the last level holds a node's values as the bits of one int32 word)."""
    bits = max(1, (length - 1).bit_length())
    return 5 if -(-bits // 5) < -(-bits // 4) else 4


if triton is not None:

    @triton.jit(do_not_specialize=["min_hi", "min_lo"])
    def _score_kernel(Bias, Pad, Out, min_f32, min_hi, min_lo, heads, L, rows,
                      s_bb, s_bh, s_bl, s_pb, s_pl,
                      HAS_PAD: tl.constexpr, F64: tl.constexpr, MODE: tl.constexpr,
                      ALWAYS: tl.constexpr, BLOCK: tl.constexpr):
        """MODE 0: ``Out`` (rows, L) = the sort key (bias dtype). MODE 3 (16-bit biases):
        ``Out`` (rows, L) = int32 keys of one flat sort (row, then bias descending). MODE 1/2: ``Out`` = the bounds
        (2, rows, L) int32 of "every candidate kept": ``[j, L)`` (1) or ``[-ALWAYS, ALWAYS)``
        (2), ``[0, 0)`` for the others."""
        pid = tl.program_id(0)
        row = tl.program_id(1)
        b = row // heads
        h = row % heads
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < L
        x = tl.load(Bias + b.to(tl.int64) * s_bb + h.to(tl.int64) * s_bh + offs.to(tl.int64) * s_bl,
                    mask=ok, other=0.0)
        # torch compares with the threshold converted to the bias dtype; that value is exact in
        # fp32 (fp16/bf16/fp32 biases) or fp64, and so is the bias, so the comparison is too.
        if F64:
            bits = (min_hi.to(tl.int64) << 32) | (min_lo.to(tl.int64) & 0xFFFFFFFF)
            xc = x.to(tl.float64)
            valid = xc > bits.to(tl.float64, bitcast=True)
        else:
            xc = x.to(tl.float32)
            valid = xc > min_f32
        if HAS_PAD:
            pad = tl.load(Pad + b.to(tl.int64) * s_pb + offs.to(tl.int64) * s_pl, mask=ok, other=0)
            valid = valid & (pad != 0)
        out_off = row.to(tl.int64) * L + offs
        if MODE == 3:
            # One int32 sort key per key of a 16-bit bias: the row in the high half, the bias's
            # bits mapped to a descending order in the low half (0xFFFF: not a candidate, after
            # every candidate); one flat stable sort then orders every row at once, ties to the
            # lower index, as the per-row sort of MODE 0 keys does.
            xb = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            xb = tl.where(xb == 0x8000, 0, xb)  # -0.0 sorts as +0.0
            ordered = tl.where(xb >= 0x8000, (~xb) & 0xFFFF, xb | 0x8000)  # ascending in value
            desc = tl.where(valid, 0xFFFF - ordered, 0xFFFF)
            tl.store(Out + out_off, row.to(tl.int32) * 65536 + desc, mask=ok)
        elif MODE == 0:
            # + 0.0 turns -0.0 into +0.0 (equal biases must sort as equal keys).
            score = tl.where(valid, xc + 0.0, float("-inf"))
            tl.store(Out + out_off, score.to(Out.dtype.element_ty), mask=ok)
        else:
            if MODE == 1:
                lo = offs
                hi = offs * 0 + L
            else:
                lo = offs * 0 - ALWAYS
                hi = offs * 0 + ALWAYS
            tl.store(Out + out_off, tl.where(valid, lo, 0), mask=ok)
            tl.store(Out + rows * L + out_off, tl.where(valid, hi, 0), mask=ok)

    @triton.jit
    def _prep_kernel(Order, Ws, L, rows, n_sub, n_blocks, n_tables, n_ck, tot_off, ck_off,
                     shift0, R: tl.constexpr, SUB: tl.constexpr, CHK: tl.constexpr,
                     FLAT: tl.constexpr):
        """Block ``b`` of every row: the level-0 sequence ``order`` as int32, the level-0 digit
        counts of the block into count table 0, zeros into the later tables (later levels add
        to them) and into the mask words of the block's rows of every rank table (the
        partitions OR bits into them). ``FLAT``: ``Order`` holds indices into the flattened
        ``(rows, L)`` keys (a flat sort), so a row's entries are ``row * L`` above its
        positions. The workspace ``Ws`` holds the sequences of all levels ``(levels, rows,
        L)``, from ``tot_off`` the count tables ``(n_tables, rows, n_blocks, R)`` and from
        ``ck_off`` the rank tables ``(n_tables, rows, n_ck, 2 R)``."""
        tl.static_assert(SUB % CHK == 0)
        blk = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        digits = tl.arange(0, R)
        hist = tl.zeros([R], dtype=tl.int32)
        zeros = tl.zeros([SUB // CHK, R], dtype=tl.int32)
        for sb in range(n_sub):
            offs = (blk * n_sub + sb) * SUB + tl.arange(0, SUB)
            ok = offs < L
            v = tl.load(Order + row * L + offs, mask=ok, other=0)
            if FLAT:
                v -= row * L
            v = v.to(tl.int32)
            tl.store(Ws + row * L + offs, v, mask=ok)
            d = (v >> shift0) & (R - 1)
            hit = (d[:, None] == digits[None, :]) & ok[:, None]
            hist += tl.sum(hit.to(tl.int32), 0)
            grp = (blk * n_sub + sb) * (SUB // CHK) + tl.arange(0, SUB // CHK)
            for t in range(n_tables):
                words = Ws + ck_off + ((t * rows + row) * n_ck + grp) * (2 * R) + R
                tl.store(words[:, None] + digits[None, :], zeros, mask=(grp < n_ck)[:, None])
        tot = Ws + tot_off
        tl.store(tot + (row * n_blocks + blk) * R + digits, hist)
        for t in range(1, n_tables):
            tl.store(tot + ((t * rows + row) * n_blocks + blk) * R + digits,
                     tl.zeros([R], dtype=tl.int32))

    @triton.jit(do_not_specialize=["level"])
    def _partition_kernel(Ws, L, rows, n_sub, n_blocks, n_ck, tot_off, ck_off, level, top,
                          R: tl.constexpr, RB: tl.constexpr, SUB: tl.constexpr,
                          CHK: tl.constexpr, TB: tl.constexpr, NEXT_COUNTS: tl.constexpr):
        """Level ``level``, block ``b`` of a row (see the module docstring). Reads the level's
        sequence and count table in the workspace ``Ws``, writes the next level's sequence, the
        level's rank table (from ``ck_off``: ``(levels - 1, rows, n_ck, 2 R)``, see
        :func:`_walk`) and, with ``NEXT_COUNTS``, adds the next level's block counts to its
        (zeroed) count table.

        The sequence lists the values node by node (a node: ``R * child`` consecutive values)
        and inside a node in rank order. Every node but the last is full, so the entries of a
        digit before a node number ``node_start / R``; with the row-wide count ``c`` of the
        entry's digit before it, the entry goes to ``node_start + digit * child + c -
        node_start / R`` of the next level (a stable partition of each node by digit).
        """
        tl.static_assert(CHK <= 32)
        blk = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        digits = tl.arange(0, R)
        shift = top - RB * (level + 1)
        seq_in = Ws + (level * rows + row) * L
        seq_out = Ws + ((level + 1) * rows + row) * L
        tot_in = Ws + tot_off + (level * rows + row) * n_blocks * R
        tot_out = Ws + tot_off + ((level + 1) * rows + row) * n_blocks * R
        ck = Ws + ck_off + (level * rows + row) * n_ck * (2 * R)
        # Per-digit counts of the blocks before this one (at most MAX_BLOCKS of them).
        before = tl.zeros([R], dtype=tl.int32)
        for j0 in range(0, blk, TB):
            j = j0 + tl.arange(0, TB)
            cnt = tl.load(tot_in + j[:, None] * R + digits[None, :],
                          mask=(j < blk)[:, None], other=0)
            before += tl.sum(cnt, 0)
        if blk == 0:
            tl.store(ck + digits, tl.zeros([R], dtype=tl.int32))
        child = 1 << shift
        span = n_sub * SUB
        for sb in range(n_sub):
            start = (blk * n_sub + sb) * SUB
            offs = start + tl.arange(0, SUB)
            ok = offs < L
            v = tl.load(seq_in + offs, mask=ok, other=0)
            d = (v >> shift) & (R - 1)
            hit = ((d[:, None] == digits[None, :]) & ok[:, None]).to(tl.int32)
            # Row-wide count of each digit up to and including every entry.
            incl = tl.cumsum(hit, 0) + before[None, :]
            same = tl.sum(tl.where(hit != 0, incl, 0), 1)
            # Counts: every digit's count before entry c * CHK, at the entries CHK - 1,
            # 2 CHK - 1, ... (a masked store: no reshaped copy of the tile).
            at_end = (((offs + 1) % CHK) == 0) & ok
            tl.store(ck + ((offs + 1) // CHK)[:, None] * (2 * R) + digits[None, :], incl,
                     mask=at_end[:, None])
            # Masks: each entry sets its bit in its group's word of its digit (the prep zeroed
            # the words; OR does not depend on the order).
            tl.atomic_or(ck + (offs // CHK) * (2 * R) + R + d, 1 << (offs % CHK), mask=ok,
                         sem="relaxed")
            before += tl.sum(hit, 0)
            # Stable partition into the next level.
            node = (v >> (shift + RB)) << (shift + RB)
            dest = node + d * child + (same - 1) - node // R
            tl.store(seq_out + dest, v, mask=ok)
            if NEXT_COUNTS:
                # The next level's per-block digit counts (it is partitioned in turn).
                nd = (v >> (shift - RB)) & (R - 1)
                tl.atomic_add(tot_out + (dest // span) * R + nd, 1, mask=ok, sem="relaxed")

    @triton.jit
    def _popc(x):
        """Set bits of every int32 lane (SWAR: pair, nibble and byte sums; the masks drop the
        sign bits an arithmetic shift brings in)."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24) & 0xFF

    @triton.jit
    def _walk(Ws, row, L, rows, n_levels, top, ck_off, n_ck, m, active, W,
              R: tl.constexpr, RB: tl.constexpr, CHK: tl.constexpr, BLOCK: tl.constexpr):
        """Per lane: the ``W``-th smallest of the level-0 sequence's first ``m`` entries (a
        walk down the tree, as kth_smallest_of_prefixes); lanes not ``active`` read no memory
        and get an unspecified value.

        At a node (start ``a``, its first ``m`` entries in the prefix, the ``kk``-th smallest
        wanted) ``le(d)``, the number of those entries with digit ``<= d``, is non-decreasing
        with ``le(R - 1) = m >= kk``; the child to descend into is ``pick``, the number of
        digits with ``le(d) < kk``. The prefix ends at entry ``x = a + m`` of the level's
        sequence; row ``c = x // CHK`` of the level's rank table holds, for every digit, its
        count before entry ``c * CHK`` and a bit mask of its entries among the next ``CHK``,
        so a digit's count before ``x`` is a count plus the set bits of a mask below ``x``,
        less the full nodes before ``a`` (``a / R`` entries of every digit), and ``le`` is
        their running sum. A level is one load of the row's ``2 R`` words, a scan and two
        reductions over the digits.
        """
        digits = tl.arange(0, R)
        a = tl.zeros([BLOCK], dtype=tl.int32)  # node start
        kk = tl.zeros([BLOCK], dtype=tl.int32) + W  # rank of the wanted value in the node
        for lev in range(n_levels - 1):
            shift = top - RB * (lev + 1)
            x = a + m
            c = x // CHK
            below_x = (1 << (x - c * CHK)) - 1  # bits of the group's entries before x
            tab = Ws + ck_off + ((lev * rows + row) * n_ck + c) * (2 * R)
            cnt = tl.load(tab[:, None] + digits[None, :], mask=active[:, None], other=0)
            bits = tl.load(tab[:, None] + R + digits[None, :], mask=active[:, None], other=0)
            le = tl.cumsum(cnt + _popc(bits & below_x[:, None]) - (a // R)[:, None], 1)
            under = le < kk[:, None]
            # le(pick - 1) and pick in one maximum (le < 2 ** 24 by available()), le(pick) in
            # one minimum.
            lo = tl.max(tl.where(under, le * (2 * R) + digits[None, :] + 1, 0), 1)
            upto = tl.min(tl.where(under, 0x7FFFFFFF, le), 1)
            below = lo // (2 * R)
            kk -= below
            m = upto - below
            a += (lo % (2 * R)) << shift
        # Last level: a node of at most R values a .. a+R-1, its first m entries in the
        # prefix; their values as bits of one word, whose kk-th set bit is the answer.
        tl.static_assert(R <= 32)
        last = Ws + ((n_levels - 1) * rows + row) * L
        tm = (digits[None, :] < m[:, None]) & active[:, None]
        w = tl.load(last + a[:, None] + digits[None, :], mask=tm, other=0) - a[:, None]
        present = tl.sum(tl.where(tm, 1 << w, 0), 1)
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = lo + (R - 1)
        for _ in tl.static_range(RB):
            mid = (lo + hi) >> 1
            up = _popc(present & ((2 << mid) - 1)) >= kk
            hi = tl.where(up, mid, hi)
            lo = tl.where(up, lo, mid + 1)
        return a + lo

    @triton.jit
    def _query_kernel(Ws, Sorted, Bounds, L, W, n_ck, rows, n_levels, top, ck_off,
                      R: tl.constexpr, RB: tl.constexpr, CHK: tl.constexpr,
                      BLOCK: tl.constexpr, F64: tl.constexpr, PACKED: tl.constexpr):
        """Keys of ranks ``i`` in the block: ``t`` = the W-th smallest position among the keys
        of ranks below ``max(i, W)`` (:func:`_walk`), then the key's bounds ``[key, t)``
        (empty when ``t <= key``).

        Every key past the first W ranks walks, also those no query will see: skipping them
        after a walk of the block's first rank (``t`` does not grow with the rank) costs that
        extra walk and measured no faster at 32K-128K keys (``tools/selection_probe.py``).
        """
        qb = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        i = qb * BLOCK + tl.arange(0, BLOCK)
        ok = i < L
        key = tl.load(Ws + row * L + i, mask=ok, other=0)  # level 0 is the rank order
        # Candidates have a finite or +inf key, the others -inf (packed int32 keys: a low half
        # of 0xFFFF). Compared in fp32 (exact for fp16/bf16/fp32 keys) or, for fp64 keys, in
        # fp64 (fp32 would overflow to -inf).
        if PACKED:
            s = tl.load(Sorted + row * L + i, mask=ok, other=0xFFFF)
            valid = (s & 0xFFFF) != 0xFFFF
        elif F64:
            s = tl.load(Sorted + row * L + i, mask=ok, other=float("-inf"))
            valid = s.to(tl.float64) > float("-inf")
        else:
            s = tl.load(Sorted + row * L + i, mask=ok, other=float("-inf"))
            valid = s.to(tl.float32) > float("-inf")
        # Fewer than W keys outrank the first W ranks: they are kept to the end, no walk.
        walk = ok & valid & (i >= W)
        t = _walk(Ws, row, L, rows, n_levels, top, ck_off, n_ck, tl.maximum(i, W), walk, W,
                  R=R, RB=RB, CHK=CHK, BLOCK=BLOCK)
        t = tl.where(i < W, L, t)
        keep = valid & ((i < W) | (walk & (t > key)))
        tl.store(Bounds + row * L + key, tl.where(keep, key, 0), mask=ok)
        tl.store(Bounds + (rows + row) * L + key, tl.where(keep, t, 0), mask=ok)


@functools.lru_cache(maxsize=64)
def _threshold_args(min_dtype: float, dtype: torch.dtype):
    """``(min_f32, min_hi, min_lo)``: the threshold converted to the bias dtype (as torch's
    comparison does), as an fp32 value, or for fp64 biases as the two int32 halves of its bits.
    Cached: the conversion is a host-side tensor op, not worth repeating every call."""
    value = torch.tensor(float(min_dtype), dtype=torch.float64).to(dtype).item()
    if dtype == torch.float64:
        bits = struct.unpack("<q", struct.pack("<d", value))[0]
        hi = bits >> 32
        lo = bits & 0xFFFFFFFF
        lo = lo - (1 << 32) if lo >= 1 << 31 else lo
        return 0.0, hi, lo
    return value, 0, 0


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a constexpr function (a few microseconds a host call).
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


class _Layout:
    """Sizes, grids and workspace offsets of a causal selection of ``rows`` rows of ``L`` keys."""

    __slots__ = ("radix", "rb", "levels", "top", "sub", "n_sub", "n_blocks", "n_ck", "tables",
                 "tot_off", "ck_off", "ws_numel", "grid", "query_grid")


@functools.lru_cache(maxsize=256)
def _layout(length, rows, rb, tile, max_blocks, check, query_block) -> _Layout:
    """The layout of one problem; cached (every argument is a key: the tests change the block
    sizes of this module)."""
    lay = _Layout()
    lay.rb = rb
    lay.radix = radix = 1 << rb
    bits = max(1, (length - 1).bit_length())
    lay.levels = levels = _cdiv(bits, rb)
    lay.top = levels * rb
    lay.sub = sub = tile // radix
    lay.n_sub = n_sub = _cdiv(_cdiv(length, sub), max_blocks)
    lay.n_blocks = n_blocks = _cdiv(length, sub * n_sub)
    lay.n_ck = n_ck = length // check + 1
    lay.tables = tables = max(levels - 1, 1)
    # Workspace (int32): the sequences (levels, rows, L), the block counts (tables, rows,
    # n_blocks, R), the rank tables (tables, rows, n_ck, 2 R); every part 128-byte aligned.
    lay.tot_off = _round_up(levels * rows * length, 32)
    lay.ck_off = lay.tot_off + _round_up(tables * rows * n_blocks * radix, 32)
    lay.ws_numel = lay.ck_off + tables * rows * n_ck * 2 * radix
    lay.grid = (n_blocks, rows)
    lay.query_grid = (_cdiv(length, query_block), rows)
    return lay


def _bias_strides(bias):
    """``(batch, head, key)`` strides of a ``(B|1, H, L)`` or ``(B|1, H, 1, L)`` bias; a batch
    of one broadcasts (stride 0)."""
    st = bias.stride()
    return (st[0] if bias.shape[0] != 1 else 0), st[1], st[-1]


def _launch_score(bias, padding, min_dtype, batch, heads, out, mode):
    length = bias.shape[-1]
    rows = batch * heads
    bb, bh, bl = _bias_strides(bias)
    if padding is not None:
        pad = padding.view(torch.uint8)
        pb = pad.stride(0) if pad.shape[0] != 1 else 0
        pl = pad.stride(1)
    else:
        pad, pb, pl = bias, 0, 0
    min_f32, min_hi, min_lo = _threshold_args(float(min_dtype), bias.dtype)
    launch(_score_kernel, (_cdiv(length, SCORE_BLOCK), rows),
           (bias, pad, out, min_f32, min_hi, min_lo, heads, length, rows,
            bb, bh, bl, pb, pl),
           dict(HAS_PAD=padding is not None, F64=bias.dtype == torch.float64, MODE=mode,
                ALWAYS=_ALWAYS, BLOCK=SCORE_BLOCK, num_warps=4))


def all_kept_bounds(bias, padding, min_dtype, batch, heads, is_causal) -> torch.Tensor:
    """``(2, B, H, L)`` int32 bounds when every candidate is kept (``L <= W``): one launch.
    ``bias`` ``(B|1, H, L)`` or ``(B|1, H, 1, L)``, any strides."""
    length = bias.shape[-1]
    bounds = torch.empty((2, batch, heads, length), dtype=torch.int32, device=bias.device)
    _launch_score(bias, padding, min_dtype, batch, heads, bounds, 1 if is_causal else 2)
    return bounds


def causal_bounds(bias, padding, min_dtype, window, batch, heads) -> torch.Tensor:
    """The causal top-``window`` bounds ``(2, B, H, L)`` int32, as the torch path computes them.

    ``bias`` ``(B|1, H, L)`` or ``(B|1, H, 1, L)`` (any strides), ``padding`` None or bool
    ``(B|1, L)``; requires ``window < L``. Host work: three allocations (sort key, workspace,
    bounds), the sort, ``levels + 2`` kernel launches.
    """
    length = bias.shape[-1]
    device = bias.device
    rows = batch * heads
    lay = _layout(length, rows, radix_bits(length), _TILE, MAX_BLOCKS, CHECK, QUERY_BLOCK)
    # Rank order: a stable descending sort (ties to the lower index, non-candidates last). A
    # 16-bit bias sorts as one flat int32 sort of (row, bias) keys: one radix sort over all rows
    # is several times cheaper on the GPU than torch's segmented sort of a (rows, L) tensor.
    packed = bias.element_size() == 2 and rows < (1 << 15)
    if packed:
        score = torch.empty((rows, length), dtype=torch.int32, device=device)
        _launch_score(bias, padding, min_dtype, batch, heads, score, 3)
        ranked, order = torch.sort(score.view(-1), stable=True)
    else:
        score = torch.empty((rows, length), dtype=bias.dtype, device=device)
        _launch_score(bias, padding, min_dtype, batch, heads, score, 0)
        ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)

    ws = torch.empty(lay.ws_numel, dtype=torch.int32, device=device)
    bounds = torch.empty((2, batch, heads, length), dtype=torch.int32, device=device)
    radix, rb, levels, top = lay.radix, lay.rb, lay.levels, lay.top
    launch(_prep_kernel, lay.grid,
           (order, ws, length, rows, lay.n_sub, lay.n_blocks, lay.tables, lay.n_ck, lay.tot_off,
            lay.ck_off, top - rb),
           dict(R=radix, SUB=lay.sub, CHK=CHECK, FLAT=packed, num_warps=4))
    for level in range(levels - 1):
        # The last level is only read by the queries: no counts for it.
        launch(_partition_kernel, lay.grid,
               (ws, length, rows, lay.n_sub, lay.n_blocks, lay.n_ck, lay.tot_off, lay.ck_off,
                level, top),
               dict(R=radix, RB=rb, SUB=lay.sub, CHK=CHECK, TB=MAX_BLOCKS,
                    NEXT_COUNTS=level + 2 < levels, num_warps=4))
    launch(_query_kernel, lay.query_grid,
           (ws, ranked, bounds, length, window, lay.n_ck, rows, levels, top, lay.ck_off),
           dict(R=radix, RB=rb, CHK=CHECK, BLOCK=QUERY_BLOCK,
                F64=bias.dtype == torch.float64, PACKED=packed, num_warps=QUERY_WARPS))
    return bounds
