"""Triton kernels of the planner: writing the per-tile key lists of key-interval masks.

The planner's plain-PyTorch path builds the lists with a sort of every (key, tile) pair; these
kernels write them in position order directly, without the sort and its (key, tile)-sized
temporaries, at a cost that follows the lists' length:

1. per key (a program per chunk of ``CHUNK`` keys): its query range ``[lo, hi)``; +1/-1 marks
   where the tiles it meets and the tiles it covers begin and end; per *coarse segment* of
   ``coarse_rows`` queries, how many of the chunk's keys meet the segment (a histogram of the
   segments where their ranges begin and end); and the chunk's live keys packed to its front;
2. prefix sums of those: every tile's list length, start and count of covering keys, and where
   each chunk's keys go in each coarse segment's list;
3. each coarse segment's list: the keys that meet the segment, in position order, with their
   ranges cut to the segment (a program per chunk and few segments, reading only the chunk's
   live keys);
4. each tile's list (and each backward segment's), read from its coarse segment's list (about
   ``window + coarse_rows`` entries) in one pass: the keys covering the tile go to the front
   of its list, the others after the covering count from step 2.

Step 3 visits each chunk's live keys once per segment any of them reaches: O(live keys * Lq /
coarse_rows) per row, in registers. Step 4 reads about ``window + coarse_rows`` entries per
tile, close to its list's ``window + block_m``; scanning every live key of the row for every
tile, twice, would read O(live keys * Lq / block_m). A tile whose segment's list ran past its
room (a broken window promise) or that straddles two segments reads the row's keys instead:
the same list, at that higher cost.
"""
from __future__ import annotations

import torch

from ..envs import interpret_mode
from ..intmath import cdiv, next_power_of_2
from ..triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the planner then uses its plain-PyTorch twins
    triton = None

# Entries a tile's fill reads per step.
SCAN_BLOCK = 1024
# Keys per program of the per-key kernels, and the granularity at which the keys meeting a
# coarse segment are counted (each chunk's keys get one slot range in each segment's list).
# The per-key kernels are latency bound at the lengths DMA is for: smaller chunks give them
# more programs (32K keys x 4 rows: 512), at the price of a longer prefix sum over chunks.
CHUNK = 256
# Query rows of a coarse segment, before rounding up to whole tiles. Larger segments make the
# per-segment passes cheaper (one visit of a chunk per segment) and every tile's read longer
# (a tile reads its segment's list: about window + coarse_rows entries).
COARSE_ROWS = 1024
# Coarse segments one program of the list writer handles: keys that stay seen for long reach
# many segments, and the programs of one chunk share them out.
SEG_GROUP = 8
# Live keys of a chunk the coarse lists' writer reads per step (one warp's program).
COARSE_SUB = 128
# A coarse list stores each key's range within the segment as two 16-bit offsets.
_MAX_COARSE_ROWS = (1 << 15) - 1


