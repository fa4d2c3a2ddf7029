"""Tile classification and compact live-tile lists for the Triton kernels.

A (query tile, key tile) pair of one attention call is

* dead    -- no visible element: the boolean mask is all False there, or causally invisible;
* full    -- every in-bounds element visible: the kernel needs no per-element mask;
* partial -- anything else: the kernel loads the mask tile and/or applies the causal compare.

The classification is computed on the mask's device with a handful of torch reductions, once
per call and block shape, and never materialises anything of size (B, H, Lq, Lk): the block map
is at most (Bx, Hx, nQ, nK) with the mask's own broadcast dims kept at size 1 (causal forces the
query-tile dim to nQ because the diagonal depends on it).

The kernels then walk compact lists instead of the map, so a call whose mask leaves 5% of the
tiles alive does ~5% of the work:

* forward lists, per (b, h, query tile): the live key tiles in ascending order;
* backward lists, per (b, h, key tile): the live query tiles in ascending order.

Each list entry is ``tile_index * 2 + partial`` (int32). A row lists its full tiles first,
then its partial ones (each group ascending), so a kernel runs two loops without a per-tile
branch; ``cnt[..., 0]`` is the number of live entries and ``cnt[..., 1]`` how many of them are
full (a ragged last key tile always counts as partial: only partial tiles are bound-checked). Dims of size 1 (batch, head, and for forward lists the query-tile dim) are
broadcast by the kernels through stride 0.

Packed-sequence (varlen) calls with a per-key mask get :class:`VarlenKeyLists` instead: one
ascending list of live key tiles per (mask head, sequence), shared by every query tile (the
mask does not depend on the query) and searched by the key-tile programs of the backward.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..block_map import causal_tiles, tile_liveness
from ..envs import interpret_mode
from ..intmath import cdiv
from .key_mask_lists import per_key_eligible, per_key_lists
from .mask_summary import MaskSummary


@dataclass(frozen=True)
class TileLists:
    """Live-tile lists for one block shape.

    ``fwd_idx`` is ``(Bm, Hm, nQm, nK)`` and ``fwd_cnt`` ``(Bm, Hm, nQm, 2)`` (live, full): for
    query tile ``m`` of batch ``b`` and query head ``h`` the row is ``[b or 0, h // head_div,
    m or 0]``. ``bwd_idx`` is ``(Bm, Hm, nK, nQ)`` and ``bwd_cnt`` ``(Bm, Hm, nK, 2)`` (per key
    tile).
    Either pair may be None when not requested. ``fwd_bits`` (only for a per-key mask, when
    asked for): int64 of ``fwd_idx``'s shape, the mask bits of each listed key tile (bit ``i``
    = key ``tile * block_n + i`` live; see :mod:`.key_mask_lists`), and ``fwd_cut`` beside
    it: int32 ``fwd_cnt``'s shape, per row the number of listed tiles the mask cuts and the
    row's live count where that is 0 (else 0).
    """

    block_m: int
    block_n: int
    num_q_tiles: int
    num_k_tiles: int
    head_div: int
    fwd_idx: Optional[torch.Tensor]
    fwd_cnt: Optional[torch.Tensor]
    bwd_idx: Optional[torch.Tensor]
    bwd_cnt: Optional[torch.Tensor]
    fwd_bits: Optional[torch.Tensor] = None
    fwd_cut: Optional[torch.Tensor] = None

    def fwd_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_m, cnt_b, cnt_h, cnt_m) with 0 for broadcast dims."""
        return _row_strides(self.fwd_idx, self.fwd_cnt)

    def cut_strides(self) -> Tuple[int, int, int]:
        """(b, h, m) strides of ``fwd_cut`` with 0 for broadcast dims."""
        return tuple(_bstride(self.fwd_cut, d) for d in range(3))

    def plain_strides(self) -> Tuple[int, int, int, int, int, int]:
        """:meth:`fwd_strides` with the counts of ``fwd_cut[..., 1:]``: the lists of a kernel
        that runs the rows the mask cuts nowhere without it and gives the others no tile."""
        return _row_strides(self.fwd_idx, self.fwd_cut[..., 1:])

    def bwd_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_n, cnt_b, cnt_h, cnt_n) with 0 for broadcast dims."""
        return _row_strides(self.bwd_idx, self.bwd_cnt)


def _bstride(t: torch.Tensor, d: int) -> int:
    # A size-1 dim is indexed with a possibly larger program index: stride 0 keeps it at 0.
    return 0 if t.size(d) == 1 else t.stride(d)


def _row_strides(idx: torch.Tensor, cnt: torch.Tensor):
    return (_bstride(idx, 0), _bstride(idx, 1), _bstride(idx, 2),
            _bstride(cnt, 0), _bstride(cnt, 1), _bstride(cnt, 2))


def classify_tiles(
    mask: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    device: torch.device,
    summary: Optional[MaskSummary] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(live, full)`` bool block maps ``(Bm, Hm, nQm, nKm)``; see :func:`tile_liveness`.

    With a :class:`MaskSummary` of ``mask`` the maps are reductions of the summary (the mask
    itself is not read again).
    """
    if summary is None:
        return tile_liveness(mask, seqlen_q, seqlen_k, block_m, block_n, is_causal, device)
    live, full = summary.tiles(block_m, block_n)
    if is_causal:
        c_any, c_all = causal_tiles(seqlen_q, seqlen_k, block_m, block_n, device)
        live = live & c_any
        full = full & c_all
    return live, full


