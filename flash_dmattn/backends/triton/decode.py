"""Split-KV decode forward: attention for a few query tokens against a long (cached) key range.

Decoding is bandwidth-bound (docs/contract.md §4): each step reads all of K and V (plus a per-key mask and
bias) for one or a few queries. The main forward kernel gives one program a 128-row query tile
of one head, so for ``Lq = 1`` it wastes most of its rows, launches only ``B * H`` programs and
reads every K/V tile once per *query head*. This kernel instead:

* packs the ``G = H / Hkv`` query heads of a GQA group and all ``Lq`` queries into the M
  dimension of one tile (``G * Lq <= DECODE_MAX_ROWS`` rows, padded to >= 16 for ``tl.dot``),
  so each K/V tile is loaded once per kv head;
* splits the key range across ``num_splits`` programs per (batch, kv head) so that short
  batches still fill the GPU; each split writes an fp32 partial output and its log-sum-exp;
* merges the splits in a small combine kernel (one program per output row, or per column block
  of it: :func:`combine_config`); with a single split the split kernel writes the output.

Mask and bias are read through their strides in any broadcast shape of docs/contract.md §3.2 (the per-key
``(B, Hkv, 1, Lk)`` case loads one key vector per tile for the whole group). ``cache_seqlens``
gives a per-batch used length: keys past it are never loaded, and the causal diagonal is
aligned with it. Forward only: the backward of a decode call is the main backward kernels'
(they need only ``out`` and ``lse``), see :func:`flash_dmattn.planning.decode.fold_cache_seqlens`.

Paged KV (``block_table``, like ``flash_attn_with_kvcache``): K/V are page pools ``(num_pages,
page_size, Hkv, D)`` and logical key ``j`` of batch ``b`` lives in physical page
``block_table[b, j // page_size]``, slot ``j % page_size``. Each key tile computes its K/V
addresses per key (one page-id load per key, from a small cached table), so a tile may span
pages and the tile size stays independent of the page size. Only this kernel reads pages: the
backend declines paged calls that need gradients or more rows than it takes
(:func:`flash_dmattn.planning.decode.block_table_reasons`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ...intmath import cdiv, next_power_of_2
from ...planning.decode import (
    DECODE_MAX_ROWS,
    DECODE_MIN_SEQLEN_K,
    choose_num_splits,
    decode_rows,
    sm_count,
)
from .common import (
    LOG2E,
    _dot,
    _tanh,
    alloc_output,
    alloc_partials,
    broadcast_strides,
    dot_upcast,
    head_block,
    interpret_mode,
    last_dim_contiguous,
)
from ...triton_launch import launch

# Split boundaries are multiples of this, so every BLOCK_N (decode_config) tiles a split exactly.
SPLIT_ALIGN = 128
# Key tile under the CPU interpreter (small, so tiny test shapes have several tiles; tests raise
# it to make tiles span several 16-key pages).
INTERPRET_BLOCK_N = 16


def tile_pages(page_size: int, block_n: int) -> int:
    """Page ids a key tile loads (see ``_key_offsets``): 1 when a page holds whole tiles,
    ``block_n // page_size`` when a tile holds whole pages, 0 (one per key) otherwise or
    without pages."""
    if page_size <= 0:
        return 0
    if page_size % block_n == 0:
        return 1
    return block_n // page_size if block_n % page_size == 0 else 0


def use_decode_kernel(seqlen_q: int, num_heads: int, num_kv_heads: int, seqlen_k: int,
                      has_cache_seqlens: bool) -> bool:
    """Whether the triton forward runs this kernel rather than the main one: every short-query
    call (few rows per kv head) over a long key range, where splitting the keys fills the GPU
    that the main kernel's few query tiles leave idle (the decode suite of
    benchmarks/results/<gpu>/SUMMARY.md), and every call with a KV cache's used lengths, which
    only this kernel honours."""
    if seqlen_q == 0 or decode_rows(seqlen_q, num_heads, num_kv_heads) > DECODE_MAX_ROWS:
        return False
    return has_cache_seqlens or seqlen_k >= DECODE_MIN_SEQLEN_K


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------

@triton.jit
def _decode_tile(q, acc, m_i, l_i, vis, k_base, v_base, bias_base, k_off, v_off, offs_n, n_ok,
                 aux_ok, row_ok, offs_d, d_ok, stride_bn, qk_scale, cap_scale, softcap,
                 HAS_BIAS: tl.constexpr, BIAS_ROWB: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 DOT_UPCAST: tl.constexpr):
    """One key tile of the online softmax (log2 domain); returns the updated acc, m, l.

    ``k_off`` / ``v_off``: each key's row offset in K / V (:func:`_key_offsets`). ``n_ok``:
    the keys whose K, V are loaded; the others read as zeros and must be hidden by ``vis``.
    ``aux_ok``: the keys whose bias is loaded (it may include hidden in-bounds keys: a
    tile-aligned bound keeps those loads vectorised).
    """
    kt = tl.load(k_base + k_off[None, :] + offs_d[:, None],
                 mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    s = _dot(q, kt, DOT_UPCAST)
    if HAS_SOFTCAP:
        s = (softcap * 1.4426950408889634) * _tanh(s * cap_scale)
    else:
        s = s * qk_scale
    if HAS_BIAS:
        if BIAS_ROWB:
            bv = tl.load(bias_base + offs_n * stride_bn, mask=aux_ok, other=0.0)
            s = s + (bv.to(tl.float32) * 1.4426950408889634)[None, :]
        else:
            bv = tl.load(bias_base + offs_n[None, :] * stride_bn,
                         mask=row_ok[:, None] & aux_ok[None, :], other=0.0)
            s = s + bv.to(tl.float32) * 1.4426950408889634
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; subtracting 0 avoids inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + v_off[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST)
    return acc, m_new, l_i


@triton.jit
def _key_offsets(offs_n, n0, n_ld, end, bt_base, num_pages, stride_kn, stride_vn, stride_kp,
                 stride_vp, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 TILE_PAGES: tl.constexpr):
    """Row offsets in K and V of the tile's keys ``offs_n = n0 + arange(BLOCK_N)``.

    ``PAGE_SIZE > 0``: paged pools; key ``j`` lives in page ``block_table[j // PAGE_SIZE]``,
    slot ``j % PAGE_SIZE``. ``TILE_PAGES > 0``: the tile's keys lie in this many whole pages,
    or in one page (``n0`` is a multiple of ``BLOCK_N``, and one of ``BLOCK_N`` and
    ``PAGE_SIZE`` divides the other), so only those ids are loaded and each key takes its
    page's; ``0``: one id per key. Ids are loaded for every in-bounds key (``n_ld``), never
    predicated on the mask: the id loads then run beside the mask load instead of after it,
    and only the K/V loads wait for both. Ids past a cache's used length are read (they lie
    inside the table) but clamped like any other, and those keys' K/V are never loaded.
    """
    if PAGE_SIZE > 0:
        if TILE_PAGES == 1:
            page = tl.load(bt_base + n0 // PAGE_SIZE)
            slot = (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        elif TILE_PAGES > 1:
            ids = tl.load(bt_base + n0 // PAGE_SIZE + tl.arange(0, TILE_PAGES),
                          mask=n0 + tl.arange(0, TILE_PAGES) * PAGE_SIZE < end, other=0)
            page = tl.reshape(tl.broadcast_to(ids[:, None], [TILE_PAGES, PAGE_SIZE]), [BLOCK_N])
            slot = (tl.arange(0, BLOCK_N) % PAGE_SIZE).to(tl.int64)
        else:
            page = tl.load(bt_base + offs_n // PAGE_SIZE, mask=n_ld, other=0)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
        # Clamped: page ids are not checked on the GPU (that would sync); memory stays safe.
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        k_off = page * stride_kp + slot * stride_kn
        v_off = page * stride_vp + slot * stride_vn
    else:
        k_off = offs_n * stride_kn
        v_off = offs_n * stride_vn
    # One return: the compiler checks every return statement's types, constexpr branch or not.
    return k_off, v_off


@triton.jit
def _group_rows(Q, b64, hk, group, seqlen_q, stride_qb, stride_qm, stride_qh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of a split program's tile and their queries: row r is query head
    ``hk * group + r // seqlen_q``, query ``r % seqlen_q``. Returns ``(row_ok, qi, h, offs_d,
    d_ok, q)``: the real rows (``r < group * seqlen_q``), each row's query and head, the head
    dims, and q (zero on padding rows)."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    g = rows // seqlen_q
    qi = rows % seqlen_q
    h = hk * group + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (Q + b64 * stride_qb + qi[:, None].to(tl.int64) * stride_qm
              + h[:, None].to(tl.int64) * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return row_ok, qi, h, offs_d, d_ok, q


@triton.jit
def _store_split(acc, m_i, l_i, OPart, LPart, pid_s, b, batch, num_heads, seqlen_q, row_ok,
                 qi, h, offs_d, d_ok, stride_ob, stride_om, stride_oh,
                 HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    """A split program's result, from its online-softmax state (log2 domain).

    SINGLE_SPLIT: one split holds every key, so OPart / LPart are the output (B, Lq, H, D) and
    its lse (B, H, Lq, natural log), and no combine runs after the split kernel. Otherwise
    fp32 partials for :func:`_decode_combine_kernel`: row ((split * B + b) * H + h) * Lq + i,
    rows of (B, H, Lq) per split, the lse in the log2 domain."""
    has_any = l_i > 0.0
    l_use = tl.where(has_any, l_i, 1.0)
    out = acc / l_use[:, None]
    lse2 = tl.where(has_any, m_i + tl.log2(l_use), float("-inf"))  # log2 domain
    if SINGLE_SPLIT:
        o_ptrs = (OPart + b.to(tl.int64) * stride_ob + qi[:, None].to(tl.int64) * stride_om
                  + h[:, None].to(tl.int64) * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, out.to(OPart.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LPart + (b * num_heads + h).to(tl.int64) * seqlen_q + qi,
                 lse2 * 0.6931471805599453, mask=row_ok)
    else:
        prow = ((pid_s * batch + b) * num_heads + h).to(tl.int64) * seqlen_q + qi
        tl.store(OPart + prow[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LPart + prow, lse2, mask=row_ok)


@triton.jit
def _decode_split_kernel(
    Q, K, V, Mask, Bias, CacheSeqlens, BlockTable, OPart, LPart,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    batch, num_heads, group, seqlen_q, seqlen_k, keys_per_split,
    qk_scale, cap_scale, softcap,
    stride_btb, num_pages, stride_ob, stride_om, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_ROWB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_ROWB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CACHE: tl.constexpr,
    DOT_UPCAST: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    # One program: key split pid_s of (batch b, kv head hk), for every query head of the group
    # and every query. Row r of the tile is query head hk*group + r // seqlen_q, query
    # r % seqlen_q. ROWB: the mask/bias value is the same for every row (per-key or per-kv-head
    # with one query row), so one key vector is loaded per tile.
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    b64 = b.to(tl.int64)

    # q first: it does not depend on the cache length, whose load heads the chain (length ->
    # split bounds -> mask -> K/V) of a short step.
    row_ok, qi, h, offs_d, d_ok, q = _group_rows(Q, b64, hk, group, seqlen_q, stride_qb,
                                                 stride_qm, stride_qh, HEAD_DIM, BLOCK_D, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    if HAS_CACHE:
        # Clamped: values are not checked on the GPU (that would sync), memory stays safe.
        kv_len = tl.minimum(tl.maximum(tl.load(CacheSeqlens + b), 0), seqlen_k)
        # The splits divide this batch's used keys, not the capacity: with a cache half full,
        # splits past the used length would exit at once while the rest did twice the work.
        keys_per_split = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(0)), BLOCK_N) * BLOCK_N
        # Loop and load bounds stop at the used length rounded up to whole tiles (clamped to
        # the capacity), which the compiler can prove tile-aligned; the exact length only
        # hides keys. Bounding the per-key mask / bias loads by the loaded length itself made
        # masked steps clearly slower (the loads lost their known alignment).
        kv_end = tl.minimum(tl.cdiv(kv_len, BLOCK_N) * BLOCK_N, seqlen_k)
    else:
        kv_len = seqlen_k
        kv_end = seqlen_k
    start = pid_s * keys_per_split
    end = tl.minimum(start + keys_per_split, kv_end)

    if PAGE_SIZE > 0:
        # Paged: stride_kb / stride_vb are the pools' page strides, applied per key tile.
        k_base = K + hk.to(tl.int64) * stride_kh
        v_base = V + hk.to(tl.int64) * stride_vh
        bt_base = BlockTable + b64 * stride_btb
    else:
        k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
        bt_base = BlockTable
    h0 = hk * group
    if MASK_ROWB:
        mask_base = Mask + b64 * stride_mb + (h0 // mask_hdiv).to(tl.int64) * stride_mh
    else:
        mask_base = (Mask + b64 * stride_mb + (h // mask_hdiv).to(tl.int64)[:, None] * stride_mh
                     + qi.to(tl.int64)[:, None] * stride_mm)
    if BIAS_ROWB:
        bias_base = Bias + b64 * stride_bb + (h0 // bias_hdiv).to(tl.int64) * stride_bh
    else:
        bias_base = (Bias + b64 * stride_bb + (h // bias_hdiv).to(tl.int64)[:, None] * stride_bh
                     + qi.to(tl.int64)[:, None] * stride_bm)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        n_ld = offs_n < end  # in-bounds keys (up to whole tiles past the used length)
        k_off, v_off = _key_offsets(offs_n, n0, n_ld, end, bt_base, num_pages, stride_kn,
                                    stride_vn, stride_kb, stride_vb, BLOCK_N, PAGE_SIZE,
                                    TILE_PAGES)
        # Visibility is built on the key vector first and broadcast once: the masked step is
        # bound by instruction issue, so every 2-D operation per element shows in its time.
        # Padding rows (past G * Lq) are not hidden: their q is zero and their output is
        # never stored.
        if HAS_CACHE:
            key_ok = n_ld & (offs_n < kv_len)
        else:
            key_ok = n_ld
        if HAS_MASK:
            if MASK_ROWB:
                mv = tl.load(mask_base + offs_n * stride_mn, mask=n_ld, other=0)
                key_ok = key_ok & (mv != 0)
        vis = key_ok[None, :]
        if HAS_MASK:
            if not MASK_ROWB:
                mv = tl.load(mask_base + offs_n[None, :] * stride_mn,
                             mask=row_ok[:, None] & n_ld[None, :], other=0)
                vis = vis & (mv != 0)
        if IS_CAUSAL:
            vis = vis & (offs_n[None, :] <= qi[:, None] + (kv_len - seqlen_q))
        if HAS_MASK:
            # Loads are predicated on the keys some row can see, instead of branching over
            # fully hidden tiles: a branch around the loads stops Triton from pipelining them
            # (the masked step ran at several times the dense time), while a key that no row
            # sees now costs no K/V/bias bytes at all, so the step reads only what it must.
            if MASK_ROWB:
                # Every row shares the mask row, and the last query row (a real one) sees
                # every used key under causality: the live keys are key_ok, no reduction.
                key_live = key_ok
            else:
                key_live = tl.max(vis.to(tl.int32), 0) > 0
            acc, m_i, l_i = _decode_tile(
                q, acc, m_i, l_i, vis, k_base, v_base, bias_base, k_off, v_off, offs_n,
                key_live, key_live, row_ok, offs_d, d_ok, stride_bn, qk_scale, cap_scale,
                softcap, HAS_BIAS, BIAS_ROWB, HAS_SOFTCAP, DOT_UPCAST)
        else:
            acc, m_i, l_i = _decode_tile(
                q, acc, m_i, l_i, vis, k_base, v_base, bias_base, k_off, v_off, offs_n, key_ok,
                n_ld, row_ok, offs_d, d_ok, stride_bn, qk_scale, cap_scale, softcap,
                HAS_BIAS, BIAS_ROWB, HAS_SOFTCAP, DOT_UPCAST)

    _store_split(acc, m_i, l_i, OPart, LPart, pid_s, b, batch, num_heads, seqlen_q, row_ok, qi,
                 h, offs_d, d_ok, stride_ob, stride_om, stride_oh, HEAD_DIM, SINGLE_SPLIT)


@triton.jit
def _decode_combine_kernel(
    OPart, LPart, Out, Lse,
    num_splits, split_rows, num_heads, seqlen_q,
    stride_ob, stride_om, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr,
):
    # Program (r, c): output row r = (b * H + h) * Lq + i, head-dim columns
    # [c * BLOCK_D, (c + 1) * BLOCK_D): out = sum_s w_s * o_s / sum_s w_s with
    # w_s = 2^(lse_s - max lse); empty splits have lse -inf (weight 0) and o_s = 0.
    # CHUNK_S splits' log-sum-exps and partials are read together as one load each, and the
    # running max rescales the sums (online, like the attention loop): one L2 round trip per
    # chunk, where reading the lse first, then the partials, put two in a row on the critical
    # path of every decode step. Column blocks (combine_config) spread a row's partials over
    # more programs, so fewer bytes wait behind each program's loads.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_c = tl.arange(0, CHUNK_S)
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        s_ok = (s0 + offs_c) < num_splits
        rows = (s0 + offs_c).to(tl.int64) * split_rows + r
        ls = tl.load(LPart + rows, mask=s_ok, other=float("-inf"))
        o = tl.load(OPart + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(ls, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(ls - m_use)
        denom = denom * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    has_any = denom > 0.0
    d_use = tl.where(has_any, denom, 1.0)
    out = acc / d_use
    i = r % seqlen_q
    bh = r // seqlen_q
    h = bh % num_heads
    b = bh // num_heads
    tl.store(Out + b * stride_ob + i * stride_om + h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=d_ok)
    if c == 0:
        lse = tl.where(has_any, (m + tl.log2(d_use)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + r, lse)


# Combine launch: at most this many fp32 partial elements per program load (16 KiB); a row's
# head dim is cut into up to this many column blocks (of >= 16 columns) so that the kernel has
# about COMBINE_PROGRAMS_PER_SM programs per SM.
COMBINE_MAX_ELEMS = 4096
COMBINE_COLUMN_BLOCKS = 8
COMBINE_PROGRAMS_PER_SM = 4


def combine_config(num_splits: int, block_d: int, split_rows: int, device: torch.device
                   ) -> Tuple[int, int, int]:
    """``(CHUNK_S, column_blocks, num_warps)`` of the combine kernel.

    A decode step's combine waits for the whole split kernel, so its own latency is on the
    step's critical path. With one 4-warp program per output row, a batch-1 step of 32 heads
    runs 32 programs, each reading 64 splits x 128 columns in two chunks: a visible share of
    the step, slower than cuDNN's reduction. Cut into column blocks of one warp each, one
    chunk, the same rows spread over enough programs to halve that time; with a few hundred
    rows two blocks a row suffice; with thousands of rows one 4-warp program per row stays
    best (more blocks only add programs). Hence: blocks until about
    ``COMBINE_PROGRAMS_PER_SM`` programs per SM (the decode suite, benchmarks/results/<gpu>/SUMMARY.md).
    """
    target = COMBINE_PROGRAMS_PER_SM * (sm_count(device) if device.type == "cuda" else 1)
    cols = 1
    while (cols * 2 <= COMBINE_COLUMN_BLOCKS and cols * 2 <= block_d // 16
           and split_rows * cols * 2 <= target):
        cols *= 2
    chunk = max(2, min(next_power_of_2(num_splits), COMBINE_MAX_ELEMS * cols // block_d))
    return chunk, cols, 1 if cols > 1 else 4


# ------------------------------------------------------------------------------------------
# Launch configuration
# ------------------------------------------------------------------------------------------

def decode_config(block_d: int, block_m: int, softcap_and_paged: bool = False,
                  deep: bool = False) -> Tuple[int, int, int, Optional[int]]:
    """``(BLOCK_N, num_warps, num_stages, maxnreg)`` of the split kernel: fixed, not autotuned.
    ``deep``: the three-stage pipeline of :func:`use_deep_pipeline` (two programs per SM).

    The autotuner chose among configs whose times lie within a few percent on some rows and
    far apart on others, and its choice changed between processes. Timed at half, once and
    twice the split count on the benchmark's decode rows, a 64-key tile, 4 warps, 2 stages
    was the fastest or within a few percent of it on every row, and by far the best with a
    mask; with tile-aligned bounds it also beats 128-key tiles on part-filled caches
    (``cache_seqlens``). See the decode suite in benchmarks/results/<gpu>/SUMMARY.md.

    ``maxnreg``: with a mask the kernel takes 140-156 registers, so only three of the four
    programs per SM that :func:`choose_num_splits` plans for fit, and a second, nearly empty
    wave runs. Capped at 128 (no spills for up to 16 rows at head dims up to 128, checked with
    ptxas) all four fit, and long masked decode steps run markedly faster. More rows, wider
    heads, and softcap together with paged K/V keep the compiler's choice (the
    cap spilled there: 8-16 bytes with softcap and paging, hundreds with 64 rows).
    """
    maxnreg = 128 if block_m <= 16 and block_d <= 128 and not softcap_and_paged else None
    return 64, 4, 3 if deep else 2, maxnreg


# Programs per SM that the split count plans for the three-stage split kernel.
DEEP_PER_SM = 2


def use_deep_pipeline(batch: int, num_kv_heads: int, has_mask_or_bias: bool, paged: bool,
                      device: torch.device) -> bool:
    """Whether the split kernel runs three stages at two programs per SM instead of two stages
    at four: contiguous K/V without a mask or bias, when every ``(batch, kv head)`` still gets
    a program in one wave.

    Two programs with two tiles in flight each keep more bytes moving than four with one, a
    small gain on unmasked contiguous caches (at cuDNN's speed). With a per-key mask + bias it
    is slower (the masked loop is bound by instruction issue, which four programs per SM hide
    better), with more ``(batch, kv head)`` pairs than two per SM it runs a second wave, and
    paged K/V without a mask is slower too. See the decode suite in benchmarks/results/<gpu>/SUMMARY.md.
    """
    return (device.type == "cuda" and not has_mask_or_bias and not paged
            and batch * num_kv_heads <= DEEP_PER_SM * sm_count(device))


def decode_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    cache_seqlens: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    block_table: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention forward for few queries (``Lq * H / Hkv <= DECODE_MAX_ROWS``).

    Args:
        q: ``(B, Lq, H, D)``; k, v: ``(B, Lk, Hkv, D)`` (a KV cache of capacity ``Lk``).
        mask / bias / softmax_scale / is_causal / softcap: as :func:`.forward.attention_forward`
            (4-D broadcast views, any strides).
        cache_seqlens: None or int32 ``(B,)``: keys ``j >= cache_seqlens[b]`` are invisible
            and the causal diagonal is ``j <= i + cache_seqlens[b] - Lq``.
        num_splits: key splits per (batch, kv head); default :func:`choose_num_splits`.
        block_table: None, or int ``(B, P)`` page ids for paged KV: k, v are then pools
            ``(num_pages, page_size, Hkv, D)`` (page_size a multiple of 16, any strides with a
            contiguous last dim) and the logical key length is ``Lk = P * page_size``. Equivalent
            to calling with ``k = k[block_table.long()].flatten(1, 2)`` (likewise v).

    Returns ``out (B, Lq, H, D)`` in q's dtype and ``lse (B, H, Lq)`` fp32 (natural log, -inf
    and zero output for rows with no visible key). Equivalent plain PyTorch, per split ``s``
    of the keys and then merged::

        o_s, lse_s = attention(q, k[:, keys_s], v[:, keys_s], ...)      # fp32 partials
        lse = torch.logsumexp(torch.stack(lse_s), 0)
        out = sum(torch.exp(lse_s - lse)[..., None] * o_s)               # 0 where lse = -inf
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    B, Lq, H, D = q.shape
    Hkv = k.shape[2]
    if block_table is not None:
        page_size, num_pages = k.shape[1], k.shape[0]
        if page_size % 16 != 0 or page_size == 0 or block_table.shape[0] != B:
            raise ValueError(
                f"paged decode needs pools (num_pages, page_size % 16 == 0, Hkv, D) and a "
                f"(B={B}, P) block_table; got k {tuple(k.shape)}, block_table "
                f"{tuple(block_table.shape)}"
            )
        block_table = block_table.to(torch.int32).contiguous()
        Lk = block_table.shape[1] * page_size  # logical key length
    else:
        page_size, num_pages = 0, 1
        Lk = k.shape[1]
    G = H // Hkv
    rows = G * Lq
    if rows > DECODE_MAX_ROWS:
        raise ValueError(f"decode_forward takes Lq * H / Hkv <= {DECODE_MAX_ROWS} rows, got {rows}")
    if B * H * Lq == 0 or Lk == 0:
        return empty_outputs(q)
    interp = interpret_mode()
    # Under the interpreter the plan is made afresh (tests patch its settings); on a GPU it
    # depends only on the key below, and every layer of a decoding step shares it.
    plan = (_decode_plan if interp else _cached_decode_plan)(
        q.device, q.dtype, B, Lq, H, Hkv, D, Lk, mask is not None, row_invariant(mask, Lq, H, G),
        bias is not None, row_invariant(bias, Lq, H, G), bool(is_causal), softcap > 0.0,
        cache_seqlens is not None, page_size, block_table is not None, num_splits, interp)
    return launch_split_decode(
        _decode_split_kernel, plan, q, k, v,
        (mask.view(torch.uint8) if mask is not None else q, bias if bias is not None else q,
         cache_seqlens if cache_seqlens is not None else q,
         block_table if block_table is not None else q),
        (*broadcast_strides(mask, H), *broadcast_strides(bias, H),
         B, H, G, Lq, Lk, plan.keys_per_split,
         softmax_scale * LOG2E, (softmax_scale / softcap) if softcap > 0.0 else 0.0, softcap,
         block_table.stride(0) if block_table is not None else 0, num_pages),
        plan.split_meta)


# The mask and bias arguments of a launch with neither (broadcast_strides(None, H), twice).
_NO_AUX_STRIDES = (0, 0, 0, 0, 1, 0, 0, 0, 0, 1)


def plain_decode_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         softmax_scale: float, is_causal: bool) -> torch.Tensor:
    """``decode_forward(q, k, v, None, None, softmax_scale, is_causal, 0.0)[0]``: the output of
    a decode call with no mask, bias, soft cap, KV cache or pages, whose tensors have their
    last dims contiguous (stride 1, or contiguous tensors) and whose ``Lq * H / Hkv`` is at
    most :data:`DECODE_MAX_ROWS` (the caller checks both). The same plan and launches, with
    none of the per-call work those arguments would need (a plain decoding step of a model
    with no mask: :func:`flash_dmattn.backends.triton.backend.plain_decode`)."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if B * H * Lq == 0 or Lk == 0:
        return empty_outputs(q)[0]
    interp = interpret_mode()
    plan = (_decode_plan if interp else _cached_decode_plan)(
        q.device, q.dtype, B, Lq, H, Hkv, D, Lk, False, False, False, False, bool(is_causal),
        False, False, 0, False, None, interp)
    return launch_split_decode(
        _decode_split_kernel, plan, q, k, v, (q, q, q, q),
        (*_NO_AUX_STRIDES, B, H, H // Hkv, Lq, Lk, plan.keys_per_split,
         softmax_scale * LOG2E, 0.0, 0.0, 0, 1),
        plan.split_meta)[0]


# ------------------------------------------------------------------------------------------
# Host side shared by the split-KV launchers (this module's and .decode_selected's)
# ------------------------------------------------------------------------------------------

def row_invariant(t: Optional[torch.Tensor], Lq: int, H: int, G: int) -> bool:
    """Whether a mask / bias view ``(Bx, Hx, Qx, Lk)`` has the same value for every row of a
    (batch, kv head) tile: one query row (or ``Lq == 1``), and a head dim that is not per
    query head (or a group of one head). The kernels' ``*_ROWB``: one key vector a tile."""
    return t is not None and (t.size(2) == 1 or Lq == 1) and (t.size(1) != H or G == 1)


def empty_outputs(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``out`` (zeros) and ``lse`` (-inf) of a decode call with no rows or no keys."""
    B, Lq, H, D = q.shape
    out = alloc_output((B, Lq, H, D), q.dtype, q.device)
    lse = alloc_output((B, H, Lq), torch.float32, q.device)
    out.zero_()
    lse.fill_(float("-inf"))
    return out, lse


def launch_split_decode(split_kernel, plan: "DecodePlan", q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, inputs: tuple, scalars: tuple, split_meta: dict
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocates ``out (B, Lq, H, D)`` / ``lse (B, H, Lq)``, launches a split kernel over
    ``(plan.num_splits, B, Hkv)`` programs and, with several splits, the combine kernel.

    A split kernel takes ``Q, K, V, *inputs, OPart, LPart``, the (batch, key, head) strides of
    q, k, v, ``*scalars``, the (batch, query, head) strides of ``out``, then ``split_meta``:
    with one split (``plan.single``) OPart / LPart are ``out`` / ``lse`` themselves, else one
    fp32 workspace (:func:`.common.alloc_partials`) holds the partials that the combine
    merges and ``lse``. Both launches go through :func:`flash_dmattn.triton_launch.launch`
    (Triton's argument specialisation once per launch signature, not per call)."""
    B, Lq, H, D = q.shape
    device = q.device
    out = alloc_output((B, Lq, H, D), q.dtype, device)
    num_splits = plan.num_splits
    if plan.single:  # the split kernel writes out / lse itself, no combine launch
        lse = alloc_output((B, H, Lq), torch.float32, device)
        o_part, l_part = out, lse
    else:
        o_part, l_part, lse = alloc_partials(num_splits, plan.split_rows, D, device, (B, H, Lq))
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    launch(split_kernel, (num_splits, B, k.shape[2]),
           (q, k, v, *inputs, o_part, l_part,
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            *scalars, os_[0], os_[1], os_[2]),
           split_meta)
    if plan.single:
        return out, lse
    launch(_decode_combine_kernel, (plan.split_rows, plan.combine_cols),
           (o_part, l_part, out, lse,
            num_splits, plan.split_rows, H, Lq, os_[0], os_[1], os_[2]),
           plan.combine_meta)
    return out, lse


class DecodePlan(NamedTuple):
    """What a decode launch needs besides its tensors (:func:`_decode_plan`): the split count
    and split length, the split kernel's constexprs and launch settings, and the combine's."""

    num_splits: int
    keys_per_split: int
    single: bool
    split_rows: int
    split_meta: dict
    combine_cols: int
    combine_meta: Optional[dict]


def _decode_plan(device: torch.device, dtype: torch.dtype, B: int, Lq: int, H: int, Hkv: int,
                 D: int, Lk: int, has_mask: bool, mask_rowb: bool, has_bias: bool,
                 bias_rowb: bool, is_causal: bool, has_softcap: bool, has_cache: bool,
                 page_size: int, paged: bool, num_splits: Optional[int],
                 interp: bool) -> DecodePlan:
    """The launch plan of :func:`decode_forward` for a call of these shapes and flags (its
    arguments are everything the plan depends on: :func:`_cached_decode_plan` keys on them)."""
    deep = not interp and use_deep_pipeline(B, Hkv, has_mask or has_bias, paged, device)
    meta = split_meta(dtype, D, (H // Hkv) * Lq, interp, has_softcap and paged, deep)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, Lk, device, per_sm=DEEP_PER_SM if deep else 4)
    block_n = meta["BLOCK_N"]
    meta.update(HAS_MASK=has_mask, MASK_ROWB=mask_rowb, HAS_BIAS=has_bias, BIAS_ROWB=bias_rowb,
                IS_CAUSAL=is_causal, HAS_SOFTCAP=has_softcap, HAS_CACHE=has_cache,
                PAGE_SIZE=page_size, TILE_PAGES=tile_pages(page_size, block_n))
    # Splits start on whole tiles (so a page of whole tiles holds each tile entirely).
    return split_plan(meta, device, Lk, num_splits, max(16 if interp else SPLIT_ALIGN, block_n),
                      B * H * Lq)


def split_meta(dtype: torch.dtype, D: int, rows: int, interp: bool,
               softcap_and_paged: bool = False, deep: bool = False,
               cap_registers: bool = True) -> dict:
    """The constexprs and launch settings every split kernel takes (``HEAD_DIM``, ``BLOCK_D``,
    ``BLOCK_M`` for ``rows`` tile rows, ``BLOCK_N``, ``DOT_UPCAST``, warps, stages and, where
    :func:`decode_config` caps it and ``cap_registers``, ``maxnreg``); under the interpreter,
    :data:`INTERPRET_BLOCK_N` keys a tile, 4 warps, 1 stage."""
    block_d = head_block(D)
    block_m = max(16, next_power_of_2(rows))
    if interp:
        block_n, warps, stages, maxnreg = INTERPRET_BLOCK_N, 4, 1, None
    else:
        block_n, warps, stages, maxnreg = decode_config(block_d, block_m, softcap_and_paged,
                                                        deep)
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                DOT_UPCAST=dot_upcast(dtype), num_warps=warps, num_stages=stages)
    if maxnreg is not None and cap_registers:
        meta["maxnreg"] = maxnreg
    return meta


def split_plan(meta: dict, device: torch.device, n: int, num_splits: int, align: int,
               split_rows: int) -> DecodePlan:
    """The plan of ``num_splits`` (at least 1) splits of ``n`` keys (or slots) that start on
    multiples of ``align``: the split length, the count that leaves no split starting past
    ``n``, ``SINGLE_SPLIT`` set in the split kernel's ``meta``, and the combine's settings for
    ``split_rows`` output rows."""
    per_split = cdiv(cdiv(n, max(1, num_splits)), align) * align
    num_splits = cdiv(n, per_split)
    single = num_splits == 1
    meta["SINGLE_SPLIT"] = single
    cols, combine_meta = 1, None
    if not single:
        block_d = meta["BLOCK_D"]
        chunk, cols, combine_warps = combine_config(num_splits, block_d, split_rows, device)
        combine_meta = dict(HEAD_DIM=meta["HEAD_DIM"], BLOCK_D=block_d // cols, CHUNK_S=chunk,
                            num_warps=combine_warps)
    return DecodePlan(num_splits, per_split, single, split_rows, meta, cols, combine_meta)


# A decoding step calls the decode kernel once per layer with the same shapes: the plan is made
# once per shape (the key length, and with it the split count, grows by one a step).
_cached_decode_plan = functools.lru_cache(maxsize=1024)(_decode_plan)