def available(device: torch.device) -> bool:
    """Whether the list kernels run for tensors on ``device``."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


def coarse_rows_for(block_m: int, segment_rows=None) -> int:
    """The coarse segment of a plan: the backward's segment when that is a whole number of
    forward tiles (its lists are then read by both), else ``COARSE_ROWS`` rounded up to
    whole tiles."""
    if segment_rows and segment_rows % block_m == 0 and segment_rows <= _MAX_COARSE_ROWS:
        return segment_rows
    return block_m * cdiv(COARSE_ROWS, block_m)


if triton is not None:

    @triton.jit
    def _coarse_slot(SegStart, SegLen, rs, seg_cap):
        """Where coarse list ``rs`` (= row * n_seg + segment) starts and how many entries fit:
        lists of ``seg_cap`` entries laid out back to back, or (``seg_cap == 0``) at
        ``SegStart`` with room for exactly their length."""
        if seg_cap > 0:
            start = rs * seg_cap
            room = seg_cap
        else:
            start = tl.load(SegStart + rs)
            room = tl.load(SegLen + rs)
        return start, room

    @triton.jit
    def _split_take(lo, hi, ok, q0, q1):
        """Which entries meet the tile ``[q0, q1)`` and cover all of it (part 0), or meet it
        and cover only some of it (part 1)."""
        meet = ok & (lo < q1) & (hi > q0)
        covers = (lo <= q0) & (hi >= q1)
        return meet & covers, meet & (covers == 0)

    @triton.jit
    def _place(take0, take1, n0, n1, full):
        """Slots in the tile's list of this step's takers: part 0 after the ``n0`` already
        placed, part 1 after all ``full`` of part 0 and the ``n1`` already placed (one scan
        of both counts, packed in 16-bit halves)."""
        inc = tl.cumsum(take0.to(tl.int32) + take1.to(tl.int32) * 65536, 0)
        return tl.where(take0, n0 + (inc & 0xFFFF) - 1, full + n1 + (inc >> 16) - 1)

    @triton.jit
    def _tile_pass(Lo, Hi, SegIdx, SegRng, row_lo, start, use_seg, n_src, s0, q0, q1, out,
                   full, cap, SCAN: tl.constexpr, WRITE: tl.constexpr):
        """One pass over a tile's source (its coarse segment's list when ``use_seg``, else
        the row's keys ``0 .. n_src``): counts of parts 0 and 1, written to ``out`` (cut at
        ``cap``) when ``WRITE``."""
        n0 = n_src * 0
        n1 = n_src * 0
        if use_seg:
            for c0 in range(0, n_src, SCAN):
                i = c0 + tl.arange(0, SCAN)
                ok = i < n_src
                rng = tl.load(SegRng + start + i, mask=ok, other=0)
                take0, take1 = _split_take((rng >> 16) + s0, (rng & 0xFFFF) + s0, ok, q0, q1)
                if WRITE:
                    at = _place(take0, take1, n0, n1, full)
                    take = take0 | take1
                    idx = tl.load(SegIdx + start + i, mask=take, other=0)
                    tl.store(out + at, idx, mask=take & (at < cap))
                n0 += tl.sum(take0.to(tl.int32), 0)
                n1 += tl.sum(take1.to(tl.int32), 0)
        else:
            for c0 in range(0, n_src, SCAN):
                j = c0 + tl.arange(0, SCAN)
                ok = j < n_src
                lo = tl.load(Lo + row_lo + j, mask=ok, other=0)
                hi = tl.load(Hi + row_lo + j, mask=ok, other=0)
                # Unlike a list's entries, the row's keys include dead ones (lo >= hi).
                take0, take1 = _split_take(lo, hi, ok & (lo < hi), q0, q1)
                if WRITE:
                    at = _place(take0, take1, n0, n1, full)
                    tl.store(out + at, j, mask=(take0 | take1) & (at < cap))
                n0 += tl.sum(take0.to(tl.int32), 0)
                n1 += tl.sum(take1.to(tl.int32), 0)
        return n0, n1

    @triton.jit
    def _fill_kernel(Lo, Hi, SegIdx, SegRng, SegStart, SegLen, TileStart, TileFull, TileLen,
                     Keys, Lq, Lk, pos_off, n_tiles, n_seg, seg_cap, cap,
                     BLOCK_M: tl.constexpr, SEG: tl.constexpr, SCAN: tl.constexpr,
                     CAUSAL: tl.constexpr, FIXED: tl.constexpr, COUNT_FULL: tl.constexpr,
                     STORE_LEN: tl.constexpr):
        """Tile ``m`` of row ``r``: the keys every query of the tile sees (``TileFull`` of
        them, counted here first when ``COUNT_FULL``), then those only some see, each group
        in position order, at ``TileStart`` (or ``(r * n_tiles + m) * cap`` when ``FIXED``)
        and cut at ``cap`` entries; with ``STORE_LEN`` the cut length into ``TileLen``."""
        m = tl.program_id(0)
        r = tl.program_id(1)
        q0 = m * BLOCK_M
        q1 = tl.minimum(q0 + BLOCK_M, Lq)
        if FIXED:
            out = Keys + (r * n_tiles + m).to(tl.int64) * cap
        else:
            out = Keys + tl.load(TileStart + r * n_tiles + m)
        s = q0 // SEG
        rs = r * n_seg + s
        n_list = tl.load(SegLen + rs)
        start, room = _coarse_slot(SegStart, SegLen, rs, seg_cap)
        # The segment's list holds every key meeting the tile if the tile lies within the
        # segment and the list fitted its room; else the row's keys are read.
        use_seg = ((q1 - 1) // SEG == s) & (n_list <= room)
        bound = Lk
        if CAUSAL:
            # Keys after the tile's last query position are hidden from the whole tile.
            bound = tl.minimum(tl.maximum(q1 - pos_off, 0), Lk)
        n_src = tl.where(use_seg, n_list, bound)
        row_lo = r * Lk
        if COUNT_FULL:
            full, _ = _tile_pass(Lo, Hi, SegIdx, SegRng, row_lo, start, use_seg, n_src, s * SEG,
                                 q0, q1, out, 0, cap, SCAN=SCAN, WRITE=False)
            tl.store(TileFull + r * n_tiles + m, full)
        else:
            full = tl.load(TileFull + r * n_tiles + m)
        n0, n1 = _tile_pass(Lo, Hi, SegIdx, SegRng, row_lo, start, use_seg, n_src, s * SEG,
                            q0, q1, out, full, cap, SCAN=SCAN, WRITE=True)
        if STORE_LEN:
            tl.store(TileLen + r * n_tiles + m, tl.minimum(n0 + n1, cap))

    @triton.jit
    def _ranges_kernel(Bounds, Lo, Hi, OrderKey, TileDiff, FullDiff, SegCount, CIdx, CLo, CHi,
                       ChunkInfo, Hides, Lq, Lk, pos_off, plane, n_tiles, n_chunks, n_seg, span,
                       n_buckets, end_bucket, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                       SEG: tl.constexpr, NB: tl.constexpr, CAUSAL: tl.constexpr,
                       ORDER: tl.constexpr):
        """Per key: its query range ``[lo, hi)`` and (``ORDER``) the backward's grouping key;
        per tile: +1/-1 where a live key's met tiles and covered tiles begin and end; per
        (coarse segment, chunk): how many of the chunk's keys meet the segment; per chunk:
        its live keys (index and range) at the front of its slots of ``CIdx``/``CLo``/``CHi``,
        their number and the coarse segments they reach (``ChunkInfo``)."""
        c = tl.program_id(0)
        r = tl.program_id(1)
        j = c * CHUNK + tl.arange(0, CHUNK)
        ok = j < Lk
        start = tl.load(Bounds + r * Lk + j, mask=ok, other=0)
        end = tl.load(Bounds + plane + r * Lk + j, mask=ok, other=0)
        lo = start + pos_off
        if CAUSAL:
            lo = tl.maximum(lo, j + pos_off)
        lo = tl.minimum(tl.maximum(lo, 0), Lq)
        hi = tl.minimum(tl.maximum(end + pos_off, 0), Lq)
        live = ok & (lo < hi)
        # Does the mask hide a pair that is_causal alone would show?
        plain = tl.zeros([CHUNK], tl.int32)
        if CAUSAL:
            plain = tl.minimum(tl.maximum(j + pos_off, 0), Lq)
        hides = ok & ((lo > plain) | ((hi < Lq) & (plain < Lq)))
        tl.atomic_max(Hides, tl.max(hides.to(tl.int32), 0))
        tl.store(Lo + r * Lk + j, lo, mask=ok)
        tl.store(Hi + r * Lk + j, hi, mask=ok)
        if ORDER:
            # Long ranges first (latest end bucket), then by start; dead keys last.
            key = (n_buckets - hi // end_bucket).to(tl.int64) * span + lo
            key = tl.where(live, key, (n_buckets + 1).to(tl.int64) * span)
            tl.store(OrderKey + r * Lk + j, key, mask=ok)
        one = tl.full([CHUNK], 1, tl.int32)
        diff = r * (n_tiles + 1)
        tl.atomic_add(TileDiff + diff + lo // BLOCK_M, one, mask=live)
        tl.atomic_add(TileDiff + diff + (hi - 1) // BLOCK_M + 1, -one, mask=live)
        # Covered tiles: from the first starting at or after lo to the last ending at or
        # before hi (the last tile ends at Lq).
        f0 = (lo + BLOCK_M - 1) // BLOCK_M
        f1 = tl.where(hi >= Lq, n_tiles, hi // BLOCK_M)
        covers = live & (f0 < f1)
        tl.atomic_add(FullDiff + diff + f0, one, mask=covers)
        tl.atomic_add(FullDiff + diff + f1, -one, mask=covers)
        # A key meets segments lo // SEG .. (hi - 1) // SEG: the running sum of the begin and
        # end histograms counts the chunk's keys meeting each (dead keys cancel in bin 0).
        first = tl.where(live, lo // SEG, 0)
        after = tl.where(live, (hi - 1) // SEG + 1, 0)
        count = tl.cumsum(tl.histogram(first, NB) - tl.histogram(after, NB), 0)
        s = tl.arange(0, NB)
        tl.store(SegCount + (r * n_seg + s) * n_chunks + c, count, mask=s < n_seg)
        # The coarse lists' writer reads only the live keys, most chunks having few.
        at = r * Lk + c * CHUNK + tl.cumsum(live.to(tl.int32), 0) - 1
        tl.store(CIdx + at, j, mask=live)
        tl.store(CLo + at, lo, mask=live)
        tl.store(CHi + at, hi, mask=live)
        info = ChunkInfo + (r * n_chunks + c) * 3
        tl.store(info, tl.sum(live.to(tl.int32), 0))
        tl.store(info + 1, tl.min(tl.where(live, first, n_seg), 0))
        tl.store(info + 2, tl.max(after, 0))

    @triton.jit
    def _scan_kernel(TileDiff, FullDiff, TileLen, TileStart, TileFull, RowTotal, SegCount,
                     SegLen, n_tiles, n_chunks, n_seg, cap, TB: tl.constexpr, CB: tl.constexpr):
        """Program 0 of a row: the tiles' list lengths and covering counts (prefix sums of
        the +1/-1 marks), their starts (within the row, or at ``(row * n_tiles + tile) * cap``
        with the lengths cut at ``cap`` when ``cap > 0``) and the row's total. Program
        ``1 + s``: where each chunk's keys begin in coarse segment ``s``'s list (in place of
        their counts), and the list's length."""
        r = tl.program_id(0)
        k = tl.program_id(1)
        if k == 0:
            run = 0
            run_full = 0
            start = 0
            for t0 in range(0, n_tiles, TB):
                t = t0 + tl.arange(0, TB)
                ok = t < n_tiles
                d = tl.load(TileDiff + r * (n_tiles + 1) + t, mask=ok, other=0)
                f = tl.load(FullDiff + r * (n_tiles + 1) + t, mask=ok, other=0)
                length = run + tl.cumsum(d, 0)
                tl.store(TileFull + r * n_tiles + t, run_full + tl.cumsum(f, 0), mask=ok)
                length = tl.where(ok, length, 0)
                if cap > 0:
                    tl.store(TileLen + r * n_tiles + t, tl.minimum(length, cap), mask=ok)
                    tl.store(TileStart + r * n_tiles + t, (r * n_tiles + t) * cap, mask=ok)
                else:
                    tl.store(TileLen + r * n_tiles + t, length, mask=ok)
                    tl.store(TileStart + r * n_tiles + t, start + tl.cumsum(length, 0) - length,
                             mask=ok)
                run += tl.sum(d, 0)
                run_full += tl.sum(f, 0)
                start += tl.sum(length, 0)
            tl.store(RowTotal + r, start)
        else:
            row = SegCount + (r * n_seg + k - 1) * n_chunks
            total = 0
            for c0 in range(0, n_chunks, CB):
                c = c0 + tl.arange(0, CB)
                ok = c < n_chunks
                cnt = tl.load(row + c, mask=ok, other=0)
                tl.store(row + c, total + tl.cumsum(cnt, 0) - cnt, mask=ok)
                total += tl.sum(cnt, 0)
            tl.store(SegLen + r * n_seg + k - 1, total)

    @triton.jit
    def _coarse_kernel(CIdx, CLo, CHi, ChunkInfo, SegCount, SegStart, SegLen, SegIdx, SegRng,
                       Lq, Lk, n_chunks, n_seg, seg_cap, CHUNK: tl.constexpr, SEG: tl.constexpr,
                       GROUP: tl.constexpr, SUB: tl.constexpr):
        """Chunk ``c`` of row ``r``'s live keys into the coarse lists of segments ``g * GROUP
        ..`` that they meet: key index and range within the segment (``lo << 16 | hi``,
        offsets from its first query), at the chunk's slots (entries past a list's room are
        dropped). The live keys are read ``SUB`` at a time."""
        c = tl.program_id(0)
        g = tl.program_id(1)
        r = tl.program_id(2)
        info = ChunkInfo + (r * n_chunks + c) * 3
        n_live = tl.load(info)
        s_begin = tl.maximum(tl.load(info + 1), g * GROUP)
        s_end = tl.minimum(tl.load(info + 2), g * GROUP + GROUP)
        row = r * Lk + c * CHUNK
        for s in range(s_begin, s_end):
            rs = r * n_seg + s
            start, room = _coarse_slot(SegStart, SegLen, rs, seg_cap)
            s0 = s * SEG
            s1 = tl.minimum(s0 + SEG, Lq)
            base = tl.load(SegCount + rs * n_chunks + c)
            for i0 in range(0, n_live, SUB):
                i = i0 + tl.arange(0, SUB)
                ok = i < n_live
                lo = tl.load(CLo + row + i, mask=ok, other=0)
                hi = tl.load(CHi + row + i, mask=ok, other=0)
                meet = ok & (lo < s1) & (hi > s0)
                at = base + tl.cumsum(meet.to(tl.int32), 0) - 1
                keep = meet & (at < room)
                idx = tl.load(CIdx + row + i, mask=keep, other=0)
                rng = tl.minimum(tl.maximum(lo - s0, 0), SEG) * 65536 + tl.minimum(hi - s0, SEG)
                tl.store(SegIdx + start + at, idx, mask=keep)
                tl.store(SegRng + start + at, rng, mask=keep)
                base += tl.sum(meet.to(tl.int32), 0)

    @triton.jit
    def _blocks_kernel(Order, OrderKey, Lo, Hi, BlkKeys, BlkQlo, BlkQhi, Lq, Lk, n_blk,
                       dead_key, BLOCK_N: tl.constexpr):
        """Key blocks of ``BLOCK_N`` consecutive keys of each row's sorted order: their
        indices (-1 for dead keys and padding) and the union of their query ranges."""
        blk = tl.program_id(0)
        r = blk // n_blk
        i = (blk % n_blk) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = i < Lk
        key = tl.load(OrderKey + r * Lk + i, mask=ok, other=dead_key)
        idx = tl.load(Order + r * Lk + i, mask=ok, other=0).to(tl.int32)
        live = key < dead_key
        lo = tl.load(Lo + r * Lk + idx, mask=live, other=Lq)
        hi = tl.load(Hi + r * Lk + idx, mask=live, other=0)
        tl.store(BlkKeys + blk * BLOCK_N + tl.arange(0, BLOCK_N), tl.where(live, idx, -1))
        tl.store(BlkQlo + blk, tl.min(lo, 0))
        tl.store(BlkQhi + blk, tl.max(hi, 0))

    @triton.jit
    def _items_kernel(SegKeys, SegLen, Lo, Hi, BlkKeys, BlkQlo, BlkQhi, Lq, Lk, n_seg, n_items,
                      cap, SEG: tl.constexpr, BLOCK_N: tl.constexpr):
        """Segment items: keys ``c * BLOCK_N ..`` of a segment's list (-1 past its end) and
        the union of their query ranges cut to the segment (``[Lq, 0)`` when empty)."""
        it = tl.program_id(0)
        c = it % n_items
        rs = it // n_items  # row * n_seg + segment
        s = rs % n_seg
        r = rs // n_seg
        n = tl.load(SegLen + rs)
        i = c * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = i < n
        idx = tl.load(SegKeys + rs.to(tl.int64) * cap + i, mask=ok, other=-1)
        q0 = s * SEG
        q1 = tl.minimum(q0 + SEG, Lq)
        lo = tl.load(Lo + r * Lk + idx, mask=ok, other=Lq)
        hi = tl.load(Hi + r * Lk + idx, mask=ok, other=0)
        lo = tl.where(ok, tl.maximum(lo, q0), Lq)
        hi = tl.where(ok, tl.minimum(hi, q1), 0)
        tl.store(BlkKeys + it.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N), idx)
        tl.store(BlkQlo + it, tl.min(lo, 0))
        tl.store(BlkQhi + it, tl.max(hi, 0))


