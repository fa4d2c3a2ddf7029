"""Work lists for key-interval masks: which keys each query tile reads, and the key blocks of
the backward.

A :class:`~flash_dmattn.masks.KeyIntervals` mask gives each key ``j`` one range of query
positions ``[start_j, end_j)``. Intersected with the call's queries (and with ``j <= pos`` when
causal) it becomes a range of query *indices* ``[lo_j, hi_j)``; a key with ``lo_j >= hi_j`` is
seen by nobody and costs nothing. From those ranges:

* **Forward / dQ lists** (query-tile major): for each query tile of ``block_m`` rows, the
  indices of the keys whose range meets the tile — first those every query of the tile sees
  (``tile_full`` of them; the kernels skip their interval test), then the others, each group
  in position order. A key appears in ``last - first + 1`` lists, so the total length is
  about ``(Lq / block_m) * (W + block_m)`` for a top-W selection: the kernels' work follows
  the selected keys, not the key tiles. ``tile_start``/``tile_len`` index the lists.
* **Backward key blocks** (key major): the keys seen by anyone, grouped ``block_n`` at a time;
  each block carries the union ``[q_lo, q_hi)`` of its keys' ranges, which its dK/dV
  programs walk. Each key is in exactly one block. Keys are grouped by coarse end and then
  by start, so that a block's keys share most of their ranges: for a shared selection
  (every range ends at ``Lq``) this is position order; for a causal per-query selection it
  keeps keys that stop being selected at about the same query together.
* **Backward segment items** (key major, for masks with a window promise): the queries are
  cut into segments of ``segment_rows``; each segment gets the list of keys that meet it, laid
  out like a forward tile's (keys every query of the segment sees first, then the others),
  and the list is cut into items of ``block_n`` keys, each with the union of its keys' ranges
  within the segment. A key seen across the whole segment wastes no pair of its item, so a
  dK/dV kernel walking items visits about 0.9 pairs it needs for each pair it walks (the key
  blocks above: about 0.7), at the price of a key appearing in one item per segment it
  meets (its dK/dV partial sums are then added, as for the key blocks' segments).
* A mask that hides nothing beyond ``is_causal`` is reported as such (``hides_nothing``), so
  the call can run on the dense kernels.

On a GPU the planner's own Triton kernels build the lists (:mod:`.list_kernels`); the
plain-PyTorch functions here build the same lists elsewhere and in tests. Either way the
memory is O(B·H·Lk) numbers plus the lists, never an (Lq, Lk) tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..intmath import cdiv


class DenseEquivalent:
    """The backward plan of a key-interval call whose mask hides nothing beyond ``is_causal``:
    it ran on the dense kernels, whose own plan (or None) this carries."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan


def full_bounds(bounds: torch.Tensor, batch: int, num_heads: int, num_kv_heads: int):
    """The bounds expanded to one row per (batch, mask head): ``(2, B, Hx', Lk)`` with
    ``Hx' = Hkv`` for bounds shared by a kv head's group (or by all heads) and ``H`` for
    bounds per query head. Returns the tensor and whether it is per query head."""
    _, bx, hx, lk = bounds.shape
    per_qhead = hx == num_heads and num_heads != num_kv_heads
    heads = num_heads if per_qhead else num_kv_heads
    return bounds.expand(2, batch, heads, lk).contiguous(), per_qhead


