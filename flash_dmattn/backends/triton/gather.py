"""Key gathering: per query tile, the union of its rows' live keys, compacted.

Tile skipping only helps when whole (query tile, key tile) blocks are dead. The dynamic-mask
workload defeats it: each query keeps its own top-k keys, scattered over the sequence, so every
128 x 64 block holds a few live keys and no block is dead. But consecutive queries keep nearly
the same keys (a per-key bias ranks keys the same way for every query), so the *union* of a
query tile's live keys is barely larger than one query's. Gather mode walks that union instead
of the key tiles: the kernels load K/V rows by index, BLOCK_N gathered keys at a time, so the
work is about ``union size / Lk`` of the dense work.

Built per call from the mask (and a per-key bias), on their device, by three small Triton
kernels after the mask summary, with one host sync (the largest union sizes the outputs):

* ``idx``  ``(Bm, Hm, nQ, C)`` int32: the live keys of each query tile, ascending, then zeros;
  only the first ``cnt`` of a row are meaningful;
* ``cnt``  ``(Bm, Hm, nQ)`` int32;
* ``gbits`` ``(Bm, Hm, nQ * block_m, W)`` int64: the mask gathered to those columns, 64
  columns per word: bit ``c % 64`` of ``gbits[b, h, i, c // 64]`` is
  ``mask[b, h, i, idx[b, h, i // block_m, c]]``, so the kernels read a gathered tile's element
  mask as one word per row (its bytes were 8 KB per 128 x 64 tile);
* ``gbias`` (a per-key bias only) ``(Bg, Hg, nQ, C)``: the bias at those keys,
  ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]``, read at the same positions, so no
  load in the kernels' loop depends on another load of the same step;

where ``C`` is the largest union and ``W = ceil(C / 64)`` (``Bm, Hm`` are the mask's own,
possibly broadcast, dims; rows of ``gbias`` are padded to a multiple of 64). No (B, H, Lq, Lk)
temporary is made: the largest is ``gbits``, at most an eighth of the mask's own size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...block_map import block_reduce
from ...intmath import cdiv
from .mask_summary import MaskSummary

# Use gather mode when it visits at most this fraction of the key tiles that tile skipping
# would visit. Gathered tiles always load their element mask and their K/V rows by index, so
# they cost a little more than a partial tile of the plain path.
GATHER_MAX_RATIO = 0.75
_POLICIES = ("auto", "always", "never")

# Default policy per kernel. On the H200 run of 2026-11-22 (B1 H16/Hkv4 L8192 D128, top-2048
# per query, causal) the gathered forward kernel took 0.795 ms against 1.365 ms for tile
# skipping; what had kept the forward on "never" since 2026-11-21 (3.09 vs 2.25 ms) was the
# torch-built plan (sort + gather, 0.72 ms), now one compact-and-gather kernel.
DEFAULT_POLICY = {"forward": "auto", "dq": "auto"}


def gather_policy(kernel: str = "forward") -> str:
    """``FLASH_DMATTN_TRITON_GATHER``: ``auto`` (gather when it saves work), ``always`` (when
    the inputs allow it; for tests) or ``never``; unset: :data:`DEFAULT_POLICY` of ``kernel``."""
    policy = os.environ.get("FLASH_DMATTN_TRITON_GATHER", "").strip().lower()
    if not policy:
        return DEFAULT_POLICY[kernel]
    if policy not in _POLICIES:
        raise ValueError(f"FLASH_DMATTN_TRITON_GATHER must be one of {_POLICIES}, got {policy!r}")
    return policy


@dataclass(frozen=True)
class KeyGather:
    """Gathered key lists of one call for query tiles of ``block_m`` rows (see module doc)."""

    block_m: int
    capacity: int
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
) -> Optional[KeyGather]:
    """Gather lists for ``block_m``-row query tiles, or None when tile skipping is as cheap.

    ``policy`` defaults to :func:`gather_policy` of ``kernel`` (``forward`` or ``dq``). Under
    ``auto`` the union sizes are compared with the live-tile count of ``block_m x block_n``
    tiles (one host sync).
    """
    policy = gather_policy(kernel) if policy is None else policy
    if policy == "never" or not gather_eligible(mask, bias, seqlen_q, seqlen_k, block_m):
        return None
    if policy == "auto" and seqlen_k < 4 * block_n:
        return None
    device = mask.device
    hx = mask.shape[1]
    n_q = cdiv(seqlen_q, block_m)

    # (bx, hx, nQ, Lk); a MaskSummary already holds it (or a finer version of it)
    union = summary.row_union(block_m) if summary is not None else block_reduce(mask, 2, block_m, "any")
    if is_causal:
        q_last = torch.clamp(torch.arange(n_q, device=device) * block_m + block_m, max=seqlen_q) - 1
        keys = torch.arange(seqlen_k, device=device)
        union = union & (keys[None, :] <= (q_last + (seqlen_k - seqlen_q))[:, None])
    cnt = union.sum(-1, dtype=torch.int32)
    if policy == "auto":
        live_tiles = block_reduce(union, 3, block_n, "any").sum()
        gathered_tiles = torch.div(cnt + (block_n - 1), block_n, rounding_mode="floor").sum()
        live, gathered, capacity = torch.stack(
            [live_tiles, gathered_tiles, cnt.max().to(live_tiles.dtype)]).tolist()
        if gathered > GATHER_MAX_RATIO * live:
            return None
    else:
        capacity = int(cnt.max().item())
    capacity = max(int(capacity), 1)

    cnt = cnt.contiguous()
    union_u8 = union.contiguous().view(torch.uint8)
    idx, gbits = _compact_and_gather(mask.view(torch.uint8), union_u8, seqlen_q, seqlen_k,
                                     is_causal, block_m, capacity)
    gbias = _gather_bias(bias, idx, seqlen_k) if _bias_per_key(bias, seqlen_k) else None
    return KeyGather(block_m=block_m, capacity=capacity, head_div=num_heads // hx,
                     idx=idx, cnt=cnt, gbits=gbits, gbias=gbias)


def _bias_per_key(bias: Optional[torch.Tensor], seqlen_k: int) -> bool:
    return bias is not None and bias.size(2) == 1 and bias.size(3) == seqlen_k and seqlen_k > 1


def _gather_bias(bias: torch.Tensor, idx: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """A per-key bias ``(Bb, Hb, 1, Lk)`` gathered to each query tile's key list:
    ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]`` at ``(max(Bb, Bm), max(Hb, Hm))``
    (each head count divides the larger one; entries past a tile's count read key 0 and are
    hidden by the kernels' count bound; the row padding is 0). Rows are padded to a multiple of
    GATHER_ROW_ALIGN so the kernels read them as aligned vectors, software-pipelined like the
    gathered mask; reading the bias at the gathered keys themselves was a synchronous load
    every step (0.11 ms of the 0.79 ms gathered forward on T2, H200).
    """
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, capacity = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    width = -(-capacity // GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    out = torch.empty((bg, hg, n_q, width), dtype=bias.dtype, device=bias.device)

    def bstride(t, d):  # broadcast dims read through stride 0
        return 0 if t.size(d) == 1 else t.stride(d)

    _gather_bias_kernel[(n_q, bg * hg)](
        bias, idx, out,
        bstride(bias, 0), bstride(bias, 1), bias.stride(3),
        bstride(idx, 0), bstride(idx, 1), idx.stride(2),
        hg, hg // hm, hg // hb, capacity, width, n_q,
        BLOCK_C=32 if bias.device.type == "cpu" else 256,
        num_warps=4,
    )
    return out


# gbias rows are padded to a multiple of every BLOCK_N the gathered kernels use, so a tile
# never reads past its row.
GATHER_ROW_ALIGN = 64


def _compact_and_gather(mask_u8: torch.Tensor, union_u8: torch.Tensor, seqlen_q: int,
                        seqlen_k: int, is_causal: bool, block_m: int,
                        capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(idx, gbits)`` of the module docstring from ``union_u8`` (contiguous live-key flags,
    already cut to the causal limit when ``is_causal``; ``capacity``: its largest row count).

    Two Triton kernels: one compacts each union row into its key list, one packs the mask's
    bits at those keys. Equivalent plain PyTorch::

        order = torch.sort((~union).int() * Lk + torch.arange(Lk), dim=-1).values
        idx = order[..., :capacity] % Lk                     # live keys first, ascending
        g[b, h, i, c] = mask[b, h, i, idx[b, h, i // block_m, c]]   # then 64 c's per word

    Entries past a tile's count are 0 in ``idx`` and their bits in ``gbits`` (the kernels bound
    gathered keys by the count anyway), as are rows past ``Lq`` in the last tile.
    """
    bx, hx, n_q, _ = union_u8.shape
    device = mask_u8.device
    idx = torch.empty((bx, hx, n_q, capacity), dtype=torch.int32, device=device)
    on_cpu = device.type == "cpu"  # short chunks on the interpreter: tests cover several
    _compact_keys_kernel[(n_q, bx * hx)](
        union_u8, idx, seqlen_q, seqlen_k, n_q, capacity,
        IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, BLOCK_K=32 if on_cpu else 1024,
        num_warps=4,
    )
    return idx, _gather_mask_bits(mask_u8, union_u8, seqlen_q, block_m, capacity, is_causal)


def _gather_mask_bits(mask_u8: torch.Tensor, union_u8: torch.Tensor, seqlen_q: int,
                      block_m: int, capacity: int, is_causal: bool,
                      launch: Optional[Tuple[int, int, int]] = None) -> torch.Tensor:
    """``gbits`` of the module docstring from the union flags (the lists' definition).

    ``launch``: ``(rows per program, warps, stages)`` instead of the default (for timing)."""
    bx, hx, n_q, seqlen_k = union_u8.shape
    on_cpu = mask_u8.device.type == "cpu"
    words = max(cdiv(capacity, 64), 1)
    gbits = torch.empty((bx, hx, n_q * block_m, words), dtype=torch.int64, device=mask_u8.device)
    # Walks the mask rows in order, 256 keys a step, reading them whole (coalesced) and
    # compressing each row's bits at the union's keys into a running word. Its predecessor
    # walked the output, reading the mask byte by byte at the listed keys, and wrote the
    # gathered bytes: 0.153 ms on T2 (H200), issue-bound on scattered byte loads.
    block_r, warps, stages = launch or (min(block_m, 8 if on_cpu else 32), 4, 3)
    _gather_mask_bits_kernel[(n_q * (block_m // block_r), bx * hx)](
        mask_u8, union_u8, gbits,
        mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2), mask_u8.stride(3),
        hx, seqlen_q, seqlen_k, n_q, words,
        IS_CAUSAL=bool(is_causal), BLOCK_M=block_m, BLOCK_R=block_r,
        num_warps=warps, num_stages=stages,
    )
    return gbits


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


def compact_and_gather_reference(mask_u8: torch.Tensor, union_u8: torch.Tensor,
                                 seqlen_q: int, seqlen_k: int, is_causal: bool, block_m: int,
                                 capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`_compact_and_gather` (same outputs; for tools without a device).

    ``union_u8`` must already be causal-cut; ``seqlen_k`` and ``is_causal`` are then implied.
    """
    return (_union_keys_reference(union_u8, capacity),
            gather_mask_bits_reference(mask_u8, union_u8, seqlen_q, block_m, capacity))


def _union_keys_reference(union_u8: torch.Tensor, capacity: int) -> torch.Tensor:
    """``idx``: each union row's live keys ascending, then zeros, ``capacity`` wide."""
    union = union_u8 != 0
    seqlen_k = union.size(-1)
    ar = torch.arange(seqlen_k, device=union.device, dtype=torch.int32)
    order = torch.sort((~union).to(torch.int32) * seqlen_k + ar, dim=-1).values
    idx = order[..., :capacity] % seqlen_k
    pos = torch.arange(capacity, device=union.device)
    return torch.where(pos < union.sum(-1, keepdim=True), idx, 0).to(torch.int32).contiguous()


def gather_mask_bits_reference(mask_u8: torch.Tensor, union_u8: torch.Tensor, seqlen_q: int,
                               block_m: int, capacity: int, is_causal: bool = False) -> torch.Tensor:
    """Plain PyTorch :func:`_gather_mask_bits` (same output; ``is_causal`` is implied by the
    union, which is causal-cut)."""
    bx, hx, n_q, seqlen_k = union_u8.shape
    idx = _union_keys_reference(union_u8, capacity).long()
    cnt = (union_u8 != 0).sum(-1)
    pos = torch.arange(capacity, device=union_u8.device)
    rows = torch.zeros((bx, hx, n_q, block_m, capacity), dtype=torch.uint8,
                       device=union_u8.device)
    for m in range(n_q):
        r0, r1 = m * block_m, min(m * block_m + block_m, seqlen_q)
        src = mask_u8[:, :, r0:r1].expand(bx, hx, r1 - r0, seqlen_k)
        got = torch.gather(src, -1, idx[:, :, m, None, :].expand(bx, hx, r1 - r0, capacity))
        rows[:, :, m, :r1 - r0] = torch.where(pos < cnt[:, :, m, None, None], got, 0)
    return pack_bits_reference(rows.view(bx, hx, n_q * block_m, capacity))


def gather_bias_reference(bias: torch.Tensor, idx: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """Plain PyTorch :func:`_gather_bias` (same output; for tools without a device)."""
    bb, hb = bias.size(0), bias.size(1)
    bm, hm, n_q, capacity = idx.shape
    bg, hg = max(bb, bm), max(hb, hm)
    width = -(-capacity // GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN
    rows = bias[:, :, 0, :].expand(bg, hb, seqlen_k).repeat_interleave(hg // hb, dim=1)
    keys = idx.expand(bg, hm, n_q, capacity).repeat_interleave(hg // hm, dim=1)
    out = torch.zeros((bg, hg, n_q, width), dtype=bias.dtype, device=bias.device)
    picked = torch.gather(rows, -1, keys.reshape(bg, hg, n_q * capacity).long())
    out[..., :capacity] = picked.view(bg, hg, n_q, capacity)
    return out


@triton.jit
def _compact_keys_kernel(
    Union, Idx, seqlen_q, seqlen_k, n_q, capacity,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """idx rows: the union's live keys (to the tile's causal limit) in order, then zeros."""
    m = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64) * n_q + m
    union_row = Union + row * seqlen_k
    idx_row = Idx + row * capacity
    key_end = seqlen_k
    if IS_CAUSAL:
        # Bottom-right aligned: the tile's last row sees keys up to last_row + Lk - Lq.
        last_row = tl.minimum(m * BLOCK_M + BLOCK_M, seqlen_q) - 1
        key_end = tl.maximum(tl.minimum(last_row + (seqlen_k - seqlen_q) + 1, seqlen_k), 0)
    base = 0
    for start in range(0, key_end, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        live = tl.load(union_row + keys, mask=keys < key_end, other=0) != 0
        live_i = live.to(tl.int32)
        tl.store(idx_row + base + tl.cumsum(live_i, 0) - 1, keys, mask=live)
        base += tl.sum(live_i, 0)
    for start in range(base, capacity, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        tl.store(idx_row + cols, tl.zeros([BLOCK_K], dtype=tl.int32), mask=cols < capacity)


@triton.jit
def _rows_flag(flag, BLOCK_R: tl.constexpr):
    """A scalar condition as a ``[BLOCK_R]`` store mask (the interpreter takes no scalar)."""
    return (tl.zeros([BLOCK_R], dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _load_word(union_row, mask_rows, start, lanes, m_ok, seqlen_k, stride_mn):
    """The union flags (int32 0/1) and the rows' mask bytes of keys ``start + lanes``.

    Bounded by Lk, not the causal limit: keys past the limit are not in the (causal-cut)
    union, and a bound the compiler knows to be a multiple of 16 lets it read 16-byte
    vectors (per-byte loads left the kernel waiting on memory with DRAM 10 % busy)."""
    keys = start + lanes
    k_ok = keys < seqlen_k
    live_i = (tl.load(union_row + keys, mask=k_ok, other=0) != 0).to(tl.int32)
    mv = tl.load(mask_rows + keys[None, :].to(tl.int64) * stride_mn,
                 mask=m_ok[:, None] & k_ok[None, :], other=0)
    return live_i, mv


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
    Mask, Union, GBits,
    stride_mb, stride_mh, stride_mm, stride_mn,
    num_heads_m, seqlen_q, seqlen_k, n_q, n_words,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``BLOCK_R`` gbits rows: each row's mask bits at the union's keys, packed in order.

    Per 64-key word: the union's flags give each live key its position among the word's live
    keys (an exclusive prefix count); each row's bits land there in one 64-bit value, which is
    appended to the row's running word ``acc`` at bit ``fill``; a full word is stored and its
    overflow starts the next one. No branches: with the mask load behind a branch on the
    word's live count, every word waited for two memory latencies (0.26 ms on T2, H200).
    """
    SPLITS: tl.constexpr = BLOCK_M // BLOCK_R
    m = tl.program_id(0) // SPLITS
    part = tl.program_id(0) % SPLITS
    bh = tl.program_id(1)
    b = (bh // num_heads_m).to(tl.int64)
    h = (bh % num_heads_m).to(tl.int64)
    row = bh.to(tl.int64) * n_q + m
    union_row = Union + row * seqlen_k
    key_end = seqlen_k
    if IS_CAUSAL:
        # The union is cut at the tile's causal limit: no listed key lies past it.
        last_row = tl.minimum(m * BLOCK_M + BLOCK_M, seqlen_q) - 1
        key_end = tl.maximum(tl.minimum(last_row + (seqlen_k - seqlen_q) + 1, seqlen_k), 0)
    in_tile = part * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_m = m * BLOCK_M + in_tile
    m_ok = offs_m < seqlen_q
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m[:, None].to(tl.int64) * stride_mm
    out_rows = GBits + (row * BLOCK_M + in_tile).to(tl.int64) * n_words
    lanes = tl.arange(0, 64)
    acc = tl.zeros([BLOCK_R], dtype=tl.uint64)
    fill = tl.zeros([], dtype=tl.int32)  # bits of acc in use, 0..63
    word = tl.zeros([], dtype=tl.int32)  # the gbits word acc becomes
    # Four 64-key words a step, all loaded before any is packed: the loads of one step are
    # then in flight together (one word a step: 0.19 ms on T2, H200, waiting on memory).
    for start in range(0, key_end, 256):
        u0, m0 = _load_word(union_row, mask_rows, start, lanes, m_ok, seqlen_k, stride_mn)
        u1, m1 = _load_word(union_row, mask_rows, start + 64, lanes, m_ok, seqlen_k, stride_mn)
        u2, m2 = _load_word(union_row, mask_rows, start + 128, lanes, m_ok, seqlen_k, stride_mn)
        u3, m3 = _load_word(union_row, mask_rows, start + 192, lanes, m_ok, seqlen_k, stride_mn)
        acc, fill, word = _pack_word(u0, m0, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u1, m1, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u2, m2, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u3, m3, lanes, acc, fill, word, out_rows, BLOCK_R)
    tl.store(out_rows + word, acc.to(tl.int64, bitcast=True), mask=_rows_flag(fill > 0, BLOCK_R))
    word += (fill > 0).to(tl.int32)
    for w in range(word, n_words):
        tl.store(out_rows + w, tl.zeros([BLOCK_R], dtype=tl.int64))


@triton.jit
def _gather_bias_kernel(
    Bias, Idx, GBias,
    stride_bb, stride_bh, stride_bk,
    stride_ib, stride_ih, stride_im,
    num_heads_g, head_div_m, head_div_b, capacity, width, n_q,
    BLOCK_C: tl.constexpr,
):
    """One gbias row (see :func:`_gather_bias`) per program: bias values at the tile's keys."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_g).to(tl.int64)
    h = bh % num_heads_g
    idx_row = Idx + b * stride_ib + (h // head_div_m).to(tl.int64) * stride_ih + m * stride_im
    bias_row = Bias + b * stride_bb + (h // head_div_b).to(tl.int64) * stride_bh
    out_row = GBias + (bh.to(tl.int64) * n_q + m) * width
    for start in range(0, width, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        used = cols < capacity
        keys = tl.load(idx_row + cols, mask=used, other=0)
        vals = tl.load(bias_row + keys.to(tl.int64) * stride_bk, mask=used, other=0.0)
        tl.store(out_row + cols, vals, mask=cols < width)
