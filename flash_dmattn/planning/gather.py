"""Key gathering: per query tile, the union of its rows' live keys, compacted.

Tile skipping only helps when whole (query tile, key tile) blocks are dead. The dynamic-mask
workload defeats it: each query keeps its own top-k keys, scattered over the sequence, so every
128 x 64 block holds a few live keys and no block is dead. But consecutive queries keep nearly
the same keys (a per-key bias ranks keys the same way for every query), so the *union* of a
query tile's live keys is barely larger than one query's. Gather mode walks that union instead
of the key tiles: the kernels load K/V rows by index, BLOCK_N gathered keys at a time, so the
work is about ``union size / Lk`` of the dense work.

Built per call from the mask (and a per-key bias), on their device, by three small Triton
kernels after the mask summary. Nothing waits for the stream: the lists are sized by the
largest causal limit (``Lk``), and the ``auto`` policy's two totals reach the host behind an
event while the bits are built (see :func:`plan_key_gather`):

* ``idx``  ``(Bm, Hm, nQ, Lk)`` int32: the live keys of each query tile, ascending; only the
  first ``cnt`` of a row are written;
* ``cnt``  ``(Bm, Hm, nQ)`` int32;
* ``gbits`` ``(Bm, Hm, nQ * block_m, W)`` int64: the mask gathered to those columns, 64
  columns per word: bit ``c % 64`` of ``gbits[b, h, i, c // 64]`` is
  ``mask[b, h, i, idx[b, h, i // block_m, c]]`` -- and, in a causal call, 0 where that key
  lies past row ``i``'s causal limit -- so the kernels read a gathered tile's element mask as
  one word per row (its bytes were 8 KB per 128 x 64 tile) and need no range or causal test
  of their own; words past ``ceil(cnt / 64)`` are not written;
* ``gbias`` (a per-key bias only) ``(Bg, Hg, nQ, Lk rounded up to 64)``: the bias at those
  keys, ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]``, read at the same positions, so
  no load in the kernels' loop depends on another load of the same step; written up to the
  count rounded up to 64 (0 past the count);

where ``W = ceil(Lk / 64)`` (``Bm, Hm`` are the mask's own, possibly broadcast, dims). The
kernels read nothing past a tile's count. No (B, H, Lq, Lk) temporary is made: the largest is
``gbits``, an eighth of the mask's own size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..block_map import block_reduce
from ..intmath import cdiv
from .mask_summary import MaskSummary

# Use gather mode when it visits at most this fraction (numerator, denominator) of the key
# tiles that tile skipping would visit. Gathered tiles always mask per element and load their
# K/V rows by index, so they cost a little more than a partial tile of the plain path.
GATHER_MAX_RATIO = (3, 4)
_POLICIES = ("auto", "always", "never")

# Default policy per kernel: both gather when it saves work. The gathered forward kernel is
# the faster of the two on per-query top-k masks once its plan is one compact-and-gather
# kernel rather than a torch sort + gather (benchmarks/results/<gpu>/SUMMARY.md, the dynamic
# suite).
DEFAULT_POLICY = {"forward": "auto", "dq": "auto"}

# Private test hook: "always" (gather whenever the inputs allow it, to reach the gathered
# kernels on small inputs) or "never" replaces every kernel's default; None keeps them.
_FORCED_POLICY: Optional[str] = None


def gather_policy(kernel: str = "forward") -> str:
    """``auto`` (gather when it saves work, see :data:`GATHER_MAX_RATIO`), ``always`` or
    ``never``: :data:`DEFAULT_POLICY` of ``kernel`` (``forward`` or ``dq``)."""
    return _FORCED_POLICY or DEFAULT_POLICY[kernel]


@dataclass(frozen=True)
class KeyGather:
    """Gathered key lists of one call for query tiles of ``block_m`` rows (see module doc)."""

    block_m: int
    head_div: int
    idx: torch.Tensor
    cnt: torch.Tensor
    gbits: torch.Tensor
    gbias: Optional[torch.Tensor] = None

    def list_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_m, cnt_b, cnt_h, cnt_m) with 0 for broadcast dims."""

        def s(t, d):
            return 0 if t.size(d) == 1 else t.stride(d)

        return (s(self.idx, 0), s(self.idx, 1), s(self.idx, 2),
                s(self.cnt, 0), s(self.cnt, 1), s(self.cnt, 2))

    def bias_strides(self, num_heads: int) -> Tuple[int, int, int, int, int]:
        """(b, h, tile, k, head_div) strides of ``gbias`` in the kernels' bias-argument layout:
        the query-row stride slot carries the per-query-tile stride (the kernels offset the
        bias by it once and read it like a padded per-key bias)."""
        g = self.gbias
        return (0 if g.size(0) == 1 else g.stride(0), 0 if g.size(1) == 1 else g.stride(1),
                g.stride(2), 1, num_heads // g.size(1))

    def mask_strides(self, num_heads: int) -> Tuple[int, int, int, int, int]:
        """(b, h, q, k, head_div) strides of ``gbits`` in the kernels' mask-argument layout
        (the key stride is that of its words)."""
        g = self.gbits
        return (0 if g.size(0) == 1 else g.stride(0), 0 if g.size(1) == 1 else g.stride(1),
                g.stride(2), 1, num_heads // g.size(1))


def gather_eligible(mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    seqlen_q: int, seqlen_k: int, block_m: int) -> bool:
    """Whether the inputs fit gather mode at all.

    The mask must vary per query (a per-key or broadcast mask already gives dead tiles) and
    the bias, if any, must not: a full (Lq, Lk) bias would be read element by element at
    scattered columns.
    """
    if mask is None or seqlen_q <= 1 or seqlen_k <= 1:
        return False
    if mask.size(2) != seqlen_q or mask.size(3) != seqlen_k:
        return False
    if bias is not None and bias.size(2) != 1 and bias.size(3) != 1:
        return False
    return True


def plan_key_gather(
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    num_heads: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    policy: Optional[str] = None,
    kernel: str = "forward",
    summary: Optional[MaskSummary] = None,
    lagged: bool = False,
) -> Optional[KeyGather]:
    """Gather lists for ``block_m``-row query tiles, or None when tile skipping is as cheap.

    ``policy`` defaults to :func:`gather_policy` of ``kernel`` (``forward`` or ``dq``). Under
    ``auto`` the gathered ``block_n``-key tiles are compared with the live ``block_m x
    block_n`` tiles (:func:`prefers_tiles`). The lists are sized by the causal limit (no host
    sync for their size) and the comparison's two totals are copied to the host while the
    mask bits are built, so the host waits for the count kernel only, not for the stream (the
    bits kernels skip their work on the device when the totals say "tiles").

    ``lagged`` (the kernels' own planning): decide ``auto`` from the totals of the previous
    counted call with the same shapes and block sizes when there was one (alike calls count
    every :data:`LAGGED_SAMPLE_EVERY`-th time), so the host does not wait at all: a training
    step's forward would otherwise wait for the previous step's backward to drain before it
    can queue its own kernels. When those totals have not reached the host yet (the host
    runs more than a call ahead of the device), the previous call's own verdict serves:
    waiting for them would drain the device's queue and leave the GPU idle for a good part
    of the forward. Either choice computes the same attention; only its speed depends on
    the choice.
    """
    policy = gather_policy(kernel) if policy is None else policy
    if policy == "never" or not gather_eligible(mask, bias, seqlen_q, seqlen_k, block_m):
        return None
    if policy == "auto" and seqlen_k < 4 * block_n:
        return None
    union_u8, rows_per_tile = _tile_union(mask, summary, block_m)
    auto = policy == "auto"
    # While a CUDA graph is captured no event may be waited on or queried: the plan follows
    # what the host already knows, else tile lists (correct whatever the totals).
    capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()
    memo_key = None
    verdict = None  # True: gather, False: tiles, None: from this call's own totals
    sample = True  # this call counts its tiles for the verdicts of later calls
    if auto and lagged:
        memo_key = (mask.device, tuple(mask.shape), seqlen_q, seqlen_k, bool(is_causal),
                    block_m, block_n)
        memo = _LAGGED_TOTALS.get(memo_key)
        if memo is not None:
            verdict = memo.on_host.gathers(capturing, wait=False)
            memo.calls += 1
            sample = memo.calls % LAGGED_SAMPLE_EVERY == 0
    if auto and capturing and verdict is None:
        verdict = False
    count = auto and sample and not capturing
    if verdict is False and not count:
        return None  # decided on tile lists, and nothing to count for later calls
    idx, cnt, totals = _compact_keys(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                     block_m, block_n, count)
    on_host = _TotalsToHost(totals, verdict) if count else None
    if memo_key is not None and on_host is not None:
        memo = _LAGGED_TOTALS.get(memo_key)
        if memo is None:
            memo = _LAGGED_TOTALS[memo_key] = _LaggedTotals(on_host)
        memo.on_host = on_host
        _LAGGED_TOTALS.move_to_end(memo_key)
        while len(_LAGGED_TOTALS) > _LAGGED_KEYS:
            _LAGGED_TOTALS.popitem(last=False)
    if verdict is False:
        return None
    skip_check = totals if verdict is None else None  # a decided plan is built whatever they say
    if summary is not None and summary.key_bits is not None and block_m % 64 == 0:
        # The summary's key bits hold the mask (and causality) at an eighth of its size.
        gbits = _gather_key_bits(summary.key_bits, idx, cnt, seqlen_q, block_m, skip_check)
    else:
        gbits = _gather_mask_bits(mask.view(torch.uint8), union_u8, rows_per_tile, seqlen_q,
                                  block_m, is_causal, skip_check)
    gbias = (_gather_bias(bias, idx, cnt, seqlen_k, skip_check)
             if _bias_per_key(bias, seqlen_k) else None)
    if verdict is None and on_host is not None and not on_host.gathers(False):
        return None
    return KeyGather(block_m=block_m, head_div=num_heads // mask.shape[1],
                     idx=idx, cnt=cnt, gbits=gbits, gbias=gbias)


class _LaggedTotals:
    """The last counted totals of alike lagged plans and how many plans have used them."""

    __slots__ = ("on_host", "calls")

    def __init__(self, on_host: "_TotalsToHost"):
        self.on_host = on_host
        self.calls = 0


# Lagged plans of alike calls count their tiles (a zeroed device counter, a pinned copy and
# an event: host time on every call of a host-bound forward) every this many calls; the
# others follow the last count. Tests set 1.
LAGGED_SAMPLE_EVERY = 8
# Totals of the last lagged auto plan per (device, mask shape, lengths, causal, blocks).
_LAGGED_TOTALS: "OrderedDict[tuple, _LaggedTotals]" = OrderedDict()
_LAGGED_KEYS = 64


def prefers_tiles(live_tiles: int, gathered_tiles: int) -> bool:
    """The ``auto`` policy: tile skipping unless gathering visits at most ``GATHER_MAX_RATIO``
    of the live tiles (integer form, the same test the bits kernels make on the device)."""
    num, den = GATHER_MAX_RATIO
    return gathered_tiles * den > live_tiles * num


class _TotalsToHost:
    """The totals of one auto plan copied to the host behind an event: :meth:`values` waits
    for the work queued before it, not for what was queued after it; ``planned_with`` is the
    verdict the call was planned with (None: its own totals)."""

    def __init__(self, totals: torch.Tensor, planned_with: Optional[bool] = None):
        self.planned_with = planned_with
        self.read = None
        self.event = None
        if totals.is_cuda:
            self.host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
            self.host.copy_(totals, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(totals.device))
        else:
            self.host = totals

    def values(self):
        if self.read is None:
            if self.event is not None:
                self.event.synchronize()
            self.read = self.host.tolist()
        return self.read

    def gathers(self, capturing: bool, wait: bool = True) -> Optional[bool]:
        """Whether the totals choose gathering; while capturing (no event may be waited on
        or queried) the totals if already read, else the verdict this call was planned with;
        with ``wait`` False that verdict too while the totals are still on their way (a call
        planned from its own totals, ``planned_with`` None, is always waited for)."""
        if self.read is None:
            if capturing:
                return self.planned_with
            if (not wait and self.planned_with is not None and self.event is not None
                    and not self.event.query()):
                return self.planned_with
        return not prefers_tiles(*self.values())


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The plan's partly written outputs (tests replace it to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tile_union(mask: torch.Tensor, summary: Optional[MaskSummary],
                block_m: int) -> Tuple[torch.Tensor, int]:
    """``(union_u8, rows_per_tile)``: contiguous uint8 ``(Bx, Hx, nR, Lk)`` live-key flags of
    row blocks, ``rows_per_tile`` of which make a query tile (their OR is its union; not cut
    at the causal limit). A summary's ``row_any`` serves when its row block divides
    ``block_m``; otherwise the mask is reduced here."""
    if summary is not None and block_m % summary.row_block == 0:
        return summary.row_any.contiguous().view(torch.uint8), block_m // summary.row_block
    return block_reduce(mask, 2, block_m, "any").contiguous().view(torch.uint8), 1


def _bias_per_key(bias: Optional[torch.Tensor], seqlen_k: int) -> bool:
    return bias is not None and bias.size(2) == 1 and bias.size(3) == seqlen_k and seqlen_k > 1


def _gather_bias(bias: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor, seqlen_k: int,
                 totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A per-key bias ``(Bb, Hb, 1, Lk)`` gathered to each query tile's key list:
    ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]`` at ``(max(Bb, Bm), max(Hb, Hm))``
    (each head count divides the larger one). Written for ``c`` below the tile's count rounded
    up to GATHER_ROW_ALIGN (0 past the count), which is all the kernels read: rows are padded
    so they read aligned vectors, software-pipelined like the gathered mask; reading the bias
    at the gathered keys themselves was a synchronous load every step, a large share of the
    gathered forward. ``totals``: skip the work when :func:`prefers_tiles`.
    """
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, width = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    width = cdiv(width, GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    out = _empty((bg, hg, n_q, width), bias.dtype, bias.device)

    def bstride(t, d):  # broadcast dims read through stride 0
        return 0 if t.size(d) == 1 else t.stride(d)

    num, den = GATHER_MAX_RATIO
    _gather_bias_kernel[(n_q, bg * hg)](
        bias, idx, cnt, out, totals if totals is not None else cnt,
        bstride(bias, 0), bstride(bias, 1), bias.stride(3),
        bstride(idx, 0), bstride(idx, 1), idx.stride(2), bstride(cnt, 0), bstride(cnt, 1),
        hg, hg // hm, hg // hb, width, n_q,
        BLOCK_C=32 if bias.device.type == "cpu" else 256, ALIGN=GATHER_ROW_ALIGN,
        CHECK_TOTALS=totals is not None, RATIO_NUM=num, RATIO_DEN=den,
        num_warps=4,
    )
    return out


# gbias rows are padded to a multiple of every BLOCK_N the gathered kernels use, so a tile
# never reads past its row.
GATHER_ROW_ALIGN = 64


def _compact_keys(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int, seqlen_k: int,
                  is_causal: bool, block_m: int, block_n: int,
                  count_tiles: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(idx, cnt, totals)`` of each query tile's union (see :func:`_tile_union`), cut at
    the tile's causal limit when ``is_causal``; one Triton kernel. ``idx`` is ``Lk`` wide
    (the largest causal limit) and written up to ``cnt``. ``totals`` (with ``count_tiles``):
    int32 ``[live block_n-key tiles, gathered tiles]`` summed over every tile. Equivalent
    plain PyTorch: :func:`compact_keys_reference`."""
    bx, hx, n_rows, _ = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    device = union_u8.device
    idx = _empty((bx, hx, n_q, seqlen_k), torch.int32, device)
    cnt = torch.empty((bx, hx, n_q), dtype=torch.int32, device=device)
    totals = torch.zeros(2, dtype=torch.int32, device=device) if count_tiles else None
    chunk = 32 if device.type == "cpu" else 1024  # short chunks on the interpreter: tests cover several
    _compact_keys_kernel[(n_q, bx * hx)](
        union_u8, idx, cnt, totals if count_tiles else cnt,
        seqlen_q, seqlen_k, n_rows, n_q,
        IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, ROWS_PER_TILE=rows_per_tile,
        BLOCK_N=block_n, BLOCK_K=max(chunk, block_n), COUNT_TILES=count_tiles,
        num_warps=4,
    )
    return idx, cnt, totals


def _gather_mask_bits(mask_u8: torch.Tensor, union_u8: torch.Tensor, rows_per_tile: int,
                      seqlen_q: int, block_m: int, is_causal: bool,
                      totals: Optional[torch.Tensor] = None,
                      launch: Optional[Tuple[int, int, int]] = None) -> torch.Tensor:
    """``gbits`` of the module docstring from the unions (see :func:`_tile_union`), the lists'
    definition: ``ceil(Lk / 64)`` words a row, written up to the tile's count (the kernels
    read no further; rows past ``Lq`` are 0). ``totals``: skip the work when
    :func:`prefers_tiles`. ``launch``: ``(rows per program, warps, stages)`` instead of the
    default (for timing). Equivalent plain PyTorch: :func:`gather_mask_bits_reference`."""
    bx, hx, n_rows, seqlen_k = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    on_cpu = mask_u8.device.type == "cpu"
    words = max(cdiv(seqlen_k, 64), 1)
    gbits = _empty((bx, hx, n_q * block_m, words), torch.int64, mask_u8.device)
    # Walks the mask rows in order, 256 keys a step, reading them whole (coalesced) and
    # compressing each row's bits at the union's keys into a running word. Its predecessor
    # walked the output, reading the mask byte by byte at the listed keys, and wrote the
    # gathered bytes: issue-bound on scattered byte loads. 64 rows per program measured a
    # little faster than 32.
    block_r, warps, stages = launch or (min(block_m, 8 if on_cpu else 64), 4, 3)
    num, den = GATHER_MAX_RATIO
    _gather_mask_bits_kernel[(n_q * (block_m // block_r), bx * hx)](
        mask_u8, union_u8, gbits, totals if totals is not None else gbits,
        mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2), mask_u8.stride(3),
        hx, seqlen_q, seqlen_k, n_rows, n_q, words,
        IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, BLOCK_R=block_r,
        ROWS_PER_TILE=rows_per_tile, CHECK_TOTALS=totals is not None,
        RATIO_NUM=num, RATIO_DEN=den,
        num_warps=warps, num_stages=stages,
    )
    return gbits


def _gather_key_bits(key_bits: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                     seqlen_q: int, block_m: int,
                     totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gbits`` (module docstring) from a summary's key bits (``MaskSummary.key_bits``, which
    already hold the causal limit) and the compacted lists: for each 64 rows and 64 listed
    keys, the keys' words are loaded (512 bytes, where the mask rows were 4 KB) and turned
    into the rows' words, a 64 x 64 bit transpose. Written up to each tile's count;
    ``block_m`` a multiple of 64. ``totals``: skip the work when :func:`prefers_tiles`.
    Equivalent plain PyTorch: :func:`gather_key_bits_reference`."""
    bx, hx, n_q, width = idx.shape
    n_bit_rows = key_bits.size(2)
    words = max(cdiv(width, 64), 1)
    gbits = _empty((bx, hx, n_q * block_m, words), torch.int64, idx.device)
    # Four words a program: 32 contiguous bytes of each row's output, and every load of a
    # program in flight at once (no loop whose steps wait on each other's loads).
    chunks = 4
    num, den = GATHER_MAX_RATIO
    _gather_key_bits_kernel[(n_q * (block_m // 64), cdiv(words, chunks), bx * hx)](
        key_bits, idx, cnt, gbits, totals if totals is not None else cnt,
        key_bits.stride(0) if key_bits.size(0) > 1 else 0,
        key_bits.stride(1) if key_bits.size(1) > 1 else 0, key_bits.stride(2),
        hx, n_bit_rows, n_q, words, width,
        BLOCK_M=block_m, CHUNKS=chunks, CHECK_TOTALS=totals is not None,
        RATIO_NUM=num, RATIO_DEN=den, num_warps=4,
    )
    return gbits


def gather_key_bits_reference(key_bits: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                              seqlen_q: int, block_m: int,
                              totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain PyTorch :func:`_gather_key_bits` (0 past the counts; ``totals`` ignored)."""
    bx, hx, n_q, width = idx.shape
    n_bit_rows = key_bits.size(2)
    live = torch.arange(width, device=idx.device) < cnt[..., None]
    keys = torch.where(live, idx, 0).long()
    rows = torch.zeros((bx, hx, n_q * block_m, width), dtype=torch.uint8, device=idx.device)
    for i in range(min(n_q * block_m, n_bit_rows * 64)):
        m, w, bit = i // block_m, i // 64, i % 64
        words = torch.gather(key_bits[:, :, w].expand(bx, hx, -1), -1, keys[:, :, m])
        rows[:, :, i] = torch.where(live[:, :, m], (words >> bit) & 1, 0).to(torch.uint8)
    return pack_bits_reference(rows)


def pack_bits_reference(flags: torch.Tensor) -> torch.Tensor:
    """``(..., C)`` flags as ``(..., ceil(C / 64))`` int64 words, bit ``c % 64`` of word
    ``c // 64`` set where ``flags[..., c]`` is non-zero (the layout of ``gbits``)."""
    c = flags.size(-1)
    words = max(cdiv(c, 64), 1)
    padded = torch.zeros((*flags.shape[:-1], words * 64), dtype=torch.int64, device=flags.device)
    padded[..., :c] = (flags != 0).to(torch.int64)
    shifts = torch.arange(64, device=flags.device, dtype=torch.int64)
    # Distinct bits: their sum is their OR (bit 63 wraps to the sign bit, as in the kernel).
    return (padded.view(*flags.shape[:-1], words, 64) << shifts).sum(-1)


def tile_union_reference(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int,
                         seqlen_k: int, is_causal: bool, block_m: int) -> torch.Tensor:
    """Bool ``(Bx, Hx, nQ, Lk)``: each query tile's live keys, the OR of its union rows cut
    at its causal limit (what :func:`_compact_keys` lists)."""
    bx, hx, n_rows, _ = union_u8.shape
    n_q = cdiv(seqlen_q, block_m)
    rows = torch.zeros((bx, hx, n_q * rows_per_tile, seqlen_k), dtype=torch.bool,
                       device=union_u8.device)
    rows[:, :, :n_rows] = union_u8 != 0
    union = rows.view(bx, hx, n_q, rows_per_tile, seqlen_k).any(3)
    if is_causal:
        q_last = torch.clamp(torch.arange(n_q, device=union.device) * block_m + block_m,
                             max=seqlen_q) - 1
        keys = torch.arange(seqlen_k, device=union.device)
        union = union & (keys[None, :] <= (q_last + (seqlen_k - seqlen_q))[:, None])
    return union


def compact_keys_reference(union_u8: torch.Tensor, rows_per_tile: int, seqlen_q: int,
                           seqlen_k: int, is_causal: bool, block_m: int, block_n: int,
                           count_tiles: bool):
    """Plain PyTorch :func:`_compact_keys` (``idx`` zero past the counts)."""
    union = tile_union_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                 block_m)
    cnt = union.sum(-1, dtype=torch.int32)
    ar = torch.arange(seqlen_k, device=union.device, dtype=torch.int32)
    order = torch.sort((~union).to(torch.int32) * seqlen_k + ar, dim=-1).values % seqlen_k
    idx = torch.where(ar < cnt[..., None], order, 0).to(torch.int32).contiguous()
    totals = None
    if count_tiles:
        live = block_reduce(union, 3, block_n, "any").sum()
        gathered = torch.div(cnt + (block_n - 1), block_n, rounding_mode="floor").sum()
        totals = torch.stack([live, gathered]).to(torch.int32)
    return idx, cnt, totals


def gather_mask_bits_reference(mask_u8: torch.Tensor, union_u8: torch.Tensor,
                               rows_per_tile: int, seqlen_q: int, block_m: int,
                               is_causal: bool, totals: Optional[torch.Tensor] = None,
                               launch=None) -> torch.Tensor:
    """Plain PyTorch :func:`_gather_mask_bits` (0 past the counts; ``totals`` and ``launch``
    are ignored: the bits are always built)."""
    bx, hx, _, seqlen_k = union_u8.shape
    union = tile_union_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                 block_m)
    n_q = union.size(2)
    idx, cnt, _ = compact_keys_reference(union_u8, rows_per_tile, seqlen_q, seqlen_k,
                                         is_causal, block_m, 64, False)
    idx = idx.long()
    pos = torch.arange(seqlen_k, device=union_u8.device)
    rows = torch.zeros((bx, hx, n_q, block_m, seqlen_k), dtype=torch.uint8,
                       device=union_u8.device)
    for m in range(n_q):
        r0, r1 = m * block_m, min(m * block_m + block_m, seqlen_q)
        src = mask_u8[:, :, r0:r1].expand(bx, hx, r1 - r0, seqlen_k)
        keys = idx[:, :, m, None, :].expand(bx, hx, r1 - r0, seqlen_k)
        got = torch.gather(src, -1, keys)
        keep = pos < cnt[:, :, m, None, None]
        if is_causal:
            row = torch.arange(r0, r1, device=keys.device)
            keep = keep & (keys <= (row + (seqlen_k - seqlen_q))[:, None])
        rows[:, :, m, :r1 - r0] = torch.where(keep, got, 0)
    return pack_bits_reference(rows.view(bx, hx, n_q * block_m, seqlen_k))


