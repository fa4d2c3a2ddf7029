"""Fused Triton forward kernel: masked / biased / soft-capped attention with tile skipping.

One program computes one query tile of one (batch, query head) and walks only the key tiles that
the tile lists mark live (see :mod:`flash_dmattn.planning.tiles`); full tiles skip every
per-element mask. The softmax is online in fp32 in the log2 domain (scores are pre-multiplied
by log2(e) so the inner loop uses exp2).

With ``VARLEN`` the same kernel runs packed sequences (:func:`attention_forward_varlen`): the
packed ``(total, H, D)`` tensors are batch 1, the batch grid index is the sequence index, and
each program moves its pointers to its sequence's first query / key row read from
``cu_seqlens``; query tiles past the sequence's length do nothing. A per-key mask gets
per-(sequence, mask head) lists of live key tiles
(:class:`~flash_dmattn.planning.tiles.VarlenKeyLists`), which the program walks up to its causal
limit: dead key tiles cost nothing, full ones skip the mask.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ...intmath import cdiv
from ...planning.gather import KeyGather, gather_policy, plan_key_gather
from ...planning.key_mask_lists import per_key_eligible
from ...planning.mask_summary import summarize_mask, summary_blocks, wants_summary
from ...planning.decode import sm_count
from ...planning.plain_rows import plan_plain_rows
from ...planning.plan import NOT_PLANNED, plan_backward
from ...planning.rows import aligned_rows
from ...planning.tiles import TileLists, build_tile_lists
from .common import (
    LOG2E,
    _dot,
    _dropout_keep,
    _dropout_keep_tile,
    _dropout_seed,
    _gathered_row_bits,
    _key_bounds,
    _key_tile,
    _scores,
    _varlen_key_tiles,
    _varlen_list_len,
    _varlen_list_need_elem,
    _varlen_seq,
    alloc_output,
    broadcast_strides,
    bwd_blocks,
    dot_upcast,
    dropout_args,
    fwd_blocks,
    head_block,
    interpret_mode,
    last_dim_contiguous,
    launch_tuned,
    seqlen_bucket,
    varlen_aux_4d,
    varlen_list_args,
    varlen_tail_rows,
)


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, bias_base, mask_base,
              offs_m, offs_n, offs_d, d_ok, n_ok, mask_cols, mask_lim, need_elem, bias_klim,
              mask_bits,
              stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
              seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
              HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_UPCAST: tl.constexpr,
              ELEM: tl.constexpr, BIAS_GATHERED: tl.constexpr = False,
              MASK_BITS: tl.constexpr = False, seed=0, offset=0, bh=0, drop_thresh=0,
              DROPOUT: tl.constexpr = False):
    """One key tile of the online softmax: returns the updated ``(acc, m_i, l_i)``.

    With ``DROPOUT`` the row sums ``l_i`` take every probability and ``acc`` only the kept
    ones (the program scales the output by ``1 / (1 - p)`` at the end)."""
    kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],
                 mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    s, _ = _scores(q, kt, bias_base, mask_base, offs_m, offs_n, n_ok, mask_cols, mask_lim,
                   need_elem, bias_klim, mask_bits, stride_bm, stride_bn, stride_mm, stride_mn,
                   seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                   HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB,
                   IS_CAUSAL, HAS_SOFTCAP, DOT_UPCAST, ELEM, BIAS_GATHERED, MASK_BITS)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        if ELEM == 1:  # gathered keys
            keep = _dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], drop_thresh)
        else:  # a key tile
            keep = _dropout_keep_tile(seed, offset, bh, offs_m, offs_n, drop_thresh)
        p = tl.where(keep, p, 0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_program(
    pid_m, pid_bh,
    Q, K, V, Out, Lse, Mask, Bias, ListIdx, ListCnt, MaskBits, CuQ, CuK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_lb, stride_lh, stride_lm, stride_cb, stride_ch, stride_cm, list_hdiv,
    num_heads, group, seqlen_q, seqlen_k, n_k_tiles, stride_lse_h,
    qk_scale, cap_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_LIST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, GATHER: tl.constexpr, VARLEN: tl.constexpr = False,
    MASK_PAD: tl.constexpr = False, BIAS_PAD: tl.constexpr = False,
    BIAS_GATHERED: tl.constexpr = False, MASK_BITS: tl.constexpr = False,
    Rng=None, drop_thresh=0, drop_scale=1.0, DROPOUT: tl.constexpr = False,
):
    """Query tile ``pid_m`` of (batch, query head) ``pid_bh``: the kernel's work for one
    program (see :func:`_attn_fwd_kernel`)."""
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    b64 = b.to(tl.int64)
    if VARLEN:
        q_start, seqlen_q, k_start, seqlen_k = _varlen_seq(CuQ, CuK, b)
        Q += q_start * stride_qm
        Out += q_start * stride_om
        K += k_start * stride_kn
        V += k_start * stride_vn
        Mask += k_start * stride_mn
        Bias += k_start * stride_bn
        lse_row = Lse + h.to(tl.int64) * stride_lse_h + q_start
    else:
        lse_row = Lse + pid_bh.to(tl.int64) * seqlen_q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seqlen_q

    q_ptrs = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b64 * stride_mb + (h // mask_hdiv).to(tl.int64) * stride_mh
    bias_base = Bias + b64 * stride_bb + (h // bias_hdiv).to(tl.int64) * stride_bh
    if BIAS_GATHERED:
        bias_base += pid_m.to(tl.int64) * stride_bm

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Dropout coordinates: pid_bh is batch * heads + head (sequence * heads + head when
    # VARLEN), rows and keys count from the sequence's start.
    seed, offset = _dropout_seed(Rng, DROPOUT)

    if USE_LIST:
        lh = h // list_hdiv
        list_off = b * stride_lb + lh * stride_lh + pid_m * stride_lm
        list_row = ListIdx + list_off
        bits_row = MaskBits + list_off
        cnt_ptr = ListCnt + b * stride_cb + lh * stride_ch + pid_m * stride_cm
        n_iter = tl.load(cnt_ptr)
    else:
        list_row = ListIdx
        cnt_ptr = ListCnt
        n_iter = n_k_tiles
    if VARLEN:
        if USE_LIST:
            # The (sequence, mask head) row of live key tiles, cut at this tile's causal limit.
            n_iter = _varlen_list_len(list_row, n_iter, pid_m * BLOCK_M, seqlen_q, seqlen_k,
                                      BLOCK_M, BLOCK_N, IS_CAUSAL)
        else:
            n_iter = _varlen_key_tiles(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                       IS_CAUSAL)

    mask_klim, bias_klim = _key_bounds(stride_mm, stride_bm, seqlen_k, MASK_PAD, BIAS_PAD)
    if USE_LIST and not GATHER:
        # One loop, the tile's partial flag deciding per-element masking at run time. Two
        # loops (full tiles, then partial ones; the lists are ordered for it) measured clearly
        # slower on the dense and the dynamic workloads. Each loop fills and drains its own
        # pipeline and the second one's buffers cost up to 40 KB more shared memory
        # (scripts/compile_check.py); which of these costs more is not established.
        # The entry is loaded one iteration ahead: the software pipeliner issues the next
        # tile's K/V copies right after the entry load, so an entry loaded in the same
        # iteration puts a global-load latency in front of every prefetch.
        entry_next = tl.load(list_row, mask=n_iter > 0, other=0)
        for t in range(0, n_iter):
            entry = entry_next
            entry_next = tl.load(list_row + t + 1, mask=t + 1 < n_iter, other=0)
            if MASK_BITS:
                # Fetched for partial tiles only, by an async copy the pipeliner makes of it.
                # Read inside the partial branch instead, every program waits on its diagonal
                # tile's bits; prefetched one step ahead as a loop-carried int64, the copy at
                # the step's end waits on the load (no gain over the mask load).
                bits = tl.load(bits_row + t, mask=(entry & 1) != 0, other=0)
            else:
                bits = 0
            offs_n = (entry >> 1) * BLOCK_N + offs_n0
            need_elem = (entry & 1) != 0
            if VARLEN:
                need_elem = _varlen_list_need_elem(need_elem, pid_m * BLOCK_M,
                                                   (entry >> 1) * BLOCK_N, seqlen_q, seqlen_k,
                                                   BLOCK_M, BLOCK_N, IS_CAUSAL)
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k_base, v_base, bias_base, mask_base,
                offs_m, offs_n, offs_d, d_ok, offs_n < seqlen_k, offs_n, mask_klim, need_elem, bias_klim,
                bits, stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL, HAS_SOFTCAP,
                DOT_UPCAST, 2, False, MASK_BITS, seed=seed, offset=offset, bh=pid_bh,
                drop_thresh=drop_thresh, DROPOUT=DROPOUT)
    elif GATHER:
        # Gathered keys: indices by position in the row's key list, masked per element from
        # the rows' gbits words.
        n_keys = n_iter
        bits_rows = mask_base + offs_m.to(tl.int64) * stride_mm
        # Key indices loaded one step ahead, as the list path's entries (same reason).
        keys_next = tl.load(list_row + offs_n0, mask=offs_n0 < n_keys, other=0)
        for t in range(0, tl.cdiv(n_keys, BLOCK_N)):
            cols = t * BLOCK_N + offs_n0
            keys = keys_next
            keys_next = tl.load(list_row + cols + BLOCK_N, mask=cols + BLOCK_N < n_keys, other=0)
            row_bits = _gathered_row_bits(bits_rows, t, BLOCK_N)
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k_base, v_base, bias_base, mask_base,
                offs_m, keys, offs_d, d_ok, cols < n_keys, cols, stride_mm, True, bias_klim,
                row_bits, stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL, HAS_SOFTCAP,
                DOT_UPCAST, 1, BIAS_GATHERED, 2, seed=seed, offset=offset, bh=pid_bh,
                drop_thresh=drop_thresh, DROPOUT=DROPOUT)
    else:
        for t in range(0, n_iter):
            offs_n, n_ok, need_elem = _key_tile(t, offs_n0, pid_m * BLOCK_M, seqlen_q, seqlen_k,
                                                BLOCK_M, BLOCK_N, HAS_MASK, IS_CAUSAL, VARLEN)
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k_base, v_base, bias_base, mask_base,
                offs_m, offs_n, offs_d, d_ok, n_ok, offs_n, mask_klim, need_elem, bias_klim, 0,
                stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL, HAS_SOFTCAP,
                DOT_UPCAST, 2, seed=seed, offset=offset, bh=pid_bh, drop_thresh=drop_thresh,
                DROPOUT=DROPOUT)

    has_any = l_i > 0.0
    l_use = tl.where(has_any, l_i, 1.0)
    out = acc / l_use[:, None]
    if DROPOUT:
        out = out * drop_scale
    lse = tl.where(has_any, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))
    o_ptrs = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_row + offs_m, lse, mask=m_ok)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, Bias, ListIdx, ListCnt, MaskBits, CutRows, CuQ, CuK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_lb, stride_lh, stride_lm, stride_cb, stride_ch, stride_cm, list_hdiv,
    stride_ub, stride_uh, stride_um,
    num_heads, group, seqlen_q, seqlen_k, n_k_tiles, stride_lse_h,
    qk_scale, cap_scale, softcap,
    lq_bucket, lk_bucket,
    Rng, drop_thresh, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_LIST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, GATHER: tl.constexpr, VARLEN: tl.constexpr = False,
    MASK_PAD: tl.constexpr = False, BIAS_PAD: tl.constexpr = False,
    BIAS_GATHERED: tl.constexpr = False, MASK_BITS: tl.constexpr = False,
    CUT_ROWS: tl.constexpr = False, NET_CHUNK: tl.constexpr = 64,
    DROPOUT: tl.constexpr = False,
):
    # DROPOUT: attention dropout (see flash_dmattn.dropout). Rng is the call's int64 (seed,
    # offset) tensor, drop_thresh the 31-bit keep threshold, drop_scale 1 / (1 - p).
    # MASK_BITS (with USE_LIST, not GATHER / VARLEN): a per-key mask whose tiles' bits come in
    # MaskBits, parallel to ListIdx (TileLists.fwd_bits); the mask itself is not read. A
    # partial tile costs one scalar load and a few shifts, a full tile nothing, where the
    # mask path issues a predicated vector load in every step (a few percent of the
    # block-sparse forward).
    # BIAS_GATHERED (with GATHER): Bias is the KeyGather's gbias, one padded row per query
    # tile (stride_bm is the tile stride), read at the same list positions as the mask.
    # MASK_PAD / BIAS_PAD: the mask's / bias's rows are padded copies (aligned_rows): bound
    # their reads by the row width, a multiple of 16 the compiler can see, so they vectorise
    # and pipeline.
    # GATHER: ListIdx/ListCnt are a KeyGather's idx/cnt (key indices, not tile entries) and
    # Mask is its gbits (int64 words: the mask's bits at the listed keys, see .gather).
    # VARLEN: packed sequences, see _varlen_seq; b is the sequence index.
    # CUT_ROWS (per-key lists with their cut counts in CutRows, see .plain_rows): only the
    # rows the mask cuts, on a grid of (G, B * H) programs, each checking NET_CHUNK of its
    # head's query tiles with one load (most calls have none: the launch costs one wave).
    if CUT_ROWS:
        tl.static_assert(USE_LIST and not GATHER and not VARLEN)
        pid_bh = tl.program_id(1)
        n_q = tl.cdiv(seqlen_q, BLOCK_M)
        step = tl.num_programs(0)
        for c0 in range(tl.program_id(0), n_q, step * NET_CHUNK):
            ms = c0 + tl.arange(0, NET_CHUNK) * step
            cuts = _row_cut(CutRows, ms, pid_bh, num_heads, list_hdiv,
                            stride_ub, stride_uh, stride_um, ms < n_q)
            if tl.max(cuts, 0) > 0:
                for j in range(0, NET_CHUNK):
                    pid_m = c0 + j * step
                    if pid_m < n_q:
                        if _row_cut(CutRows, pid_m, pid_bh, num_heads, list_hdiv,
                                    stride_ub, stride_uh, stride_um, True) > 0:
                            _attn_fwd_program(
                                pid_m, pid_bh, Q, K, V, Out, Lse, Mask, Bias, ListIdx,
                                ListCnt, MaskBits, CuQ, CuK, stride_qb, stride_qm, stride_qh,
                                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                                stride_vh, stride_ob, stride_om, stride_oh, stride_mb,
                                stride_mh, stride_mm, stride_mn, mask_hdiv, stride_bb,
                                stride_bh, stride_bm, stride_bn, bias_hdiv, stride_lb,
                                stride_lh, stride_lm, stride_cb, stride_ch, stride_cm,
                                list_hdiv, num_heads, group, seqlen_q, seqlen_k, n_k_tiles,
                                stride_lse_h, qk_scale, cap_scale, softcap, HEAD_DIM, BLOCK_D,
                                BLOCK_M, BLOCK_N, HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS,
                                BIAS_QB, BIAS_KB, IS_CAUSAL, USE_LIST, HAS_SOFTCAP,
                                DOT_UPCAST, GATHER, VARLEN, MASK_PAD, BIAS_PAD, BIAS_GATHERED,
                                MASK_BITS, Rng=Rng, drop_thresh=drop_thresh,
                                drop_scale=drop_scale, DROPOUT=DROPOUT)
    else:
        pid_m = tl.program_id(0)
        if IS_CAUSAL:
            # Bottom query tiles see the most keys: launch them first to shorten the tail.
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        _attn_fwd_program(
            pid_m, pid_bh, Q, K, V, Out, Lse, Mask, Bias, ListIdx, ListCnt, MaskBits, CuQ,
            CuK, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_mb,
            stride_mh, stride_mm, stride_mn, mask_hdiv, stride_bb, stride_bh, stride_bm,
            stride_bn, bias_hdiv, stride_lb, stride_lh, stride_lm, stride_cb, stride_ch,
            stride_cm, list_hdiv, num_heads, group, seqlen_q, seqlen_k, n_k_tiles,
            stride_lse_h, qk_scale, cap_scale, softcap, HEAD_DIM, BLOCK_D, BLOCK_M,
            BLOCK_N, HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
            USE_LIST, HAS_SOFTCAP, DOT_UPCAST, GATHER, VARLEN, MASK_PAD, BIAS_PAD,
            BIAS_GATHERED, MASK_BITS, Rng=Rng, drop_thresh=drop_thresh, drop_scale=drop_scale,
            DROPOUT=DROPOUT)


@triton.jit
def _row_cut(CutRows, pid_m, pid_bh, num_heads, list_hdiv, stride_ub, stride_uh, stride_um,
             ok):
    """How many of query tile ``pid_m``'s listed key tiles the mask cuts (scalars or
    vectors; 0 where not ``ok``)."""
    b = pid_bh // num_heads
    lh = pid_bh % num_heads // list_hdiv
    return tl.load(CutRows + b * stride_ub + lh * stride_uh + pid_m * stride_um, mask=ok, other=0)


# ------------------------------------------------------------------------------------------
# Launch configuration
# ------------------------------------------------------------------------------------------

_FWD_KEY = ["HEAD_DIM", "IS_CAUSAL", "HAS_MASK", "HAS_BIAS", "HAS_SOFTCAP", "USE_LIST",
            "GATHER", "VARLEN", "MASK_BITS", "CUT_ROWS", "DROPOUT", "lq_bucket", "lk_bucket"]


def _fwd_configs():
    return [triton.Config({}, num_warps=w, num_stages=s)
            for w, s in ((8, 2), (8, 3), (8, 4), (4, 2), (4, 3))]


def _prune_fwd(configs, named_args, **kwargs):
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 128))
    out = []
    for c in configs:
        if (bm >= 128 or bd >= 256) and c.num_warps < 8:
            continue  # 128 rows on one warpgroup spill heavily on sm_90
        if bd >= 256 and c.num_stages > 2:
            continue  # shared memory: q + 2 stages of K/V tiles already ~170 KB
        if bd >= 128 and c.num_stages > 3 and not kwargs.get("GATHER", False):
            # Gathered K/V addresses come from an index load one stage earlier, so the
            # gathered loop gets a fourth stage to keep one tile of loads in flight.
            continue
        out.append(c)
    return out or configs[:1]


_attn_fwd_tuned = triton.autotune(
    configs=_fwd_configs(), key=_FWD_KEY, prune_configs_by={"early_config_prune": _prune_fwd}
)(_attn_fwd_kernel)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    tiles: Optional[Union[TileLists, KeyGather]] = None,
    keep_plan: bool = False,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
):
    """Attention forward.

    Args:
        q: ``(B, Lq, H, D)``; k, v: ``(B, Lk, Hkv, D)``, fp16/bf16 (fp32 accepted). Last dim
            contiguous (made so otherwise); other strides arbitrary.
        mask: None or bool ``(Bx, Hx, Qx, Kx)`` view (broadcast dims of size 1), True = attend.
        bias: None or float ``(Bx, Hx, Qx, Kx)`` view (q's dtype or fp32), added after softcap.
        softmax_scale: multiplies q.k (0.0 allowed). is_causal: bottom-right aligned causal.
        softcap: 0.0 = off, else ``softcap * tanh(s / softcap)``.
        tiles: optional prebuilt forward tile lists for :func:`fwd_blocks`, or a prebuilt
            :class:`KeyGather` for its ``block_m`` (planned here if None).
        keep_plan: also plan the backward of this call (after launching the kernel, so the
            host work overlaps it) and return that
            :class:`~flash_dmattn.planning.plan.BackwardPlan` third.
        dropout_p, dropout_rng: attention dropout and the call's int64 ``(seed, offset)``
            tensor on q's device (:mod:`flash_dmattn.dropout`); off when ``dropout_p`` is 0.

    Returns:
        ``out`` ``(B, Lq, H, D)`` in q's dtype (contiguous) and ``lse`` ``(B, H, Lq)`` fp32
        (natural log; -inf and zero output for rows with no visible key); with ``keep_plan``
        also the backward plan (None for an empty call).
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    device = q.device
    out = alloc_output((B, Lq, H, D), q.dtype, device)
    lse = alloc_output((B, H, Lq), torch.float32, device)
    if B * H * Lq == 0 or Lk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse, None) if keep_plan else (out, lse)

    block_m, block_n = fwd_blocks(D)
    mask, mask_pad = aligned_rows(mask, Lq, Lk)
    bias_in = bias
    bias, bias_pad = aligned_rows(bias, Lq, Lk)  # read only: the forward has no dbias
    gather = None
    summary = None
    plain = None  # the uncut-rows decision (plain_rows) of lists planned here
    planned_here = tiles is None
    if isinstance(tiles, KeyGather):
        gather, tiles = tiles, None
    elif tiles is None:
        # A per-query mask is read once, by one kernel, for everything planned from it (with
        # keep_plan at a granularity that also serves the backward's block shapes).
        if wants_summary(mask, Lq, Lk):
            blocks = [(block_m, block_n)] + (list(bwd_blocks(D)) if keep_plan else [])
            summary = summarize_mask(mask, *summary_blocks(*blocks), is_causal)
        gather = plan_key_gather(mask, bias, Lq, Lk, H, is_causal, block_m, block_n,
                                 summary=summary, lagged=True)
        if gather is None:
            if mask is not None and per_key_eligible(mask, block_n):
                plain = plan_plain_rows(
                    (device, tuple(mask.shape), Lq, Lk, bool(is_causal), block_m, block_n),
                    device, cdiv(Lq, block_m) * B * H)
            tiles = build_tile_lists(mask, Lq, Lk, H, is_causal, block_m, block_n, device,
                                     need_fwd=True, need_bwd=False, summary=summary,
                                     with_bits=True,
                                     cut_flag=plain.cut_flag if plain is not None else None)
    use_list = tiles is not None or gather is not None
    if gather is not None:
        idx, cnt, lst, list_hdiv = gather.idx, gather.cnt, gather.list_strides(), gather.head_div
    elif tiles is not None:
        idx, cnt = tiles.fwd_idx, tiles.fwd_cnt
        lst = tiles.fwd_strides()
        list_hdiv = tiles.head_div
    else:
        idx = cnt = q  # never read
        lst = (0, 0, 0, 0, 0, 0)
        list_hdiv = 1

    # A per-key mask's partial tiles are masked from the bits the planner wrote beside the
    # list (one word a tile) rather than from the mask row, a predicated load every step.
    mask_bits = tiles.fwd_bits if tiles is not None and mask is not None else None
    cut = tiles.fwd_cut if mask_bits is not None else None
    if gather is not None:
        mask_arg, ms = gather.gbits, gather.mask_strides(H)
    else:
        mask_arg = mask.view(torch.uint8) if mask is not None else q
        ms = broadcast_strides(mask, H)
    bias_gathered = gather is not None and gather.gbias is not None
    if bias_gathered:
        bias_arg, bs = gather.gbias, gather.bias_strides(H)
    else:
        bias_arg = bias if bias is not None else q
        bs = broadcast_strides(bias, H)
    n_k_tiles = cdiv(Lk, block_n)
    grid = (cdiv(Lq, block_m), B * H)
    has_softcap = softcap > 0.0

    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)

    def kernel_args(cnt, lst):
        return (
            q, k, v, out, lse, mask_arg, bias_arg, idx, cnt,
            mask_bits if mask_bits is not None else q, cut if cut is not None else q, q, q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            *ms, *bs, *lst, list_hdiv, *(tiles.cut_strides() if cut is not None else (0, 0, 0)),
            H, H // Hkv, Lq, Lk, n_k_tiles, 0,
            softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
            seqlen_bucket(Lq), seqlen_bucket(Lk), *drop_args,
        )

    args = kernel_args(cnt, lst)
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        MASK_QB=mask is not None and mask.size(2) == 1,
        MASK_KB=mask is not None and mask.size(3) == 1,
        HAS_BIAS=bias is not None,
        BIAS_QB=bias is not None and bias.size(2) == 1,
        BIAS_KB=bias is not None and bias.size(3) == 1,
        IS_CAUSAL=bool(is_causal), USE_LIST=use_list, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), GATHER=gather is not None, VARLEN=False,
        MASK_PAD=mask_pad and gather is None, BIAS_PAD=bias_pad or bias_gathered,
        BIAS_GATHERED=bias_gathered,
        MASK_BITS=int(mask_bits is not None), DROPOUT=dropout,
    )
    if cut is not None and plain is None:  # prebuilt lists
        plain = plan_plain_rows(None, device, grid[0] * grid[1])
    if cut is not None and plain.split():
        _launch_plain_rows(grid, args, meta, q.device,
                           kernel_args(cut[..., 1:], tiles.plain_strides()))
    else:
        _launch_fwd(grid, args, meta)
    if not keep_plan:
        return out, lse
    bwd = bwd_blocks(D)
    # The dQ kernel plans the same gather as this forward when it has the same block shape
    # and policy: hand over this one (None included: "tile lists").
    reuse = (planned_here and bwd[1] == (block_m, block_n)
             and gather_policy("dq") == gather_policy("forward"))
    # The plan keeps its gbits (1/8 of the mask's bytes at the listed keys): memory well spent,
    # since rebuilding them in the backward costs a few percent of a training step.
    plan = plan_backward(mask, bias_in, Lq, Lk, H, is_causal, bwd, device, summary=summary,
                         fwd_gather=gather if reuse else NOT_PLANNED)
    return out, lse, plan


