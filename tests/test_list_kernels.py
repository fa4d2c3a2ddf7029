"""The planner's list kernels (:mod:`flash_dmattn.planning.list_kernels`) build exactly the
plain-PyTorch planner's lists: every tile's keys (covering keys first, then the others, each
group in position order), ``tile_full``/``tile_len``/``tile_start``, and the backward's
segment items, whether a tile reads its coarse segment's list or (a list past its room, a
tile across two segments) the row's keys.

Sizes are odd on purpose: lengths that are not multiples of the tile, the coarse segment or
the chunk; Lq != Lk both ways; rows with different numbers of live keys; empty intervals and
intervals covering everything. The ``small`` granularity shrinks the kernels' chunk, scan step
and segment group so that these sizes take many chunks and many steps per list.
"""
import os

import pytest
import torch

from flash_dmattn import KeyIntervals
from flash_dmattn.planning import list_kernels
from flash_dmattn.planning.key_lists import (key_ranges, plan_intervals_reference,
                                             segment_capacity, segment_items,
                                             tile_lists_reference)

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERP), reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(params=["default", "small"])
def granularity(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(list_kernels, "CHUNK", 16)
        monkeypatch.setattr(list_kernels, "SCAN_BLOCK", 16)
        monkeypatch.setattr(list_kernels, "SEG_GROUP", 2)
        monkeypatch.setattr(list_kernels, "COARSE_SUB", 4)
    return request.param


def _bounds(gen, rows, lk, kind):
    """``(2, 1, rows, lk)`` bounds: row ``r`` has about ``1 - r / rows`` of its keys live."""
    start = torch.randint(-4, lk + 4, (rows, lk), generator=gen)
    if kind == "long":
        end = start + torch.randint(-3, lk, (rows, lk), generator=gen)
    elif kind == "short":
        end = start + torch.randint(-2, 12, (rows, lk), generator=gen)
    else:  # every key seen by every query, or by none
        full = torch.rand(rows, lk, generator=gen) < 0.5
        start = torch.where(full, torch.full_like(start, -(1 << 20)), start)
        end = torch.where(full, torch.full_like(start, 1 << 20), start - 1)
    dead = torch.rand(rows, lk, generator=gen) < torch.arange(rows)[:, None] / rows
    end = torch.where(dead, start, end)
    return KeyIntervals(start[None], end[None]).bounds


def _check(bounds, lq, lk, causal, block_m, coarse_rows, capacity=None, segment_rows=None,
           seg_capacity=None):
    """Run the kernels and compare every list with the reference's."""
    ranges = key_ranges(bounds, lq, lk, causal)
    start, length, full, keys = tile_lists_reference(ranges, lq, block_m)
    backward = segment_rows is not None
    got = list_kernels.plan_fast(bounds.to(DEVICE), lq, lk, causal, block_m, 8, backward, 16,
                                 capacity=capacity, segment_rows=segment_rows,
                                 segment_capacity=seg_capacity, coarse_rows=coarse_rows)
    if got is None:  # only a mask that hides nothing, without a capacity
        assert capacity is None
        assert plan_intervals_reference(bounds, lq, lk, causal, block_m, 8, False).hides_nothing
        return
    g_start, g_len, g_full, g_keys, blocks = (t.cpu() if isinstance(t, torch.Tensor) else t
                                              for t in got)
    assert torch.equal(g_full, full)
    if capacity is None:
        assert torch.equal(g_start, start) and torch.equal(g_len, length)
        assert torch.equal(g_keys, keys)
    else:
        # Each list at (row * n_tiles + tile) * capacity, cut there.
        rows, n_tiles = start.shape
        slots = torch.arange(rows * n_tiles, dtype=torch.int32).view(rows, n_tiles) * capacity
        assert torch.equal(g_start, slots)
        assert torch.equal(g_len, length.clamp(max=capacity))
        for r in range(rows):
            for m in range(n_tiles):
                n, s = g_len[r, m].item(), start[r, m].item()
                assert torch.equal(g_keys[slots[r, m]:slots[r, m] + n], keys[s:s + n]), (r, m)
    if backward:
        want = segment_items(ranges, lq, segment_rows, 8, seg_capacity)
        for a, b in zip(blocks, want):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("lq, lk, kind", [(77, 93, "long"), (93, 41, "short"),
                                           (130, 130, "all_or_none")])
def test_lists_match_reference_exact_sizes(granularity, lq, lk, kind):
    """Lists sized exactly (no window promise), coarse segments of one and three tiles and of
    a size that is not whole tiles (tiles across two segments read the row)."""
    gen = torch.Generator().manual_seed(lq * 1000 + lk)
    bounds = _bounds(gen, 3, lk, kind)
    for causal, coarse in ((False, 16), (True, 48), (True, 24)):
        _check(bounds, lq, lk, causal, 16, coarse)


@pytest.mark.parametrize("lq, lk, causal", [(77, 93, True), (93, 41, False)])
def test_lists_match_reference_under_a_capacity(granularity, lq, lk, causal):
    """Lists at a fixed capacity that holds every list, and at one that does not (a broken
    promise: lists and coarse lists cut, tiles of an overflowing segment read the row), with
    segment items one and two tiles long."""
    gen = torch.Generator().manual_seed(lq + lk)
    bounds = _bounds(gen, 3, lk, "long")
    longest = int(tile_lists_reference(key_ranges(bounds, lq, lk, causal), lq, 16)[1].max())
    for capacity, seg in ((longest, 16), (max(1, longest // 3), 32)):
        seg_cap = 8 * max(1, -(-min(lk, capacity + seg) // 8))
        _check(bounds, lq, lk, causal, 16, None, capacity=capacity, segment_rows=seg,
               seg_capacity=seg_cap)
    _check(bounds, lq, lk, causal, 16, 24, capacity=max(1, longest // 3))


def test_no_live_key_and_every_key_everywhere(granularity):
    """Rows without a live key give empty lists; keys seen by every query give full tiles of
    every key (each list = all keys in position order, all covering)."""
    lq, lk = 45, 37
    j = torch.arange(lk)
    empty = KeyIntervals(j[None, None], j[None, None]).bounds
    every = KeyIntervals(torch.full((1, 2, lk), -100), torch.full((1, 2, lk), 100)).bounds
    _check(empty, lq, lk, False, 16, 32)
    _check(empty, lq, lk, True, 16, 32, capacity=7, segment_rows=16, seg_capacity=16)
    _check(every, lq, lk, True, 16, 32, capacity=lk)
    _check(every, lq, lk, False, 16, 16, capacity=lk, segment_rows=16,
           seg_capacity=segment_capacity(lk, 16, 8, lk - 1))
    _check(every, lq, lk, True, 16, 32)


@pytest.mark.parametrize("causal_selection", [False, True])
def test_topk_selection_with_window_promise(granularity, causal_selection):
    """A top-W selection (the lists' main client) at the capacity its window promises, with the
    backward's segment items as the coarse segment and with a coarser one."""
    from flash_dmattn.utils.mask import topk_intervals

    gen = torch.Generator().manual_seed(21)
    L, W = 101, 11
    bias = torch.randn(2, 2, 1, L, generator=gen)
    bias[1, 0, 0, 40:60] = 0.5  # ties
    bounds = topk_intervals(bias, W, is_causal=causal_selection).bounds
    for causal, block_m, seg, coarse in ((True, 16, 32, None), (False, 8, 48, 96)):
        _check(bounds, L, L, causal, block_m, coarse, capacity=W + block_m - 1,
               segment_rows=seg, seg_capacity=segment_capacity(L, seg, 8, W))


def test_coarse_rows_default_and_validation():
    """The coarse segment is the backward's segment when that is whole tiles, else about
    COARSE_ROWS rounded to whole tiles; out-of-range sizes are refused."""
    assert list_kernels.coarse_rows_for(128, 1024) == 1024
    assert list_kernels.coarse_rows_for(128) == 1024
    assert list_kernels.coarse_rows_for(96, 1000) == 96 * 11
    j = torch.arange(8)
    bounds = KeyIntervals(j, j + 2).bounds
    with pytest.raises(ValueError, match="coarse_rows"):
        list_kernels.plan_fast(bounds.to(DEVICE), 8, 8, False, 4, 8, False, 16,
                               coarse_rows=1 << 15)
    with pytest.raises(ValueError, match="capacity"):
        list_kernels.plan_fast(bounds.to(DEVICE), 8, 8, False, 4, 8, True, 16, segment_rows=4,
                               segment_capacity=8)