def _compact(live: torch.Tensor, partial: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last dim: live indices encoded ``index * 2 + partial``, the full ones
    first and then the partial ones, each ascending; counts ``[..., (live, full)]``.

    ``partial`` implies ``live``. On the GPU (and under the interpreter) one Triton kernel
    does it; the torch version (:func:`compact_reference`) took about ten small launches per
    list, most of a per-key mask's list-building time.
    """
    from .tile_compact import compact_tiles

    if _runs_kernels(live.device):
        return compact_tiles(live, partial)
    return compact_reference(live, partial)


def compact_reference(live: torch.Tensor,
                      partial: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`_compact` (same meaningful entries and counts)."""
    n = live.size(-1)
    ar = torch.arange(n, device=live.device, dtype=torch.int32)
    # Full tiles sort first, partial next, dead last; the index keeps each group ascending.
    part = partial.to(torch.int32)
    key = ((~live).to(torch.int32) * 2 + part) * n + ar
    order = torch.sort(key, dim=-1).values % n
    flag = torch.gather(part, -1, order.to(torch.int64))
    idx = (order * 2 + flag).to(torch.int32).contiguous()
    n_live = live.sum(-1, dtype=torch.int32)
    n_full = (live & ~partial).sum(-1, dtype=torch.int32)
    return idx, torch.stack([n_live, n_full], -1).contiguous()


def build_tile_lists(
    mask: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    num_heads: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    device: torch.device,
    need_fwd: bool = True,
    need_bwd: bool = False,
    summary: Optional[MaskSummary] = None,
    with_bits: bool = False,
    cut_flag: Optional[torch.Tensor] = None,
) -> Optional[TileLists]:
    """Build live-tile lists for ``block_m x block_n`` tiles, or None when every tile is full.

    Returns None without a mask and without causal: kernels then visit every tile densely.
    ``mask`` is the normalised 4-D bool view ``(Bx, Hx, Qx, Kx)``; ``summary``, when given, is
    its :class:`MaskSummary` and replaces reading it. ``with_bits``: a per-key mask's forward
    lists also carry ``fwd_bits`` and ``fwd_cut`` (None for other masks), and raise
    ``cut_flag`` (int32 ``(1,)``, when given) to 1 if the mask cuts a listed tile.
    """
    if mask is None and not is_causal:
        return None
    if mask is None:
        # Causal-only lists depend on the shape alone: build them once, not per call (the
        # handful of small launches costs more than a short attention call itself).
        key = (seqlen_q, seqlen_k, num_heads, block_m, block_n, str(device), need_fwd, need_bwd)
        cached = _CAUSAL_CACHE.get(key)
        if cached is None:
            cached = _build(None, seqlen_q, seqlen_k, num_heads, True, block_m, block_n, device,
                            need_fwd, need_bwd)
            _CAUSAL_CACHE[key] = cached
            if len(_CAUSAL_CACHE) > _CAUSAL_CACHE_SIZE:
                _CAUSAL_CACHE.popitem(last=False)
        _CAUSAL_CACHE.move_to_end(key)
        return cached
    if need_fwd and not need_bwd and summary is None and per_key_eligible(mask, block_n):
        plan = per_key_lists if _runs_kernels(mask.device) else per_key_lists_reference
        idx, cnt, bits, cut = plan(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n,
                                   with_bits, cut_flag)
        return TileLists(block_m=block_m, block_n=block_n, num_q_tiles=cdiv(seqlen_q, block_m),
                         num_k_tiles=cdiv(seqlen_k, block_n), head_div=num_heads // mask.size(1),
                         fwd_idx=idx, fwd_cnt=cnt, bwd_idx=None, bwd_cnt=None,
                         fwd_bits=bits if with_bits else None,
                         fwd_cut=cut if with_bits else None)
    return _build(mask, seqlen_q, seqlen_k, num_heads, is_causal, block_m, block_n, device,
                  need_fwd, need_bwd, summary)


def build_torch_lists(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool,
                      block_m: int, block_n: int) -> TileLists:
    """Forward lists from the torch tile maps (:func:`classify_tiles`), whatever the mask: the
    path :func:`build_tile_lists` takes for masks the per-key planner does not serve."""
    return _build(mask, seqlen_q, seqlen_k, mask.size(1), is_causal, block_m, block_n,
                  mask.device, True, False)


def per_key_lists_reference(
    mask: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    with_bits: bool,
    cut_flag: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`.key_mask_lists.per_key_lists` (same counts, cut counts, entries
    and bits up to the count): the lists from the torch tile maps, the bits gathered per
    entry."""
    lists = build_torch_lists(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n)
    idx, cnt = lists.fwd_idx, lists.fwd_cnt
    if not with_bits:
        return (idx, cnt, torch.empty(1, dtype=torch.int64, device=mask.device),
                torch.empty(1, dtype=torch.int32, device=mask.device))
    nk = cdiv(seqlen_k, block_n)
    bx, hx = mask.shape[:2]
    m = mask.expand(bx, hx, 1, seqlen_k)[:, :, 0]
    m = torch.nn.functional.pad(m, (0, nk * block_n - seqlen_k)).view(bx, hx, nk, block_n)
    lanes = torch.arange(block_n, device=mask.device)
    tile_bits = (m.long() << lanes).sum(-1)
    tiles = (idx >> 1).long()
    bits = torch.gather(tile_bits[:, :, None].expand(-1, -1, idx.size(2), -1), 3, tiles)
    in_range = (seqlen_k - tiles * block_n).clamp(max=block_n)
    n_on = torch.gather(m.sum(-1)[:, :, None].expand(-1, -1, idx.size(2), -1), 3, tiles)
    listed = torch.arange(nk, device=mask.device) < cnt[..., :1]
    n_cut = ((n_on < in_range) & listed).sum(-1, dtype=torch.int32)
    plain = torch.where(n_cut > 0, 0, cnt[..., 0])
    if cut_flag is not None:
        cut_flag.copy_(torch.maximum(cut_flag, (n_cut > 0).any().to(cut_flag.dtype)))
    return idx, cnt, bits.contiguous(), torch.stack([n_cut, plain], -1)


def _runs_kernels(device: torch.device) -> bool:
    """Whether Triton kernels run for tensors on ``device`` (a GPU, or the CPU interpreter)."""
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


_CAUSAL_CACHE: "OrderedDict" = OrderedDict()
_CAUSAL_CACHE_SIZE = 64


def _build(mask, seqlen_q, seqlen_k, num_heads, is_causal, block_m, block_n, device,
           need_fwd, need_bwd, summary=None) -> TileLists:
    n_q = -(-seqlen_q // block_m)
    n_k = -(-seqlen_k // block_n)
    live, full = classify_tiles(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n, device,
                                summary)
    bm, hm = live.shape[0], live.shape[1]
    head_div = num_heads // hm
    fwd_idx = fwd_cnt = bwd_idx = bwd_cnt = None
    live_k = live.expand(bm, hm, live.size(2), n_k)
    full_k = full.expand(bm, hm, full.size(2), n_k)
    if seqlen_k % block_n:
        # The kernels bound-check keys only on partial tiles: a ragged last key tile is one.
        inner = torch.ones(n_k, dtype=torch.bool, device=live.device)
        inner[-1] = False
        full_k = full_k & inner
    if need_fwd:
        fwd_idx, fwd_cnt = _compact(live_k, live_k & ~full_k)
    if need_bwd:
        live_t = live_k.expand(bm, hm, n_q, n_k).transpose(2, 3)
        full_t = full_k.expand(bm, hm, n_q, n_k).transpose(2, 3)
        bwd_idx, bwd_cnt = _compact(live_t, live_t & ~full_t)
    return TileLists(
        block_m=block_m,
        block_n=block_n,
        num_q_tiles=n_q,
        num_k_tiles=n_k,
        head_div=head_div,
        fwd_idx=fwd_idx,
        fwd_cnt=fwd_cnt,
        bwd_idx=bwd_idx,
        bwd_cnt=bwd_cnt,
    )


@dataclass(frozen=True)
class VarlenKeyLists:
    """Live key tiles of a packed-sequence (varlen) call with a per-key mask.

    ``idx`` is ``(Hx, n_seqs, n_tiles)`` int32 and ``cnt`` ``(Hx, n_seqs, 2)`` int32
    (live, full), for the mask's ``Hx`` heads (1, Hkv or H). Row ``[hx, b]`` lists the key
    tiles of sequence ``b`` that hold at least one live key, **ascending** (unlike the dense
    lists: query-tile programs binary-search the row for their causal limit), each encoded
    ``tile * 2 + partial``; tile ``j`` covers the sequence's keys ``j*block_n ...`` (relative
    to its first key, clipped to its end). A tile is full when all ``block_n`` keys are live;
    a ragged last tile is always partial. Entries past ``cnt[..., 0]`` are unspecified.
    """

    block_n: int
    head_div: int
    idx: torch.Tensor
    cnt: torch.Tensor

    def strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_seq, idx_head, 0, cnt_seq, cnt_head, 0): the kernels' list-stride arguments
        (batch = sequence, head, and a tile-row stride of 0: every query / key tile program
        of one (sequence, head) shares the row)."""
        def s(t, d):
            return 0 if t.size(d) == 1 else t.stride(d)

        return (s(self.idx, 1), s(self.idx, 0), 0, s(self.cnt, 1), s(self.cnt, 0), 0)


def build_varlen_key_lists(
    mask: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    num_heads: int,
    block_n: int,
) -> VarlenKeyLists:
    """Per-(mask head, sequence) live key-tile lists for a varlen per-key mask.

    Args:
        mask: bool ``(Hx, total_k)`` (Hx = 1, Hkv or H), True = attend.
        cu_seqlens_k: ``(n_seqs + 1,)`` int key offsets on the mask's device.
        max_seqlen_k: upper bound of the per-sequence key lengths (sizes the rows; read on the
            host, so nothing here waits for the device).
        num_heads: query heads (gives ``head_div = num_heads // Hx``).
        block_n: key tile size of the kernel that walks the lists.

    Vectorised over sequences and heads: one prefix sum of the mask and two gathers per tile
    boundary; extra memory is O(Hx * total_k) for the prefix sum plus O(Hx * n_seqs * n_tiles).
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"varlen key lists need a bool (Hx, total_k) mask, got "
                         f"{tuple(mask.shape)} {mask.dtype}")
    hx, total_k = mask.shape
    device = mask.device
    n_tiles = max(1, -(-int(max_seqlen_k) // block_n))
    cu = cu_seqlens_k.to(device=device, dtype=torch.int64)
    start = cu[:-1].clamp(0, total_k)
    length = (cu[1:].clamp(0, total_k) - start).clamp_min(0)
    # Live-key prefix sums: pre[:, i] = live keys among packed keys [0, i).
    pre = torch.nn.functional.pad(torch.cumsum(mask, dim=1, dtype=torch.int32), (1, 0))
    j = torch.arange(n_tiles, device=device, dtype=torch.int64) * block_n
    lo = start[:, None] + torch.minimum(j[None, :], length[:, None])
    hi = start[:, None] + torch.minimum(j[None, :] + block_n, length[:, None])
    n_live = pre[:, hi] - pre[:, lo]  # (Hx, n_seqs, n_tiles)
    live = n_live > 0
    # Full = all block_n keys live, so a ragged tile (fewer keys) is never full.
    partial = live & (n_live < block_n)
    ar = torch.arange(n_tiles, device=device, dtype=torch.int32)
    # Live tiles first, each group ascending by tile index (dead ones past the count).
    key = (~live).to(torch.int32) * n_tiles + ar
    order = torch.sort(key, dim=-1).values % n_tiles
    flag = torch.gather(partial.to(torch.int32), -1, order.to(torch.int64))
    idx = (order * 2 + flag).to(torch.int32).contiguous()
    cnt = torch.stack([live.sum(-1, dtype=torch.int32),
                       (live & ~partial).sum(-1, dtype=torch.int32)], -1).contiguous()
    return VarlenKeyLists(block_n=block_n, head_div=num_heads // hx, idx=idx, cnt=cnt)