def _launch_fwd(grid, args, meta) -> None:
    launch_tuned(_attn_fwd_kernel, _attn_fwd_tuned, grid, args, meta)


def _launch_plain_rows(grid, args, meta, device: torch.device, plain_args) -> None:
    """The two-kernel forward of a per-key mask (see :mod:`flash_dmattn.planning.plain_rows`):
    every row without
    the mask, on counts that give the rows the mask cuts no tile (``plain_args``: the
    arguments with those counts), then a net of about one wave that runs the cut rows again,
    with the mask's bits, over what the first kernel stored for them."""
    _launch_fwd(grid, plain_args, dict(meta, HAS_MASK=False, MASK_BITS=0))
    n_q, n_bh = grid
    if interpret_mode():
        programs, chunk = 2, 2  # small, so the interpreter walks several chunks per program
    else:
        programs, chunk = cdiv(sm_count(device), n_bh), 64
    net_grid = (max(1, min(n_q, programs)), n_bh)
    # Not autotuned: timing a launch that usually has nothing to do would pick at random.
    _launch_fwd_untuned(net_grid, args, dict(meta, CUT_ROWS=True, NET_CHUNK=chunk))


def _launch_fwd_untuned(grid, args, meta) -> None:
    launch_tuned(_attn_fwd_kernel, _attn_fwd_tuned, grid, args, meta, autotune=False)


