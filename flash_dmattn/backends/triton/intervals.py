"""Triton kernels for key-interval masks: attention at the cost of the selected keys.

A :class:`~flash_dmattn.masks.KeyIntervals` mask lets key ``j`` be seen by the query positions
``[start_j, end_j)``. The planner (:mod:`flash_dmattn.planning.key_lists`) turns that into

* per query tile, the list of keys whose range meets the tile: the forward and the dQ kernel
  load exactly those K/V rows by index (a gather, 2·D bytes a row) and test the interval
  arithmetically — no mask memory is read, and no key tile is visited for one live key. The
  keys every query of the tile sees come first, and their chunks skip the test;
* key blocks of up to ``block_n`` keys with the union ``[q_lo, q_hi)`` of their query ranges:
  the dK/dV kernel holds a block's K/V in registers and walks those queries (for every query
  head of the kv head's group), accumulating dK, dV and the per-key dbias.

Scores follow the dense kernels' conventions: ``s = scale·q·k`` (``softcap·tanh(s/softcap)``
when soft-capped) ``+ bias``, in base 2 inside the kernels; rows that see no key give 0 and
``lse = -inf``.

Long key blocks (a key that stays selected for most of the sequence) are cut into query
segments run by separate programs, whose partial dK/dV/dbias meet by atomic adds in fp32
buffers; ``deterministic=True`` keeps one program per block, so every element is written by
one add onto zero.

Attention dropout regenerates the call's keep-mask (:mod:`flash_dmattn.dropout`) at the
gathered keys' own indices, so it is the dense kernels' mask.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...intmath import cdiv
from ...planning.key_lists import full_bounds, plan_intervals
from .backward_kernel import _bwd_preprocess
from .common import _dot, _tanh, alloc_output, dot_upcast, head_block, interpret_mode
from .dropout_mask import _dropout_keep_tile, _dropout_keep_tile_t, _dropout_seed, dropout_args

# Kernels read module constants only as constexprs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Query rows one dK/dV program walks at most: block ranges are cut at multiples of this.
SEGMENT_ROWS = 4096


def _fwd_config(head_dim: int, interp: bool) -> Tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the forward and dQ kernels.

    Narrow key chunks win: each chunk's rows are gathered by index, and 32-key chunks with
    three stages in flight kept the gathers ahead of the tensor cores better than 64 or 128
    (``tools/dma_tune.py``; results in ``benchmarks/results/``).
    """
    if interp:
        return 16, 16, 4, 1
    if head_dim <= 128:
        return 128, 32, 4, 3
    return 64, 32, 4, 2


def _bwd_config(head_dim: int, interp: bool) -> Tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the dK/dV kernel: 64-key blocks held in
    registers, 32 queries a step (``tools/dma_tune.py``)."""
    if interp:
        return 16, 16, 4, 1
    if head_dim <= 128:
        return 32, 64, 4, 3
    return 16, 32, 4, 2


# ------------------------------------------------------------------------------------------
# Device helpers
# ------------------------------------------------------------------------------------------


@triton.jit
def _scores(q, k_t, bias, sb, eb, kidx, kvalid, pos, qvalid, qk_scale, softcap, full,
            HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
            UPCAST: tl.constexpr):
    """Base-2 scores of a (queries, keys) tile with the interval test applied (-inf where
    hidden) unless ``full`` says every pair is visible, and the tanh of the soft cap (for
    the backward; 0 without soft cap)."""
    s = _dot(q, k_t, UPCAST)
    if SOFTCAP:
        t = _tanh(s * (qk_scale / softcap))
        s = t * (softcap * LOG2E)
    else:
        t = s * 0.0
        s = s * (qk_scale * LOG2E)
    if HAS_BIAS:
        s += bias[None, :] * LOG2E
    if not full:
        vis = (sb[None, :] <= pos[:, None]) & (pos[:, None] < eb[None, :])
        vis = vis & kvalid[None, :] & qvalid[:, None]
        if CAUSAL:
            vis = vis & (kidx[None, :] <= pos[:, None])
        s = tl.where(vis, s, float("-inf"))
    return s, t


@triton.jit
def _scores_t(k, q_t, bias, sb, eb, kidx, kvalid, pos, qvalid, qk_scale, softcap, full,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
              UPCAST: tl.constexpr):
    """:func:`_scores` transposed: a (keys, queries) tile from ``k (N, D)`` and ``q_t (D, M)``,
    the orientation in which the dK/dV kernel keeps its operands."""
    s = _dot(k, q_t, UPCAST)
    if SOFTCAP:
        t = _tanh(s * (qk_scale / softcap))
        s = t * (softcap * LOG2E)
    else:
        t = s * 0.0
        s = s * (qk_scale * LOG2E)
    if HAS_BIAS:
        s += bias[:, None] * LOG2E
    if not full:
        vis = (sb[:, None] <= pos[None, :]) & (pos[None, :] < eb[:, None])
        vis = vis & kvalid[:, None] & qvalid[None, :]
        if CAUSAL:
            vis = vis & (kidx[:, None] <= pos[None, :])
        s = tl.where(vis, s, float("-inf"))
    return s, t


@triton.jit
def _tile_program(bh, m, H, G, row_heads, row_hdiv, TileStart, TileLen, TileFull, Keys,
                  n_tiles):
    """A query-tile program's batch, head, kv head and mask row, and its key list: the
    list's first key, its length and how many leading keys every query of the tile sees."""
    b = bh // H
    h = bh % H
    row = b * row_heads + h // row_hdiv
    at = row * n_tiles + m
    keys = Keys + tl.load(TileStart + at)
    # The batch index in int64: batch offsets of Q/K/V can pass 2**31 elements.
    return (b.to(tl.int64), h, h // G, row, keys, tl.load(TileLen + at),
            tl.load(TileFull + at))


