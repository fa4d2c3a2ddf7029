"""Triton kernels of the planner: writing the per-tile key lists of key-interval masks.

The planner's plain-PyTorch path builds the lists with a sort of every (key, tile) pair; a
kernel that lets each query tile scan its row's live keys writes them in position order
directly, without the sort and its (key, tile)-sized temporaries.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the planner then uses its plain-PyTorch twins
    triton = None

SCAN_BLOCK = 512


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def available(device: torch.device) -> bool:
    """Whether the list kernels run for tensors on ``device``."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


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
    def _fill_kernel(CIdx, CLo, CHi, NLive, TileStart, TileFull, Keys, Lq, pos_off, n_tiles, Lk,
                     BLOCK_M: tl.constexpr, SCAN: tl.constexpr, CAUSAL: tl.constexpr):
        m = tl.program_id(0)
        r = tl.program_id(1)
        q0 = m * BLOCK_M
        q1 = tl.minimum(q0 + BLOCK_M, Lq)
        n = tl.load(NLive + r)
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
                tl.store(out + count + at, idx, mask=take)
                count += tl.sum(take.to(tl.int32), 0)
            if part == 0:
                tl.store(TileFull + r * n_tiles + m, count)


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


def plan_fast(bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n, backward, end_bucket):
    """The planner on the device in ~10 launches and one host wait (the lists' total length,
    and whether the mask hides anything beyond ``is_causal``).

    Returns None for a mask that hides nothing (the caller runs the dense kernels), else
    ``(tile_start, tile_len, tile_full, keys, blocks)`` with ``blocks`` None or ``(blk_keys,
    blk_row, blk_qlo, blk_qhi)``: the same lists as the plain-PyTorch planner.
    """
    rows = bounds.shape[1] * bounds.shape[2]
    lk, lq = seqlen_k, seqlen_q
    device = bounds.device
    chunk = 1024
    n_chunks = max(1, -(-lk // chunk))
    n_tiles = max(1, -(-lq // block_m))
    span = lq + 1
    n_buckets = -(-span // end_bucket) + 1
    lo = torch.empty((rows, lk), dtype=torch.int32, device=device)
    hi = torch.empty_like(lo)
    order_key = torch.empty((rows, lk), dtype=torch.int64, device=device)
    chunk_count = torch.empty((rows, n_chunks), dtype=torch.int32, device=device)
    tile_diff = torch.zeros((rows, n_tiles + 1), dtype=torch.int32, device=device)
    hides = torch.zeros(1, dtype=torch.int32, device=device)
    b = bounds.contiguous()
    if lk:
        _ranges_kernel[(n_chunks, rows)](
            b, lo, hi, order_key, chunk_count, tile_diff, hides, lq, lk, lq - lk, rows * lk,
            n_tiles,
            n_chunks, span, n_buckets, end_bucket, BLOCK_M=block_m, CHUNK=chunk,
            CAUSAL=bool(is_causal), num_warps=4)
    tile_len = torch.cumsum(tile_diff[:, :n_tiles], dim=1, dtype=torch.int32)
    ends = torch.cumsum(tile_len.flatten(), 0, dtype=torch.int64)
    tile_start = (ends.view(rows, n_tiles) - tile_len).to(torch.int32)
    stats = torch.stack([ends[-1], hides[0].to(torch.int64)])
    # Everything that does not need the lists' length is queued before the host waits for it,
    # so the device has work while the host catches up.
    chunk_end = torch.cumsum(chunk_count, dim=1, dtype=torch.int32)
    c_idx = torch.full((rows, lk), lk, dtype=torch.int32, device=device)
    c_lo = torch.empty_like(c_idx)
    c_hi = torch.empty_like(c_idx)
    if lk:
        _compact_kernel[(n_chunks, rows)](lo, hi, chunk_end, chunk_count, c_idx, c_lo, c_hi, lk,
                                          n_chunks, CHUNK=chunk, num_warps=4)
    blocks = None
    if backward:
        sorted_key, order = torch.sort(order_key, dim=1, stable=True)
        n_blk = max(1, -(-lk // block_n))
        blk_keys = torch.empty((rows * n_blk, block_n), dtype=torch.int32, device=device)
        blk_qlo = torch.empty(rows * n_blk, dtype=torch.int32, device=device)
        blk_qhi = torch.empty_like(blk_qlo)
        if lk:
            _blocks_kernel[(rows * n_blk,)](order, sorted_key, lo, hi, blk_keys, blk_qlo, blk_qhi,
                                            lq, lk, n_blk, (n_buckets + 1) * span,
                                            BLOCK_N=block_n, num_warps=4)
        else:
            blk_keys.fill_(-1)
            blk_qlo.fill_(lq)
            blk_qhi.zero_()
        blk_row = torch.arange(rows, dtype=torch.int32, device=device).repeat_interleave(n_blk)
        blocks = (blk_keys, blk_row, blk_qlo, blk_qhi)
    total, hidden = stats.tolist()
    if not hidden:
        return None
    keys = torch.empty(total, dtype=torch.int32, device=device)
    tile_full = torch.zeros_like(tile_start)
    if total:
        fill_tile_lists(c_idx, c_lo, c_hi, chunk_end[:, -1].contiguous(), tile_start, tile_full,
                        keys, lq, lq - lk, block_m, is_causal)
    return tile_start, tile_len, tile_full, keys, blocks


def fill_tile_lists(c_idx, c_lo, c_hi, n_live, tile_start, tile_full, keys, seqlen_q, pos_off,
                    block_m, is_causal):
    """Write each (tile, row) list at ``keys[tile_start[row, tile]:]``: the keys every query
    of the tile sees first (their count into ``tile_full``), then the others.

    ``c_idx``/``c_lo``/``c_hi`` ``(R, Lk)`` int32: each row's live keys in position order
    (their index and query range), the first ``n_live[row]`` entries valid and the rest
    holding ``Lk`` (so the index column stays sorted). ``pos_off = Lq - Lk`` maps a key
    position to the query index at the same position.
    """
    rows, lk = c_idx.shape
    n_tiles = tile_start.shape[1]
    if keys.numel() == 0:
        return
    _fill_kernel[(n_tiles, rows)](
        c_idx, c_lo, c_hi, n_live, tile_start, tile_full, keys, seqlen_q, pos_off, n_tiles, lk,
        BLOCK_M=block_m, SCAN=SCAN_BLOCK, CAUSAL=bool(is_causal), num_warps=4,
    )