def gather_bias_reference(bias: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                          seqlen_k: int, totals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain PyTorch :func:`_gather_bias` (0 past the counts; ``totals`` is ignored)."""
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, width = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    padded = cdiv(width, GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    rows = bias[:, :, 0, :].expand(bg, hb, seqlen_k).repeat_interleave(hg // hb, dim=1)
    live = torch.arange(width, device=idx.device) < cnt[..., None]
    keys = torch.where(live, idx, 0).expand(bg, hm, n_q, width).repeat_interleave(hg // hm, dim=1)
    out = torch.zeros((bg, hg, n_q, padded), dtype=bias.dtype, device=bias.device)
    picked = torch.gather(rows, -1, keys.reshape(bg, hg, n_q * width).long()).view(bg, hg, n_q, width)
    live = live.expand(bg, hm, n_q, width).repeat_interleave(hg // hm, dim=1)
    out[..., :width] = torch.where(live, picked, torch.zeros((), dtype=bias.dtype, device=bias.device))
    return out


@triton.jit
def _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """One past the last key query tile ``m`` may list: its last row's bottom-right causal
    limit, or Lk."""
    key_end = seqlen_k
    if IS_CAUSAL:
        last_row = tl.minimum(m * BLOCK_M + BLOCK_M, seqlen_q) - 1
        key_end = tl.maximum(tl.minimum(last_row + (seqlen_k - seqlen_q) + 1, seqlen_k), 0)
    return key_end


@triton.jit
def _union_flags(union_rows, keys, key_end, rows_left, seqlen_k,
                 ROWS_PER_TILE: tl.constexpr):
    """int32 0/1 per key: live in one of the tile's union rows (``rows_left`` of them exist)
    and before ``key_end``. Read bounded by Lk (vector loads), then cut."""
    k_ok = keys < seqlen_k
    live = tl.load(union_rows + keys, mask=k_ok, other=0)
    for r in tl.static_range(1, ROWS_PER_TILE):
        row_ok = (keys * 0 + r) < rows_left  # a vector: the interpreter takes no scalar
        live = live | tl.load(union_rows + r * seqlen_k + keys, mask=k_ok & row_ok, other=0)
    return ((live != 0) & (keys < key_end)).to(tl.int32)


@triton.jit
def _skip_for_tiles(Totals, RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr):
    """Whether the plan's totals ``[live tiles, gathered tiles]`` chose tile skipping
    (gather.prefers_tiles on the device)."""
    two = tl.arange(0, 2)
    tot = tl.load(Totals + two)
    live = tl.sum(tl.where(two == 0, tot, 0), 0)
    gathered = tl.sum(tl.where(two == 1, tot, 0), 0)
    return gathered * RATIO_DEN > live * RATIO_NUM


@triton.jit
def _compact_keys_kernel(
    Union, Idx, Cnt, Totals, seqlen_q, seqlen_k, n_rows, n_q,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_TILES: tl.constexpr,
):
    """One query tile: its union's live keys (to its causal limit) in order into its idx row,
    their number into cnt; with COUNT_TILES, adds its live BLOCK_N-key tiles and its gathered
    tiles (ceil(count / BLOCK_N)) to Totals[0] and Totals[1]."""
    m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    union_rows = Union + (bh * n_rows + m * ROWS_PER_TILE) * seqlen_k
    idx_row = Idx + (bh * n_q + m) * seqlen_k
    rows_left = n_rows - m * ROWS_PER_TILE
    key_end = _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
    base = 0
    live_tiles = 0
    for start in range(0, key_end, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        live_i = _union_flags(union_rows, keys, key_end, rows_left, seqlen_k, ROWS_PER_TILE)
        tl.store(idx_row + base + tl.cumsum(live_i, 0) - 1, keys, mask=live_i != 0)
        base += tl.sum(live_i, 0)
        if COUNT_TILES:
            # Chunks start at multiples of BLOCK_K, so these are the kernels' key tiles.
            per_tile = tl.max(tl.reshape(live_i, [BLOCK_K // BLOCK_N, BLOCK_N]), 1)
            live_tiles += tl.sum(per_tile, 0)
    tl.store(Cnt + bh * n_q + m, base)
    if COUNT_TILES:
        two = tl.arange(0, 2)
        gathered = (base + BLOCK_N - 1) // BLOCK_N
        tl.atomic_add(Totals + two, tl.where(two == 0, live_tiles, gathered))


@triton.jit
def _rows_flag(flag, BLOCK_R: tl.constexpr):
    """A scalar condition as a ``[BLOCK_R]`` store mask (the interpreter takes no scalar)."""
    return (tl.zeros([BLOCK_R], dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _load_word(union_rows, mask_rows, start, lanes, m_ok, key_end, rows_left, seqlen_k,
               stride_mn, ROWS_PER_TILE: tl.constexpr):
    """The tile's union flags (int32 0/1, see _union_flags) and the rows' mask bytes of keys
    ``start + lanes``.

    The mask is read bounded by Lk, not the causal limit: a bound the compiler knows to be a
    multiple of 16 lets it read 16-byte vectors (per-byte loads left the kernel waiting on
    memory with DRAM 10 % busy); bytes past the limit meet no live flag."""
    keys = start + lanes
    live_i = _union_flags(union_rows, keys, key_end, rows_left, seqlen_k, ROWS_PER_TILE)
    mv = tl.load(mask_rows + keys[None, :].to(tl.int64) * stride_mn,
                 mask=m_ok[:, None] & (keys < seqlen_k)[None, :], other=0)
    return live_i, mv


@triton.jit
def _cut(mv, start, lanes, row_lim):
    """Mask bytes of keys ``start + lanes`` zeroed past each row's causal limit."""
    return tl.where((start + lanes)[None, :] <= row_lim[:, None], mv, 0)


@triton.jit
def _pack_word(live_i, mv, lanes, acc, fill, word, out_rows, BLOCK_R: tl.constexpr):
    """Appends the rows' mask bits at one 64-key word's live keys to the running words
    ``acc`` (``fill`` bits in use; stored as gbits word ``word`` when full)."""
    n_live = tl.sum(live_i, 0)
    lo_half = lanes < 32
    n_lo = tl.sum(tl.where(lo_half, live_i, 0), 0)
    # Each live key's bit in its 32-key half's compressed value (32-bit math: the 64-bit
    # version issued about 25 instructions per mask byte); the mask bytes are 0 or 1, so the
    # packing is a dot product of bytes and bit values (distinct bits: the sum is their OR).
    pos = tl.cumsum(live_i, 0) - live_i - tl.where(lo_half, 0, n_lo)
    val = live_i << pos
    mb = (mv != 0).to(tl.int32)
    got_lo = tl.sum(mb * tl.where(lo_half, val, 0)[None, :], 1)
    got_hi = tl.sum(mb * tl.where(lo_half, 0, val)[None, :], 1)
    got = (got_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
           | (got_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << n_lo.to(tl.uint64)))
    acc = acc | (got << fill.to(tl.uint64))
    fill += n_live
    full = fill >= 64
    tl.store(out_rows + word, acc.to(tl.int64, bitcast=True), mask=_rows_flag(full, BLOCK_R))
    word += full.to(tl.int32)
    fill -= 64 * full.to(tl.int32)
    # After a store, the bits of got that did not fit: the top ``fill`` of its ``n_live``
    # (fill == 0: none, and no 64-bit shift).
    spill = got >> ((n_live - fill) & 63).to(tl.uint64)
    acc = tl.where(full, tl.where(fill > 0, spill, 0).to(tl.uint64), acc)
    return acc, fill, word


@triton.jit
def _gather_mask_bits_kernel(
    Mask, Union, GBits, Totals,
    stride_mb, stride_mh, stride_mm, stride_mn,
    num_heads_m, seqlen_q, seqlen_k, n_rows, n_q, n_words,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """``BLOCK_R`` gbits rows: each row's mask bits at the union's keys, packed in order.

    Per 64-key word: the union's flags give each live key its position among the word's live
    keys (an exclusive prefix count); each row's bits land there in one 64-bit value, which is
    appended to the row's running word ``acc`` at bit ``fill``; a full word is stored and its
    overflow starts the next one. No branches: with the mask load behind a branch on the
    word's live count, every word waited for two memory latencies.
    Words past the tile's count are not written. CHECK_TOTALS: nothing is done when the
    plan's totals chose tile skipping.
    """
    SPLITS: tl.constexpr = BLOCK_M // BLOCK_R
    m = tl.program_id(0) // SPLITS
    part = tl.program_id(0) % SPLITS
    bh = tl.program_id(1)
    b = (bh // num_heads_m).to(tl.int64)
    h = (bh % num_heads_m).to(tl.int64)
    union_rows = Union + (bh.to(tl.int64) * n_rows + m * ROWS_PER_TILE) * seqlen_k
    rows_left = n_rows - m * ROWS_PER_TILE
    key_end = _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
    if CHECK_TOTALS:
        key_end = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, key_end)
    in_tile = part * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_m = m * BLOCK_M + in_tile
    m_ok = offs_m < seqlen_q
    row_lim = offs_m + (seqlen_k - seqlen_q)  # bottom-right causal: the last key a row sees
    first_lim = m * BLOCK_M + part * BLOCK_R + (seqlen_k - seqlen_q)  # the smallest of them
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m[:, None].to(tl.int64) * stride_mm
    out_rows = GBits + ((bh.to(tl.int64) * n_q + m) * BLOCK_M + in_tile) * n_words
    lanes = tl.arange(0, 64)
    acc = tl.zeros([BLOCK_R], dtype=tl.uint64)
    fill = tl.zeros([], dtype=tl.int32)  # bits of acc in use, 0..63
    word = tl.zeros([], dtype=tl.int32)  # the gbits word acc becomes
    # Four 64-key words a step, all loaded before any is packed: the loads of one step are
    # then in flight together (one word a step waits on memory).
    for start in range(0, key_end, 256):
        u0, m0 = _load_word(union_rows, mask_rows, start, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u1, m1 = _load_word(union_rows, mask_rows, start + 64, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u2, m2 = _load_word(union_rows, mask_rows, start + 128, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u3, m3 = _load_word(union_rows, mask_rows, start + 192, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        if IS_CAUSAL:
            # Each row's bytes past its own causal limit read as 0, so the gathered kernels
            # need no causal test; only steps reaching past the first row's limit need the
            # cut (in every step it would cost a noticeable share of the kernel).
            if start + 255 > first_lim:
                m0 = _cut(m0, start, lanes, row_lim)
                m1 = _cut(m1, start + 64, lanes, row_lim)
                m2 = _cut(m2, start + 128, lanes, row_lim)
                m3 = _cut(m3, start + 192, lanes, row_lim)
        acc, fill, word = _pack_word(u0, m0, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u1, m1, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u2, m2, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u3, m3, lanes, acc, fill, word, out_rows, BLOCK_R)
    tl.store(out_rows + word, acc.to(tl.int64, bitcast=True), mask=_rows_flag(fill > 0, BLOCK_R))


@triton.jit
def _gather_key_bits_kernel(
    KeyBits, Idx, Cnt, GBits, Totals,
    stride_kb, stride_kh, stride_kw,
    num_heads_m, n_bit_rows, n_q, n_words, width,
    BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """64 gbits rows x CHUNKS words: the listed keys' key-bit words of the rows' 64-query
    word, transposed. 32-bit math on the words' halves (rows 0-31 read the low half, 32-63
    the high one), each output word packed as two 32-key halves (distinct bits: sums)."""
    HALVES: tl.constexpr = BLOCK_M // 64
    m = tl.program_id(0) // HALVES
    qw = tl.program_id(0)  # the rows' key-bits word row: m * HALVES + half
    bh = tl.program_id(2)
    b = (bh // num_heads_m).to(tl.int64)
    h = (bh % num_heads_m).to(tl.int64)
    cnt = tl.load(Cnt + bh.to(tl.int64) * n_q + m)
    if CHECK_TOTALS:
        cnt = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, cnt)
    word0 = tl.program_id(1) * CHUNKS
    if word0 * 64 < cnt:
        cols = word0 * 64 + tl.arange(0, CHUNKS * 64)
        ok = cols < cnt
        keys = tl.load(Idx + (bh.to(tl.int64) * n_q + m) * width + cols, mask=ok, other=0)
        kw = tl.load(KeyBits + b * stride_kb + h * stride_kh + qw.to(tl.int64) * stride_kw + keys,
                     mask=ok & ((cols * 0 + qw) < n_bit_rows), other=0)  # vector: interpreter
        lo = kw.to(tl.int32)  # the low 32 bits (truncation)
        hi = (kw >> 32).to(tl.int32)
        rows = tl.arange(0, 64)
        half_word = tl.where((rows < 32)[:, None], lo[None, :], hi[None, :])
        bit = (half_word >> (rows % 32)[:, None]) & 1  # (64 rows, CHUNKS * 64 keys)
        lane = tl.arange(0, CHUNKS * 64) % 64
        val = bit << (lane % 32)[None, :]
        val3 = tl.reshape(val, (64, CHUNKS, 64))
        low_keys = (tl.arange(0, 64) < 32)[None, None, :]
        got_lo = tl.sum(tl.where(low_keys, val3, 0), 2)
        got_hi = tl.sum(tl.where(low_keys, 0, val3), 2)
        word = (got_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
                | (got_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32))
        out_words = word0 + tl.arange(0, CHUNKS)
        out_rows = (bh.to(tl.int64) * n_q * BLOCK_M + qw * 64 + rows) * n_words
        tl.store(GBits + out_rows[:, None] + out_words[None, :], word.to(tl.int64, bitcast=True),
                 mask=(out_words * 64 < cnt)[None, :])


@triton.jit
def _gather_bias_kernel(
    Bias, Idx, Cnt, GBias, Totals,
    stride_bb, stride_bh, stride_bk,
    stride_ib, stride_ih, stride_im, stride_cb, stride_ch,
    num_heads_g, head_div_m, head_div_b, width, n_q,
    BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """One gbias row (see :func:`_gather_bias`) per program: bias values at the tile's keys,
    0 from its count to the next multiple of ALIGN."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_g).to(tl.int64)
    h = bh % num_heads_g
    hm = (h // head_div_m).to(tl.int64)
    idx_row = Idx + b * stride_ib + hm * stride_ih + m * stride_im
    count = tl.load(Cnt + b * stride_cb + hm * stride_ch + m)
    bias_row = Bias + b * stride_bb + (h // head_div_b).to(tl.int64) * stride_bh
    out_row = GBias + (bh.to(tl.int64) * n_q + m) * width
    end = (count + ALIGN - 1) // ALIGN * ALIGN
    if CHECK_TOTALS:
        end = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, end)
    for start in range(0, end, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        used = cols < count
        keys = tl.load(idx_row + cols, mask=used, other=0)
        vals = tl.load(bias_row + keys.to(tl.int64) * stride_bk, mask=used, other=0.0)
        tl.store(out_row + cols, vals, mask=cols < end)