def attention_forward_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward over packed sequences (docs/contract.md §4).

    Args:
        q: ``(total_q, H, D)``; k, v: ``(total_k, Hkv, D)``; sequence ``i`` owns query rows
            ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows likewise (int32 offsets on the
            tensors' device, non-decreasing; not validated here, that would need a host sync).
        max_seqlen_q / max_seqlen_k: upper bounds of the per-sequence lengths (they size the
            grid; a sequence longer than ``max_seqlen_q`` leaves rows unwritten).
        mask: None or bool ``(1|Hkv|H, total_k)``; bias: None or float ``(1|Hkv|H, total_k)``,
            one value per key for every query of its sequence.
        softmax_scale, is_causal (bottom-right per sequence), softcap, dropout_p,
            dropout_rng: as :func:`attention_forward` (dropout's batch is the sequence).

    Returns:
        ``out (total_q, H, D)`` in q's dtype and ``lse (H, total_q)`` fp32. Rows with no
        visible key, empty sequences and rows past ``cu_seqlens_q[-1]`` give 0 / -inf.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    total_q, H, D = q.shape
    Hkv = k.shape[1]
    n_seqs = cu_seqlens_q.numel() - 1
    device = q.device
    out = alloc_output((total_q, H, D), q.dtype, device)
    lse = alloc_output((H, total_q), torch.float32, device)
    if n_seqs <= 0 or H * total_q == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    block_m, block_n = fwd_blocks(D)
    mask4, bias4 = varlen_aux_4d(mask), varlen_aux_4d(bias)
    mask_arg = mask4.view(torch.uint8) if mask4 is not None else q
    bias_arg = bias4 if bias4 is not None else q
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    idx, cnt, lst = varlen_list_args(mask, cu_k, max_seqlen_k, H, block_n, q)
    has_softcap = softcap > 0.0
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    # The packed tensors are batch 1 (batch strides 0); programs offset by their sequence start.
    args = (
        q, k, v, out, lse, mask_arg, bias_arg, idx, cnt, q, q, cu_q, cu_k,
        0, q.stride(0), q.stride(1),
        0, k.stride(0), k.stride(1),
        0, v.stride(0), v.stride(1),
        0, out.stride(0), out.stride(1),
        *broadcast_strides(mask4, H), *broadcast_strides(bias4, H), *lst, 0, 0, 0,
        H, H // Hkv, max_seqlen_q, max_seqlen_k, cdiv(max_seqlen_k, block_n), lse.stride(0),
        softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
        seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_k), *drop_args,
    )
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, MASK_QB=True, MASK_KB=False,
        HAS_BIAS=bias is not None, BIAS_QB=True, BIAS_KB=False,
        IS_CAUSAL=bool(is_causal), USE_LIST=mask is not None, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), GATHER=False, VARLEN=True, DROPOUT=dropout,
    )
    grid = (cdiv(max_seqlen_q, block_m), n_seqs * H)
    _launch_fwd(grid, args, meta)
    tail = varlen_tail_rows(cu_q, total_q)
    out.masked_fill_(tail[:, None, None], 0.0)
    lse.masked_fill_(tail[None, :], float("-inf"))
    return out, lse