def end_bucket_for(seqlen_q: int) -> int:
    """How close (in queries) the range ends of a key block's keys are kept (see
    :func:`key_blocks`): an eighth of the queries, within 2K..8K. For causal top-2048
    selections this keeps 0.70-0.78 of the pairs the dK/dV kernel visits visible from 16K to
    128K queries, and measured fastest among 1K-8K buckets at 32K and 128K."""
    return min(8192, max(2048, 1 << max(0, (seqlen_q // 8).bit_length() - 1)))


@dataclass(frozen=True)
class KeyRanges:
    """Per mask row ``r`` (``r = b_idx * Hx + h_idx``, ``(R, Lk)`` each) the query-index range
    ``[lo, hi)`` that sees each key; empty where ``lo >= hi``."""

    lo: torch.Tensor
    hi: torch.Tensor


def key_ranges(bounds: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool) -> KeyRanges:
    """Query-index ranges of every key of a ``(2, Bx, Hx, Lk)`` bounds tensor."""
    start = bounds[0].reshape(-1, seqlen_k).to(torch.int64)
    end = bounds[1].reshape(-1, seqlen_k).to(torch.int64)
    off = seqlen_k - seqlen_q  # query index i sits at key position i + off
    lo = start - off
    if is_causal:
        j = torch.arange(seqlen_k, device=bounds.device)
        lo = torch.maximum(lo, j - off)
    lo = lo.clamp(0, seqlen_q)
    hi = (end - off).clamp(0, seqlen_q)
    return KeyRanges(lo.to(torch.int32), hi.to(torch.int32))


@dataclass
class IntervalPlan:
    """The lists of one key-interval call (see the module docstring).

    ``tile_start``/``tile_len`` ``(R, n_tiles)`` int32 index ``keys`` (int32 key indices): a
    tile's first ``tile_full`` keys are seen by every query of the tile (the kernels skip
    their interval test), the rest by some; each group in position order. ``blk_keys (n_blocks, block_n)`` int32 key indices (``-1``
    pads a row's last block; every row has ``blocks_per_row`` blocks, row after row),
    ``blk_qlo``/``blk_qhi`` ``(n_blocks,)`` int32.
    ``segment_rows``: None for key blocks (each seen key in exactly one block); else the
    blocks are segment items (:func:`segment_items`): every block's range lies within one
    segment of that many queries, and a key is in one block per segment it meets.
    ``hides_nothing``: the mask shows every pair that ``is_causal`` alone shows (then no lists
    are built, and the call belongs on the dense kernels).
    """

    block_m: int
    block_n: int
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    tile_full: torch.Tensor
    keys: torch.Tensor
    hides_nothing: bool = False
    blk_keys: Optional[torch.Tensor] = None
    blk_qlo: Optional[torch.Tensor] = None
    blk_qhi: Optional[torch.Tensor] = None
    segment_rows: Optional[int] = None

    @property
    def rows(self) -> int:
        return self.tile_start.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.tile_start.shape[1]

    @property
    def n_blocks(self) -> int:
        return 0 if self.blk_keys is None else self.blk_keys.shape[0]

    @property
    def blocks_per_row(self) -> int:
        return self.n_blocks // max(self.rows, 1)


def tile_lists_reference(ranges: KeyRanges, seqlen_q: int, block_m: int):
    """``(tile_start, tile_len, tile_full, keys)``: per (row, query tile) the keys whose range
    meets it: first the ``tile_full`` keys seen by every query of the tile, then the others,
    each group in position order (a stable sort of every (key, tile) pair)."""
    lo, hi = ranges.lo.to(torch.int64), ranges.hi.to(torch.int64)
    rows, lk = lo.shape
    device = lo.device
    n_tiles = max(1, cdiv(seqlen_q, block_m))
    live = lo < hi
    first = torch.div(lo, block_m, rounding_mode="floor")
    last = torch.div(hi - 1, block_m, rounding_mode="floor")
    count = torch.where(live, last - first + 1, torch.zeros_like(lo)).flatten()
    # One entry per (key, tile it meets), generated in (row, key, tile) order; a stable sort
    # by (row, tile, partial) then leaves each group of a tile in position order.
    owner = torch.repeat_interleave(torch.arange(rows * lk, device=device), count)
    if owner.numel():
        base = torch.cumsum(count, 0) - count
        step = torch.arange(owner.numel(), device=device) - base[owner]
        tile = first.flatten()[owner] + step
        q0 = tile * block_m
        q1 = torch.clamp(q0 + block_m, max=seqlen_q)
        partial = ((lo.flatten()[owner] > q0) | (hi.flatten()[owner] < q1)).to(torch.int64)
        slot = torch.div(owner, lk, rounding_mode="floor") * n_tiles + tile
        _, order = torch.sort(slot * 2 + partial, stable=True)
        keys = (owner[order] % lk).to(torch.int32)
        tile_len = torch.bincount(slot, minlength=rows * n_tiles)
        tile_full = torch.bincount(slot, weights=(1 - partial).double(),
                                   minlength=rows * n_tiles).to(torch.int64)
    else:
        keys = torch.zeros(0, dtype=torch.int32, device=device)
        tile_len = torch.zeros(rows * n_tiles, dtype=torch.int64, device=device)
        tile_full = tile_len
    tile_start = torch.cumsum(tile_len, 0) - tile_len
    return (tile_start.view(rows, n_tiles).to(torch.int32),
            tile_len.view(rows, n_tiles).to(torch.int32),
            tile_full.view(rows, n_tiles).to(torch.int32), keys)


def key_blocks(ranges: KeyRanges, seqlen_q: int, block_n: int, end_bucket: int):
    """``(blk_keys, blk_qlo, blk_qhi)``: the live keys of each row, ``block_n`` at a
    time, grouped by ``hi // end_bucket`` (latest first, so the longest blocks start first)
    and then by ``lo`` (see the module docstring).

    Every row gets ``ceil(Lk / block_n)`` blocks whatever its number of live keys, so nothing
    here waits for the device: a block without live keys has keys ``-1`` and an empty range
    ``[Lq, 0)``, and its program exits at once.
    """
    lo, hi = ranges.lo.to(torch.int64), ranges.hi.to(torch.int64)
    rows, lk = lo.shape
    device = lo.device
    live = lo < hi
    span = seqlen_q + 1
    n_buckets = cdiv(span, end_bucket) + 1
    order_key = torch.where(
        live,
        (n_buckets - torch.div(hi, end_bucket, rounding_mode="floor")) * span + lo,
        torch.full_like(lo, (n_buckets + 1) * span),  # dead keys sort last
    )
    order_key, order = torch.sort(order_key, dim=1, stable=True)
    n_blk = cdiv(lk, block_n)
    padded = n_blk * block_n
    keys = torch.where(order_key < (n_buckets + 1) * span, order, torch.full_like(order, -1))
    if padded != lk:
        keys = torch.cat([keys, keys.new_full((rows, padded - lk), -1)], dim=1)
    blk_keys = keys.view(rows * n_blk, block_n)
    valid = blk_keys >= 0
    safe = blk_keys.clamp(min=0)
    blk_row = torch.arange(rows, device=device).repeat_interleave(n_blk)
    row_lo = lo[blk_row[:, None], safe]
    row_hi = hi[blk_row[:, None], safe]
    blk_qlo = torch.where(valid, row_lo, torch.full_like(row_lo, seqlen_q)).amin(dim=1)
    blk_qhi = torch.where(valid, row_hi, torch.zeros_like(row_hi)).amax(dim=1)
    return (blk_keys.to(torch.int32).contiguous(), blk_qlo.to(torch.int32),
            blk_qhi.to(torch.int32))


def segment_capacity(seqlen_k: int, segment_rows: int, block_n: int, window: int) -> int:
    """Room for one segment's key list under a window promise: ``segment_rows`` consecutive
    queries meet at most ``window + segment_rows - 1`` keys; rounded up to whole items."""
    cap = min(seqlen_k, window + segment_rows - 1)
    return max(1, cdiv(cap, block_n)) * block_n


def segment_items(ranges: KeyRanges, seqlen_q: int, segment_rows: int, block_n: int,
                  capacity: int):
    """``(blk_keys, blk_qlo, blk_qhi)``: the backward's segment items (see the module
    docstring) in plain PyTorch.

    Row ``r``, segment ``s`` and item ``c`` is block ``(r * n_seg + s) * n_items + c`` with
    ``n_seg = ceil(Lq / segment_rows)`` and ``n_items = capacity // block_n``: keys
    ``c * block_n ..`` of the segment's list (``-1`` past its end), and the union of their
    ranges cut to the segment (``[Lq, 0)`` for an item without keys). ``capacity`` (a multiple
    of ``block_n``) bounds a segment's list; a longer list is cut there.
    """
    rows = ranges.lo.shape[0]
    device = ranges.lo.device
    tile_start, tile_len, _, keys = tile_lists_reference(ranges, seqlen_q, segment_rows)
    n_seg = tile_start.shape[1]
    slot = torch.arange(capacity, device=device)
    n = tile_len.to(torch.int64).clamp(max=capacity)[..., None]  # (R, n_seg, 1)
    ok = slot < n
    at = (tile_start.to(torch.int64)[..., None] + slot).clamp(max=max(keys.numel() - 1, 0))
    idx = torch.where(ok, keys.to(torch.int64)[at] if keys.numel() else at, -1)
    safe = idx.clamp(min=0)
    row = torch.arange(rows, device=device)[:, None, None]
    q0 = (torch.arange(n_seg, device=device) * segment_rows)[None, :, None]
    q1 = torch.clamp(q0 + segment_rows, max=seqlen_q)
    lo = torch.where(ok, torch.maximum(ranges.lo.to(torch.int64)[row, safe], q0), seqlen_q)
    hi = torch.where(ok, torch.minimum(ranges.hi.to(torch.int64)[row, safe], q1), 0)
    n_items = capacity // block_n
    blk_keys = idx.view(rows * n_seg * n_items, block_n)
    blk_qlo = lo.view(-1, block_n).amin(dim=1)
    blk_qhi = hi.view(-1, block_n).amax(dim=1)
    return (blk_keys.to(torch.int32).contiguous(), blk_qlo.to(torch.int32),
            blk_qhi.to(torch.int32))


def plan_intervals(
    bounds: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    backward: bool,
    end_bucket: Optional[int] = None,
    window: Optional[int] = None,
    segment_rows: Optional[int] = None,
) -> IntervalPlan:
    """Plan a key-interval call: forward lists always, backward key blocks when asked.

    On a GPU (or under Triton's interpreter) the planner's own kernels do it
    (:func:`.list_kernels.plan_fast`); elsewhere the plain-PyTorch functions of this module.
    Both give the same lists.

    ``window``: the mask's window promise (:attr:`~flash_dmattn.masks.KeyIntervals.window`).
    A tile of ``block_m`` queries then meets at most ``window + block_m - 1`` keys, so the
    device planner gives every tile a list of that capacity and never waits for the device
    to learn the lists' total length; and a window below ``Lk`` hides keys from the last
    query, so the mask is not checked for hiding nothing.

    ``segment_rows``: with a window, the backward gets segment items of that many queries
    (:func:`segment_items`, for kernels that add every block's dK/dV into fp32 sums) instead
    of key blocks; ignored without a window (a segment's list would need room for every key).
    """
    from . import list_kernels

    bucket = end_bucket if end_bucket is not None else end_bucket_for(seqlen_q)
    windowed = window is not None and window < seqlen_k
    segments = segment_rows if (backward and windowed and segment_rows) else None
    if list_kernels.available(bounds.device):
        capacity = min(seqlen_k, window + block_m - 1) if windowed else None
        seg_capacity = (segment_capacity(seqlen_k, segments, block_n, window)
                        if segments else None)
        built = list_kernels.plan_fast(
            bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n, backward, bucket,
            capacity=capacity, segment_rows=segments, segment_capacity=seg_capacity)
        if built is None:
            return _dense_equivalent(bounds, seqlen_q, block_m, block_n)
        tile_start, tile_len, tile_full, keys, blocks = built
        plan = IntervalPlan(block_m, block_n, tile_start, tile_len, tile_full, keys,
                            segment_rows=segments)
        if blocks is not None:
            plan.blk_keys, plan.blk_qlo, plan.blk_qhi = blocks
        return plan
    plan = plan_intervals_reference(bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n,
                                    backward and not segments, bucket)
    if segments and not plan.hides_nothing:
        ranges = key_ranges(bounds, seqlen_q, seqlen_k, is_causal)
        plan.blk_keys, plan.blk_qlo, plan.blk_qhi = segment_items(
            ranges, seqlen_q, segments, block_n,
            segment_capacity(seqlen_k, segments, block_n, window))
        plan.segment_rows = segments
    return plan


def plan_intervals_reference(bounds, seqlen_q, seqlen_k, is_causal, block_m, block_n, backward,
                             end_bucket=None) -> IntervalPlan:
    """:func:`plan_intervals` in plain PyTorch (a sort of every (key, tile) pair for the
    lists)."""
    ranges = key_ranges(bounds, seqlen_q, seqlen_k, is_causal)
    plain = key_ranges(torch.tensor([-(1 << 30), 1 << 30], dtype=torch.int32,
                                    device=bounds.device).view(2, 1, 1, 1).expand_as(bounds),
                       seqlen_q, seqlen_k, is_causal)
    if bool(((ranges.lo <= plain.lo) | (plain.lo >= plain.hi)).all()
            & ((ranges.hi >= plain.hi) | (plain.lo >= plain.hi)).all()):
        return _dense_equivalent(bounds, seqlen_q, block_m, block_n)
    tile_start, tile_len, tile_full, keys = tile_lists_reference(ranges, seqlen_q, block_m)
    plan = IntervalPlan(block_m, block_n, tile_start, tile_len, tile_full, keys)
    if backward:
        bucket = end_bucket or end_bucket_for(seqlen_q)
        plan.blk_keys, plan.blk_qlo, plan.blk_qhi = key_blocks(ranges, seqlen_q, block_n, bucket)
    return plan


def _dense_equivalent(bounds, seqlen_q, block_m, block_n) -> IntervalPlan:
    """The plan of a mask that hides nothing beyond ``is_causal``: no lists."""
    rows = bounds.shape[1] * bounds.shape[2]
    n_tiles = max(1, cdiv(seqlen_q, block_m))
    empty = torch.zeros((rows, n_tiles), dtype=torch.int32, device=bounds.device)
    return IntervalPlan(block_m, block_n, empty, empty, empty,
                        torch.zeros(0, dtype=torch.int32, device=bounds.device),
                        hides_nothing=True)