@triton.jit
def _list_chunk(keys, n0, length, k_base, stride_kn, offs_d, dvalid, s_base, e_base, bias_base,
                stride_biask, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys ``n0 .. n0 + BLOCK_N`` of a list: indices, validity, K rows, bounds and bias."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kvalid = offs_n < length
    kidx = tl.load(keys + offs_n, mask=kvalid, other=0)
    k = tl.load(k_base + kidx[:, None] * stride_kn + offs_d[None, :],
                mask=kvalid[:, None] & dvalid[None, :], other=0.0)
    sb = tl.load(s_base + kidx, mask=kvalid, other=0)
    eb = tl.load(e_base + kidx, mask=kvalid, other=0)
    if HAS_BIAS:
        bias = tl.load(bias_base + kidx * stride_biask, mask=kvalid, other=0.0).to(tl.float32)
    else:
        bias = sb * 0.0
    return kidx, kvalid, k, sb, eb, bias


# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------


@triton.jit
def _ki_fwd_kernel(
    Q, K, V, Bias, Bounds, TileStart, TileLen, TileFull, Keys, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_biasb, stride_biash, stride_biask, bias_hdiv,
    row_heads, row_hdiv, bound_plane,
    H, G, Lq, Lk, n_tiles, pos_off, qk_scale, softcap,
    Rng, drop_thresh, drop_scale,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr = False,
):
    # DROPOUT: attention dropout as in the dense forward kernel (Rng, drop_thresh, drop_scale).
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk, row, keys, length, n_full = _tile_program(
        bh, m, H, G, row_heads, row_hdiv, TileStart, TileLen, TileFull, Keys, n_tiles)
    seed, offset = _dropout_seed(Rng, DROPOUT)

    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qvalid = offs_m < Lq
    dvalid = offs_d < HEAD_DIM
    pos = offs_m + pos_off
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=qvalid[:, None] & dvalid[None, :], other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    bias_base = Bias + b * stride_biasb + (h // bias_hdiv) * stride_biash
    s_base = Bounds + row * Lk
    e_base = s_base + bound_plane

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        kidx, kvalid, k, sb, eb, bias = _list_chunk(
            keys, n0, length, k_base, stride_kn, offs_d, dvalid, s_base, e_base, bias_base,
            stride_biask, HAS_BIAS, BLOCK_N)
        full = n0 + BLOCK_N <= n_full
        s, _t = _scores(q, tl.trans(k), bias, sb, eb, kidx, kvalid, pos, qvalid, qk_scale,
                        softcap, full, HAS_BIAS, CAUSAL, SOFTCAP, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _dropout_keep_tile(seed, offset, bh, offs_m, kidx, drop_thresh)
            p = tl.where(keep, p, 0.0)
        v = tl.load(v_base + kidx[:, None] * stride_vn + offs_d[None, :],
                    mask=kvalid[:, None] & dvalid[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        out = out * drop_scale
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=qvalid[:, None] & dvalid[None, :])
    tl.store(Lse + bh * Lq + offs_m, lse, mask=qvalid)


# ------------------------------------------------------------------------------------------
# Backward: dQ over the forward's lists
# ------------------------------------------------------------------------------------------


@triton.jit
def _ki_dq_kernel(
    Q, K, V, Bias, Bounds, TileStart, TileLen, TileFull, Keys, DO, Lse, Delta, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_biasb, stride_biash, stride_biask, bias_hdiv,
    row_heads, row_hdiv, bound_plane,
    H, G, Lq, Lk, n_tiles, pos_off, qk_scale, softcap,
    Rng, drop_thresh, drop_scale,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr = False,
):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk, row, keys, length, n_full = _tile_program(
        bh, m, H, G, row_heads, row_hdiv, TileStart, TileLen, TileFull, Keys, n_tiles)
    seed, offset = _dropout_seed(Rng, DROPOUT)

    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qvalid = offs_m < Lq
    dvalid = offs_d < HEAD_DIM
    qd = qvalid[:, None] & dvalid[None, :]
    pos = offs_m + pos_off
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=qd, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :], mask=qd, other=0.0)
    lse = tl.load(Lse + bh * Lq + offs_m, mask=qvalid, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    delta = tl.load(Delta + bh * Lq + offs_m, mask=qvalid, other=0.0)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    bias_base = Bias + b * stride_biasb + (h // bias_hdiv) * stride_biash
    s_base = Bounds + row * Lk
    e_base = s_base + bound_plane

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        kidx, kvalid, k, sb, eb, bias = _list_chunk(
            keys, n0, length, k_base, stride_kn, offs_d, dvalid, s_base, e_base, bias_base,
            stride_biask, HAS_BIAS, BLOCK_N)
        v = tl.load(v_base + kidx[:, None] * stride_vn + offs_d[None, :],
                    mask=kvalid[:, None] & dvalid[None, :], other=0.0)
        full = n0 + BLOCK_N <= n_full
        s, t = _scores(q, tl.trans(k), bias, sb, eb, kidx, kvalid, pos, qvalid, qk_scale,
                       softcap, full, HAS_BIAS, CAUSAL, SOFTCAP, UPCAST)
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), UPCAST)
        if DROPOUT:
            # The gradient reaches P at the kept entries only, scaled (delta is unchanged).
            keep = _dropout_keep_tile(seed, offset, bh, offs_m, kidx, drop_thresh)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += _dot(ds.to(k.dtype), k, UPCAST)
    dq = dq * qk_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qd)


# ------------------------------------------------------------------------------------------
# Backward: dK, dV, dbias over key blocks
# ------------------------------------------------------------------------------------------


@triton.jit
def _ki_dkv_kernel(
    Q, K, V, Bias, Bounds, BlkKeys, BlkQlo, BlkQhi, DO, Lse, Delta, DK, DV, DBias,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_biasb, stride_biash, stride_biask, bias_hdiv,
    row_heads, bound_plane, blocks_per_row,
    H, G, Lq, Lk, pos_off, qk_scale, softcap, segment_rows,
    Rng, drop_thresh, drop_scale,
    HAS_BIAS: tl.constexpr, NEED_DBIAS: tl.constexpr, PER_QHEAD: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr = False,
):
    blk = tl.program_id(0)
    seg = tl.program_id(1)
    row = blk // blocks_per_row
    # Segments are aligned to query positions, so the programs of one segment, running side
    # by side, read the same rows of Q and dO (from L2, not device memory).
    q_lo = tl.maximum(tl.load(BlkQlo + blk), seg * segment_rows)
    q_hi = tl.minimum(tl.load(BlkQhi + blk), (seg + 1) * segment_rows)
    if q_lo < q_hi:
        b = (row // row_heads).to(tl.int64)
        hx = row % row_heads
        if PER_QHEAD:
            hk = hx // G
            h0 = hx
            n_heads = 1
        else:
            hk = hx
            h0 = hx * G
            n_heads = G

        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        dvalid = offs_d < HEAD_DIM
        kidx = tl.load(BlkKeys + blk * BLOCK_N + offs_n)
        kvalid = kidx >= 0
        kidx = tl.where(kvalid, kidx, 0)
        kd = kvalid[:, None] & dvalid[None, :]
        k = tl.load(K + b * stride_kb + hk * stride_kh + kidx[:, None] * stride_kn
                    + offs_d[None, :], mask=kd, other=0.0)
        v = tl.load(V + b * stride_vb + hk * stride_vh + kidx[:, None] * stride_vn
                    + offs_d[None, :], mask=kd, other=0.0)
        sb = tl.load(Bounds + row * Lk + kidx, mask=kvalid, other=0)
        eb = tl.load(Bounds + bound_plane + row * Lk + kidx, mask=kvalid, other=0)
        # Query positions every key of the block sees: [first_all, last_all].
        big = 1 << 30
        first_all = tl.max(tl.where(kvalid, sb, -big), 0)
        if CAUSAL:
            first_all = tl.maximum(first_all, tl.max(tl.where(kvalid, kidx, -big), 0))
        last_all = tl.min(tl.where(kvalid, eb, big), 0) - 1
        all_keys = tl.min(kvalid.to(tl.int32), 0) > 0

        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        seed, offset = _dropout_seed(Rng, DROPOUT)
        # The query steps start at q_lo; with dropout at q_lo rounded down to a multiple of 16,
        # so that every step is whole 16-row groups (one Philox evaluation per group and key).
        m_first = q_lo
        if DROPOUT:
            m_first = q_lo - q_lo % 16
        for hh in range(0, n_heads):
            h = h0 + hh
            bh = b * H + h
            if HAS_BIAS:
                bias = tl.load(Bias + b * stride_biasb + (h // bias_hdiv) * stride_biash
                               + kidx * stride_biask, mask=kvalid, other=0.0).to(tl.float32)
            else:
                bias = sb * 0.0
            dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_dob + h * stride_doh
            for m0 in range(m_first, q_hi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                qvalid = offs_m < q_hi
                if DROPOUT:
                    qvalid = qvalid & (offs_m >= q_lo)  # the first step's rows below q_lo
                q_t = tl.load(q_base + offs_m[None, :] * stride_qm + offs_d[:, None],
                              mask=qvalid[None, :] & dvalid[:, None], other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :],
                             mask=qvalid[:, None] & dvalid[None, :], other=0.0)
                lse = tl.load(Lse + bh * Lq + offs_m, mask=qvalid, other=0.0)
                lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
                delta = tl.load(Delta + bh * Lq + offs_m, mask=qvalid, other=0.0)
                pos = offs_m + pos_off
                # Rows outside [q_lo, q_hi) read as zeros; the mask keeps them out of the sums.
                full = all_keys & (m0 + BLOCK_M <= q_hi) & (first_all <= m0 + pos_off)
                if DROPOUT:
                    full = full & (m0 >= q_lo)
                full = full & (m0 + BLOCK_M - 1 + pos_off <= last_all)
                s_t, t_t = _scores_t(k, q_t, bias, sb, eb, kidx, kvalid, pos, qvalid, qk_scale,
                                     softcap, full, HAS_BIAS, CAUSAL, SOFTCAP, UPCAST)
                p_t = tl.exp2(s_t - lse2[None, :])
                if DROPOUT:
                    keep = _dropout_keep_tile_t(seed, offset, bh, offs_m, kidx, drop_thresh)
                    p_drop = tl.where(keep, p_t * drop_scale, 0.0)
                else:
                    p_drop = p_t
                dv += _dot(p_drop.to(do.dtype), do, UPCAST)
                dp_t = _dot(v, tl.trans(do), UPCAST)
                if DROPOUT:
                    dp_t = tl.where(keep, dp_t * drop_scale, 0.0)
                ds_t = p_t * (dp_t - delta[None, :])
                if NEED_DBIAS:
                    dbias += tl.sum(ds_t, 1)
                if SOFTCAP:
                    ds_t = ds_t * (1.0 - t_t * t_t)
                dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), UPCAST)
            if NEED_DBIAS:
                tl.atomic_add(DBias + bh * Lk + kidx, dbias, mask=kvalid)
        dk = dk * qk_scale
        dk_head = hx if PER_QHEAD else hk
        tl.atomic_add(DK + b * stride_dkb + dk_head * stride_dkh + kidx[:, None] * stride_dkn
                      + offs_d[None, :], dk, mask=kd)
        tl.atomic_add(DV + b * stride_dkb + dk_head * stride_dkh + kidx[:, None] * stride_dkn
                      + offs_d[None, :], dv, mask=kd)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------


def _bias_args(bias: Optional[torch.Tensor], num_heads: int):
    """(tensor, stride_b, stride_h, stride_k, head_div) of a per-key ``(Bx, Hb, 1, Lk)`` bias."""
    if bias is None:
        return None, 0, 0, 0, 1
    sb = 0 if bias.shape[0] == 1 else bias.stride(0)
    sh = 0 if bias.shape[1] == 1 else bias.stride(1)
    sk = 0 if bias.shape[3] == 1 else bias.stride(3)
    return bias, sb, sh, sk, num_heads // bias.shape[1]


def supports_bias(bias: Optional[torch.Tensor]) -> bool:
    """The kernels read a bias with one value per key (``Qx == 1``) or none."""
    return bias is None or bias.shape[2] == 1


def plan_for(q, k, bounds, is_causal, backward: bool, window: Optional[int] = None):
    """Plan a call: ``(plan, full bounds, per_qhead)``; ``window``: the mask's window promise
    (see :class:`~flash_dmattn.masks.KeyIntervals`)."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    fb, per_qhead = full_bounds(bounds, B, H, Hkv)
    interp = interpret_mode()
    bm, _, _, _ = _fwd_config(D, interp)
    _, bn_b, _, _ = _bwd_config(D, interp)
    plan = plan_intervals(fb, Lq, Lk, is_causal, bm, bn_b, backward, window=window)
    return plan, fb, per_qhead


def interval_forward(q, k, v, bias, bounds, scale, is_causal, softcap, plan=None, dropout_p=0.0,
                     dropout_rng=None):
    """``(out, lse, (plan, full_bounds, per_qhead))`` of a key-interval call (with attention
    dropout ``dropout_p`` and the call's rng tensor ``dropout_rng``)."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if plan is None:
        plan = plan_for(q, k, bounds, is_causal, backward=False)
    ivp, fb, per_qhead = plan
    interp = interpret_mode()
    _, bn, warps, stages = _fwd_config(D, interp)
    bm = ivp.block_m  # the lists are per tile of the plan's rows
    out = alloc_output((B, Lq, H, D), q.dtype, q.device)
    lse = alloc_output((B, H, Lq), torch.float32, q.device)
    if B * H * Lq == 0:
        return out, lse, plan
    bias_t, sbb, sbh, sbk, bdiv = _bias_args(bias, H)
    heads_x = fb.shape[2]
    grid = (cdiv(Lq, bm), B * H)
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    _ki_fwd_kernel[grid](
        q, k, v, bias_t if bias_t is not None else q, fb, ivp.tile_start, ivp.tile_len,
        ivp.tile_full, ivp.keys, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        sbb, sbh, sbk, bdiv,
        heads_x, H // heads_x, fb[0].numel(),
        H, H // Hkv, Lq, Lk, ivp.n_tiles, Lk - Lq, float(scale), float(softcap), *drop_args,
        HAS_BIAS=bias is not None, CAUSAL=bool(is_causal), SOFTCAP=softcap > 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=head_block(D), HEAD_DIM=D,
        UPCAST=dot_upcast(q.dtype), DROPOUT=dropout, num_warps=warps, num_stages=stages,
    )
    return out, lse, plan


def interval_backward(dout, q, k, v, bias, bounds, out, lse, scale, is_causal, softcap,
                      deterministic, needs, plan=None, dropout_p=0.0, dropout_rng=None):
    """``(dq, dk, dv, dbias)`` of a key-interval call (None where ``needs`` says no)."""
    need_dq, need_dk, need_dv, need_dbias = needs
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    if plan is None or plan[0].blk_keys is None:
        plan = plan_for(q, k, bounds, is_causal, backward=True)
    ivp, fb, per_qhead = plan
    interp = interpret_mode()
    heads_x = fb.shape[2]
    bias_t, sbb, sbh, sbk, bdiv = _bias_args(bias, H)
    bias_arg = bias_t if bias_t is not None else q
    delta = _delta(dout, out)
    lse = lse.contiguous()
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    common = dict(HAS_BIAS=bias is not None, CAUSAL=bool(is_causal), SOFTCAP=softcap > 0,
                  BLOCK_D=head_block(D), HEAD_DIM=D, UPCAST=dot_upcast(q.dtype),
                  DROPOUT=dropout)

    dq = None
    if need_dq:
        dq = alloc_output((B, Lq, H, D), q.dtype, q.device)
        _, bn, warps, stages = _fwd_config(D, interp)
        bm = ivp.block_m
        if B * H * Lq:
            _ki_dq_kernel[(cdiv(Lq, bm), B * H)](
                q, k, v, bias_arg, fb, ivp.tile_start, ivp.tile_len, ivp.tile_full, ivp.keys,
                dout, lse, delta, dq,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2),
                sbb, sbh, sbk, bdiv,
                heads_x, H // heads_x, fb[0].numel(),
                H, G, Lq, Lk, ivp.n_tiles, Lk - Lq, float(scale), float(softcap), *drop_args,
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common,
            )

    dk = dv = dbias = None
    if need_dk or need_dv or need_dbias:
        bm, _, warps, stages = _bwd_config(D, interp)
        bn = ivp.block_n  # the plan's key blocks
        dk_heads = H if per_qhead else Hkv
        dk32 = torch.zeros((B, Lk, dk_heads, D), dtype=torch.float32, device=q.device)
        dv32 = torch.zeros_like(dk32)
        db32 = (torch.zeros((B, H, Lk), dtype=torch.float32, device=q.device)
                if need_dbias else dk32)
        n_blocks = ivp.n_blocks
        if n_blocks and Lq:
            seg = 1 << 30 if deterministic else SEGMENT_ROWS
            # Segments past a block's range exit at once: no need to read the ranges here.
            n_seg = max(1, cdiv(Lq, seg))
            _ki_dkv_kernel[(n_blocks, n_seg)](
                q, k, v, bias_arg, fb, ivp.blk_keys, ivp.blk_qlo, ivp.blk_qhi,
                dout, lse, delta, dk32, dv32, db32,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dk32.stride(0), dk32.stride(1), dk32.stride(2),
                sbb, sbh, sbk, bdiv,
                heads_x, fb[0].numel(), ivp.blocks_per_row,
                H, G, Lq, Lk, Lk - Lq, float(scale), float(softcap), seg, *drop_args,
                NEED_DBIAS=need_dbias, PER_QHEAD=per_qhead,
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common,
            )
        if per_qhead:
            dk32 = dk32.view(B, Lk, Hkv, G, D).sum(3)
            dv32 = dv32.view(B, Lk, Hkv, G, D).sum(3)
        dk = dk32.to(k.dtype) if need_dk else None
        dv = dv32.to(v.dtype) if need_dv else None
        if need_dbias:
            dbias = _reduce_dbias(db32, bias)
    return dq, dk, dv, dbias


def _delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` as fp32 ``(B, H, Lq)`` (the softmax backward's per-row term), by the
    dense backward's preprocessing kernel."""
    B, Lq, H, D = out.shape
    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=out.device)
    if delta.numel():
        bm = 16 if interpret_mode() else 64
        _bwd_preprocess[(cdiv(Lq, bm), B * H)](
            out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0),
            dout.stride(1), dout.stride(2), H, Lq, HEAD_DIM=D, BLOCK_D=head_block(D),
            BLOCK_M=bm)
    return delta


def _reduce_dbias(db32: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sum a ``(B, H, Lk)`` per-head dbias down to the bias's own ``(Bx, Hb, 1, Lk)`` shape."""
    B, H, Lk = db32.shape
    bx, hb, _, kx = bias.shape
    g = db32.view(B, hb, H // hb, Lk).sum(2)
    if bx == 1:
        g = g.sum(0, keepdim=True)
    if kx == 1:
        g = g.sum(-1, keepdim=True)
    return g.unsqueeze(2).to(bias.dtype)