class _Coarse:
    """A plan's coarse segment lists: ``seg_idx``/``seg_rng`` hold list ``row * n_seg + s``
    at ``(row * n_seg + s) * seg_cap`` (or at ``seg_start`` when ``seg_cap == 0``), its
    length (before any cut) in ``seg_len``."""

    __slots__ = ("rows_per_seg", "n_seg", "seg_cap", "seg_idx", "seg_rng", "seg_start",
                 "seg_len")

    def __init__(self, rows_per_seg, n_seg, seg_cap, seg_idx, seg_rng, seg_start, seg_len):
        self.rows_per_seg, self.n_seg, self.seg_cap = rows_per_seg, n_seg, seg_cap
        self.seg_idx, self.seg_rng, self.seg_start, self.seg_len = (seg_idx, seg_rng, seg_start,
                                                                    seg_len)


def plan_fast(bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n, backward, end_bucket,
              capacity=None, segment_rows=None, segment_capacity=None, coarse_rows=None):
    """The planner on the device in a handful of launches and (without ``capacity``) one host
    wait (the lists' total length, and whether the mask hides anything beyond ``is_causal``).

    Returns None for a mask that hides nothing (the caller runs the dense kernels), else
    ``(tile_start, tile_len, tile_full, keys, blocks)`` with ``blocks`` None or ``(blk_keys,
    blk_qlo, blk_qhi)``: the same lists as the plain-PyTorch planner.

    ``capacity``: a bound on any tile's list length that the caller guarantees (and a mask
    known to hide something). Each tile's list then starts at ``(row * n_tiles + tile) *
    capacity`` and nothing waits for the device: the same lists, laid out with gaps.

    ``segment_rows`` (with ``capacity`` and ``segment_capacity``, a multiple of ``block_n``):
    the backward's blocks are segment items (:func:`.key_lists.segment_items`) instead of
    key blocks.

    ``coarse_rows``: the coarse segment (see the module docstring; a multiple of ``block_m``
    for the tiles to read its lists); by default :func:`coarse_rows_for`.
    """
    if segment_rows and backward and capacity is None:
        raise ValueError("segment items need a capacity (a window promise)")
    rows = bounds.shape[1] * bounds.shape[2]
    lk, lq = seqlen_k, seqlen_q
    device = bounds.device
    n_chunks = max(1, cdiv(lk, CHUNK))
    n_tiles = max(1, cdiv(lq, block_m))
    seg = coarse_rows or coarse_rows_for(block_m, segment_rows if backward else None)
    if not 0 < seg <= _MAX_COARSE_ROWS:
        raise ValueError(f"coarse_rows must be in 1..{_MAX_COARSE_ROWS}, got {seg}")
    n_seg = max(1, cdiv(lq, seg))
    span = lq + 1
    n_buckets = cdiv(span, end_bucket) + 1
    key_blocks = backward and not segment_rows
    # Two allocations for every int32 buffer: one zeroed (counters, and the small per-tile
    # outputs, which the plan keeps), one not (the rest: freed on return).
    zeroed = torch.zeros(2 * rows * (n_tiles + 1) + rows * n_seg * n_chunks + 1
                         + 3 * rows * n_tiles, dtype=torch.int32, device=device)
    tile_diff, full_diff, seg_count, hides, tile_len, tile_start, tile_full = zeroed.split(
        [rows * (n_tiles + 1)] * 2 + [rows * n_seg * n_chunks, 1] + [rows * n_tiles] * 3)
    # Under a capacity the coarse lists get room for window + coarse_rows - 1 keys each
    # (capacity = window + block_m - 1); a list that runs past it is not read.
    seg_cap = max(1, min(lk, capacity + seg - block_m)) if capacity is not None and lk else 0
    n_coarse = rows * n_seg * seg_cap
    sizes = [rows * lk] * 5 + [rows, rows * n_seg, rows * n_chunks * 3] + [n_coarse] * 2
    ws = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    (lo, hi, c_idx, c_lo, c_hi, row_total, seg_len, chunk_info, seg_idx,
     seg_rng) = ws.split(sizes)
    lo, hi = lo.view(rows, lk), hi.view(rows, lk)
    chunks = (c_idx, c_lo, c_hi, chunk_info)
    tile_len, tile_start, tile_full = (t.view(rows, n_tiles)
                                       for t in (tile_len, tile_start, tile_full))
    order_key = (torch.empty((rows, lk), dtype=torch.int64, device=device) if key_blocks
                 else lo)
    b = bounds.contiguous()
    if lk:
        launch(_ranges_kernel, (n_chunks, rows),
               (b, lo, hi, order_key, tile_diff, full_diff, seg_count, *chunks, hides, lq, lk,
                lq - lk, rows * lk, n_tiles, n_chunks, n_seg, span, n_buckets, end_bucket),
               dict(BLOCK_M=block_m, CHUNK=CHUNK, SEG=seg, NB=next_power_of_2(n_seg + 1),
                    CAUSAL=bool(is_causal), ORDER=key_blocks, num_warps=4))
    launch(_scan_kernel, (rows, 1 + n_seg),
           (tile_diff, full_diff, tile_len, tile_start, tile_full, row_total, seg_count,
            seg_len, n_tiles, n_chunks, n_seg, capacity if capacity is not None else 0),
           dict(TB=1024, CB=256, num_warps=4))
    coarse = _Coarse(seg, n_seg, seg_cap, seg_idx, seg_rng, seg_len, seg_len)
    if capacity is None:
        row_base = torch.cumsum(row_total, 0, dtype=torch.int32) - row_total
        seg_start = torch.cumsum(seg_len, 0, dtype=torch.int32) - seg_len
        stats = torch.cat([row_base[-1:] + row_total[-1:], hides, seg_start[-1:] + seg_len[-1:]])
    elif lk:
        # The coarse lists' room is known without waiting: write them now (without a
        # capacity they are sized exactly once the host has their total).
        _write_coarse(chunks, seg_count, coarse, rows, lq, lk)
    blocks = None
    if backward and segment_rows:
        blocks = _segment_items(lo, hi, coarse, lq, lq - lk, segment_rows, segment_capacity,
                                block_n, is_causal)
    elif backward:
        sorted_key, order = torch.sort(order_key, dim=1, stable=True)
        n_blk = max(1, cdiv(lk, block_n))
        blk = torch.empty(rows * n_blk * (block_n + 2), dtype=torch.int32, device=device)
        blk_keys, blk_qlo, blk_qhi = blk.split([rows * n_blk * block_n, rows * n_blk,
                                                rows * n_blk])
        blk_keys = blk_keys.view(rows * n_blk, block_n)
        if lk:
            launch(_blocks_kernel, (rows * n_blk,),
                   (order, sorted_key, lo, hi, blk_keys, blk_qlo, blk_qhi, lq, lk, n_blk,
                    (n_buckets + 1) * span),
                   dict(BLOCK_N=block_n, num_warps=4))
        else:
            blk_keys.fill_(-1)
            blk_qlo.fill_(lq)
            blk_qhi.zero_()
        blocks = (blk_keys, blk_qlo, blk_qhi)
    if capacity is not None:
        total = rows * n_tiles * capacity
    else:
        total, hidden, seg_total = stats.tolist()
        if not hidden:
            return None
        tile_start += row_base[:, None]
        if total:
            coarse_buf = torch.empty(2 * seg_total, dtype=torch.int32, device=device)
            coarse.seg_idx, coarse.seg_rng = coarse_buf.split([seg_total, seg_total])
            coarse.seg_start = seg_start
            _write_coarse(chunks, seg_count, coarse, rows, lq, lk)
    keys = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        cap = capacity if capacity is not None else total
        launch(_fill_kernel, (n_tiles, rows),
               (lo, hi, coarse.seg_idx, coarse.seg_rng, coarse.seg_start, coarse.seg_len,
                tile_start, tile_full, tile_len, keys, lq, lk, lq - lk, n_tiles, n_seg, seg_cap,
                cap),
               dict(BLOCK_M=block_m, SEG=seg, SCAN=SCAN_BLOCK, CAUSAL=bool(is_causal),
                    FIXED=capacity is not None, COUNT_FULL=False, STORE_LEN=False,
                    num_warps=4))
    return tile_start, tile_len, tile_full, keys, blocks


