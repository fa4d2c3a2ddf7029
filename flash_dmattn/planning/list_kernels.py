"""Triton kernels of the planner: writing the per-tile key lists of key-interval masks.

The planner's plain-PyTorch path builds the lists with a sort of every (key, tile) pair; a
kernel that lets each query tile scan its row's live keys writes them in position order
directly, without the sort and its (key, tile)-sized temporaries.
"""
from __future__ import annotations

import torch

from ..envs import interpret_mode

try:
    import triton
    import triton.language as tl
except ImportError:  # the planner then uses its plain-PyTorch twins
    triton = None

SCAN_BLOCK = 512


def available(device: torch.device) -> bool:
    """Whether the list kernels run for tensors on ``device``."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


if triton is not None:

    @triton.jit
    def _upper_bound(seq, n, value):
        """How many of the first ``n`` (ascending) entries of ``seq`` are ``<= value``."""
        lo = n * 0
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            below = tl.load(seq + mid) <= value
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        return lo

    @triton.jit
    def _fill_kernel(CIdx, CLo, CHi, NLive, nlive_stride, TileStart, TileFull, TileLen, Keys,
                     Lq, pos_off, n_tiles, Lk, cap, BLOCK_M: tl.constexpr, SCAN: tl.constexpr,
                     CAUSAL: tl.constexpr, STORE_LEN: tl.constexpr):
        m = tl.program_id(0)
        r = tl.program_id(1)
        q0 = m * BLOCK_M
        q1 = tl.minimum(q0 + BLOCK_M, Lq)
        n = tl.load(NLive + r * nlive_stride)
        row_idx = CIdx + r * Lk
        if CAUSAL:
            # Keys after the tile's last query position are hidden from the whole tile.
            n = _upper_bound(row_idx, n, q1 - 1 - pos_off)
        out = Keys + tl.load(TileStart + r * n_tiles + m)
        # Two passes: the keys every query of the tile sees, then those only some see.
        count = 0
        for part in tl.static_range(2):
            for c0 in range(0, n, SCAN):
                offs = c0 + tl.arange(0, SCAN)
                ok = offs < n
                lo = tl.load(CLo + r * Lk + offs, mask=ok, other=0)
                hi = tl.load(CHi + r * Lk + offs, mask=ok, other=0)
                covers = (lo <= q0) & (hi >= q1)
                if part == 0:
                    take = ok & covers
                else:
                    take = ok & (lo < q1) & (hi > q0) & (covers == 0)
                at = tl.cumsum(take.to(tl.int32), 0) - 1
                idx = tl.load(row_idx + offs, mask=ok, other=0)
                tl.store(out + count + at, idx, mask=take & (count + at < cap))
                count += tl.sum(take.to(tl.int32), 0)
            if part == 0:
                tl.store(TileFull + r * n_tiles + m, count)
        if STORE_LEN:
            tl.store(TileLen + r * n_tiles + m, tl.minimum(count, cap))


if triton is not None:

    @triton.jit
    def _ranges_kernel(Bounds, Lo, Hi, OrderKey, ChunkCount, TileDiff, Hides, Lq, Lk, pos_off,
                       plane, n_tiles, n_chunks, span, n_buckets, end_bucket,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
        """Per key: its query range ``[lo, hi)``, the backward's grouping key; per chunk of
        keys: how many are live; per tile: +1/-1 where a live key's tiles begin and end."""
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
        # Long ranges first (latest end bucket), then by start; dead keys last.
        key = (n_buckets - hi // end_bucket).to(tl.int64) * span + lo
        key = tl.where(live, key, (n_buckets + 1).to(tl.int64) * span)
        tl.store(OrderKey + r * Lk + j, key, mask=ok)
        tl.store(ChunkCount + r * n_chunks + c, tl.sum(live.to(tl.int32), 0))
        one = tl.full([CHUNK], 1, tl.int32)
        tl.atomic_add(TileDiff + r * (n_tiles + 1) + lo // BLOCK_M, one, mask=live)
        tl.atomic_add(TileDiff + r * (n_tiles + 1) + (hi - 1) // BLOCK_M + 1, -one, mask=live)

    @triton.jit
    def _scan_kernel(TileDiff, TileLen, TileStart, RowTotal, ChunkCount, ChunkEnd, n_tiles,
                     n_chunks, TB: tl.constexpr, CB: tl.constexpr):
        """Per row: the tiles' list lengths (prefix sums of the +1/-1 marks), their starts
        within the row, the row's total, and the end of each chunk's live keys."""
        r = tl.program_id(0)
        run = 0
        start = 0
        for t0 in range(0, n_tiles, TB):
            t = t0 + tl.arange(0, TB)
            ok = t < n_tiles
            d = tl.load(TileDiff + r * (n_tiles + 1) + t, mask=ok, other=0)
            length = run + tl.cumsum(d, 0)
            tl.store(TileLen + r * n_tiles + t, length, mask=ok)
            length = tl.where(ok, length, 0)
            tl.store(TileStart + r * n_tiles + t, start + tl.cumsum(length, 0) - length, mask=ok)
            run += tl.sum(d, 0)
            start += tl.sum(length, 0)
        tl.store(RowTotal + r, start)
        live = 0
        for c0 in range(0, n_chunks, CB):
            c = c0 + tl.arange(0, CB)
            ok = c < n_chunks
            cnt = tl.load(ChunkCount + r * n_chunks + c, mask=ok, other=0)
            tl.store(ChunkEnd + r * n_chunks + c, live + tl.cumsum(cnt, 0), mask=ok)
            live += tl.sum(cnt, 0)

    @triton.jit
    def _compact_kernel(Lo, Hi, ChunkEnd, ChunkCount, CIdx, CLo, CHi, Lk, n_chunks,
                        CHUNK: tl.constexpr):
        """Each row's live keys in position order at the front of ``CIdx``/``CLo``/``CHi``."""
        c = tl.program_id(0)
        r = tl.program_id(1)
        j = c * CHUNK + tl.arange(0, CHUNK)
        ok = j < Lk
        lo = tl.load(Lo + r * Lk + j, mask=ok, other=0)
        hi = tl.load(Hi + r * Lk + j, mask=ok, other=0)
        live = ok & (lo < hi)
        base = tl.load(ChunkEnd + r * n_chunks + c) - tl.load(ChunkCount + r * n_chunks + c)
        at = base + tl.cumsum(live.to(tl.int32), 0) - 1
        tl.store(CIdx + r * Lk + at, j, mask=live)
        tl.store(CLo + r * Lk + at, lo, mask=live)
        tl.store(CHi + r * Lk + at, hi, mask=live)

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


def plan_fast(bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n, backward, end_bucket,
              capacity=None, segment_rows=None, segment_capacity=None):
    """The planner on the device in ~10 launches and one host wait (the lists' total length,
    and whether the mask hides anything beyond ``is_causal``).

    Returns None for a mask that hides nothing (the caller runs the dense kernels), else
    ``(tile_start, tile_len, tile_full, keys, blocks)`` with ``blocks`` None or ``(blk_keys,
    blk_qlo, blk_qhi)``: the same lists as the plain-PyTorch planner.

    ``capacity``: a bound on any tile's list length that the caller guarantees (and a mask
    known to hide something). Each tile's list then starts at ``(row * n_tiles + tile) *
    capacity`` and nothing waits for the device: the same lists, laid out with gaps.

    ``segment_rows`` (with ``capacity`` and ``segment_capacity``, a multiple of ``block_n``):
    the backward's blocks are segment items (:func:`.key_lists.segment_items`) instead of
    key blocks.
    """
    rows = bounds.shape[1] * bounds.shape[2]
    lk, lq = seqlen_k, seqlen_q
    device = bounds.device
    chunk = 1024
    n_chunks = max(1, -(-lk // chunk))
    n_tiles = max(1, -(-lq // block_m))
    span = lq + 1
    n_buckets = -(-span // end_bucket) + 1
    # Two allocations for every int32 buffer: one zeroed (counters), one not.
    zeroed = torch.zeros(rows * (n_tiles + 1) + 1, dtype=torch.int32, device=device)
    tile_diff, hides = zeroed[:-1].view(rows, n_tiles + 1), zeroed[-1:]
    sizes = [rows * lk] * 5 + [rows * n_chunks] * 2 + [rows * n_tiles] * 3 + [rows]
    ws = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    (lo, hi, c_idx, c_lo, c_hi, chunk_count, chunk_end, tile_len, tile_start, tile_full,
     row_total) = ws.split(sizes)
    lo, hi, c_idx, c_lo, c_hi = (t.view(rows, lk) for t in (lo, hi, c_idx, c_lo, c_hi))
    tile_len, tile_start, tile_full = (t.view(rows, n_tiles)
                                       for t in (tile_len, tile_start, tile_full))
    order_key = torch.empty((rows, lk), dtype=torch.int64, device=device)
    b = bounds.contiguous()
    if lk:
        _ranges_kernel[(n_chunks, rows)](
            b, lo, hi, order_key, chunk_count, tile_diff, hides, lq, lk, lq - lk, rows * lk,
            n_tiles, n_chunks, span, n_buckets, end_bucket, BLOCK_M=block_m, CHUNK=chunk,
            CAUSAL=bool(is_causal), num_warps=4)
    else:
        chunk_count.zero_()
    _scan_kernel[(rows,)](tile_diff, tile_len, tile_start, row_total, chunk_count, chunk_end,
                          n_tiles, n_chunks, TB=1024, CB=256, num_warps=4)
    if capacity is None:
        row_base = torch.cumsum(row_total, 0, dtype=torch.int32) - row_total
        stats = torch.cat([row_base[-1:] + row_total[-1:], hides])
    # Everything that does not need the lists' length is queued before the host waits for it,
    # so the device has work while the host catches up.
    if lk:
        _compact_kernel[(n_chunks, rows)](lo, hi, chunk_end, chunk_count, c_idx, c_lo, c_hi, lk,
                                          n_chunks, CHUNK=chunk, num_warps=4)
    blocks = None
    if backward and segment_rows:
        blocks = _segment_items(lo, hi, c_idx, c_lo, c_hi, chunk_end[n_chunks - 1:], n_chunks,
                                lq, lq - lk, segment_rows, segment_capacity, block_n, is_causal)
    elif backward:
        sorted_key, order = torch.sort(order_key, dim=1, stable=True)
        n_blk = max(1, -(-lk // block_n))
        blk = torch.empty(rows * n_blk * (block_n + 2), dtype=torch.int32, device=device)
        blk_keys, blk_qlo, blk_qhi = blk.split([rows * n_blk * block_n, rows * n_blk,
                                                rows * n_blk])
        blk_keys = blk_keys.view(rows * n_blk, block_n)
        if lk:
            _blocks_kernel[(rows * n_blk,)](order, sorted_key, lo, hi, blk_keys, blk_qlo, blk_qhi,
                                            lq, lk, n_blk, (n_buckets + 1) * span,
                                            BLOCK_N=block_n, num_warps=4)
        else:
            blk_keys.fill_(-1)
            blk_qlo.fill_(lq)
            blk_qhi.zero_()
        blocks = (blk_keys, blk_qlo, blk_qhi)
    if capacity is not None:
        tile_start = (torch.arange(rows * n_tiles, dtype=torch.int32, device=device)
                      * capacity).view(rows, n_tiles)
        total = rows * n_tiles * capacity
        # A broken promise must not write past a tile's room: lists are cut at capacity.
        tile_len.clamp_(max=capacity)
    else:
        total, hidden = stats.tolist()
        if not hidden:
            return None
        tile_start += row_base[:, None]
    keys = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        # A row's live-key count is the end of its last chunk.
        fill_tile_lists(c_idx, c_lo, c_hi, chunk_end[n_chunks - 1:], n_chunks, tile_start,
                        tile_full, keys, lq, lq - lk, block_m, is_causal,
                        capacity=capacity)
    else:
        tile_full.zero_()
    return tile_start, tile_len, tile_full, keys, blocks


def _segment_items(lo, hi, c_idx, c_lo, c_hi, n_live, n_live_stride, seqlen_q, pos_off,
                   segment_rows, capacity, block_n, is_causal):
    """``(blk_keys, blk_qlo, blk_qhi)`` of the segment items: each segment's list written by
    the tile-list kernel at ``segment_rows`` queries a tile, then cut into items."""
    rows, lk = lo.shape
    device = lo.device
    n_seg = max(1, -(-seqlen_q // segment_rows))
    n_items = capacity // block_n
    seg = torch.empty(rows * n_seg * (capacity + 3), dtype=torch.int32, device=device)
    seg_keys, seg_start, seg_full, seg_len = seg.split([rows * n_seg * capacity] +
                                                       [rows * n_seg] * 3)
    seg_start = seg_start.view(rows, n_seg)
    torch.arange(0, rows * n_seg * capacity, capacity, dtype=torch.int32, device=device,
                 out=seg_start.view(-1))
    if lk:
        _fill_kernel[(n_seg, rows)](
            c_idx, c_lo, c_hi, n_live, n_live_stride, seg_start, seg_full, seg_len, seg_keys,
            seqlen_q, pos_off, n_seg, lk, capacity, BLOCK_M=segment_rows, SCAN=SCAN_BLOCK,
            CAUSAL=bool(is_causal), STORE_LEN=True, num_warps=4)
    else:
        seg_len.zero_()
    n_blk = rows * n_seg * n_items
    blk = torch.empty(n_blk * (block_n + 2), dtype=torch.int32, device=device)
    blk_keys, blk_qlo, blk_qhi = blk.split([n_blk * block_n, n_blk, n_blk])
    _items_kernel[(n_blk,)](seg_keys, seg_len, lo, hi, blk_keys, blk_qlo, blk_qhi, seqlen_q, lk,
                            n_seg, n_items, capacity, SEG=segment_rows, BLOCK_N=block_n,
                            num_warps=4)
    return blk_keys.view(n_blk, block_n), blk_qlo, blk_qhi


def fill_tile_lists(c_idx, c_lo, c_hi, n_live, n_live_stride, tile_start, tile_full, keys,
                    seqlen_q, pos_off, block_m, is_causal, capacity=None):
    """Write each (tile, row) list at ``keys[tile_start[row, tile]:]``: the keys every query
    of the tile sees first (their count into ``tile_full``), then the others.

    ``c_idx``/``c_lo``/``c_hi`` ``(R, Lk)`` int32: each row's live keys in position order
    (their index and query range), the first ``n_live[row * n_live_stride]`` entries valid
    (the rest are never read). ``pos_off = Lq - Lk`` maps a key
    position to the query index at the same position.
    """
    rows, lk = c_idx.shape
    n_tiles = tile_start.shape[1]
    if keys.numel() == 0:
        return
    _fill_kernel[(n_tiles, rows)](
        c_idx, c_lo, c_hi, n_live, n_live_stride, tile_start, tile_full, tile_full, keys,
        seqlen_q, pos_off, n_tiles, lk, capacity if capacity is not None else keys.numel(),
        BLOCK_M=block_m, SCAN=SCAN_BLOCK, CAUSAL=bool(is_causal), STORE_LEN=False, num_warps=4,
    )