def _write_coarse(chunks, seg_count, coarse, rows, seqlen_q, seqlen_k):
    """Write every coarse segment's list from the chunks' live keys (``chunks``: the
    ranges kernel's ``CIdx, CLo, CHi, ChunkInfo``; ``seg_count`` holds each chunk's slot in
    each list)."""
    n_chunks = max(1, cdiv(seqlen_k, CHUNK))
    launch(_coarse_kernel, (n_chunks, cdiv(coarse.n_seg, SEG_GROUP), rows),
           (*chunks, seg_count, coarse.seg_start, coarse.seg_len, coarse.seg_idx, coarse.seg_rng,
            seqlen_q, seqlen_k, n_chunks, coarse.n_seg, coarse.seg_cap),
           dict(CHUNK=CHUNK, SEG=coarse.rows_per_seg, GROUP=SEG_GROUP,
                SUB=min(CHUNK, COARSE_SUB), num_warps=1))


def _segment_items(lo, hi, coarse, seqlen_q, pos_off, segment_rows, capacity, block_n,
                   is_causal):
    """``(blk_keys, blk_qlo, blk_qhi)`` of the segment items: each segment's list written by
    the tile-list kernel at ``segment_rows`` queries a tile, then cut into items."""
    rows, lk = lo.shape
    device = lo.device
    n_seg = max(1, cdiv(seqlen_q, segment_rows))
    n_items = capacity // block_n
    n_blk = rows * n_seg * n_items
    buf = torch.empty(rows * n_seg * (capacity + 2) + n_blk * (block_n + 2), dtype=torch.int32,
                      device=device)
    seg_keys, seg_full, seg_len, blk_keys, blk_qlo, blk_qhi = buf.split(
        [rows * n_seg * capacity] + [rows * n_seg] * 2 + [n_blk * block_n, n_blk, n_blk])
    if lk:
        launch(_fill_kernel, (n_seg, rows),
               (lo, hi, coarse.seg_idx, coarse.seg_rng, coarse.seg_start, coarse.seg_len,
                seg_len, seg_full, seg_len, seg_keys, seqlen_q, lk, pos_off, n_seg, coarse.n_seg,
                coarse.seg_cap, capacity),
               dict(BLOCK_M=segment_rows, SEG=coarse.rows_per_seg, SCAN=SCAN_BLOCK,
                    CAUSAL=bool(is_causal), FIXED=True, COUNT_FULL=True, STORE_LEN=True,
                    num_warps=4))
    else:
        seg_len.zero_()
    launch(_items_kernel, (n_blk,),
           (seg_keys, seg_len, lo, hi, blk_keys, blk_qlo, blk_qhi, seqlen_q, lk, n_seg, n_items,
            capacity),
           dict(SEG=segment_rows, BLOCK_N=block_n, num_warps=4))
    return blk_keys.view(n_blk, block_n), blk_qlo, blk_qhi
