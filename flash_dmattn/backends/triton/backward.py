"""Triton backward kernels (FlashAttention-2 style) with tile skipping and bias gradients.

Kernels:

* ``_bwd_preprocess``: ``delta = rowsum(dout * out)`` (fp32).
* ``_attn_bwd_dkdv_kernel``: one program per (key tile, kv head slot); it loops over the query
  heads of the GQA group and over the live query tiles of each, accumulating dK/dV in registers
  (no atomics). It also produces dbias (see below).
* ``_attn_bwd_dq_kernel``: one program per (query tile, batch, query head) over the live key
  tiles, accumulating dQ in registers. Recomputing P and dP here costs two extra matmuls per
  tile but replaces fp32 atomics into dQ, whose traffic (one BLOCK_M x D fp32 add per live
  tile pair) dominated the previous single-pass design at long sequence lengths.

dbias targets (``T``) by bias shape ``(Bx, Hx, Qx, Kx)``; ``T`` is fp32 unless noted:

a. per-key (``Kx == Lk``), no cross-program reduction (``Bx == B`` and not (``Hx == 1 < Hkv``)):
   written in place into a tensor of the bias' shape (bias dtype when every element is written
   exactly once, i.e. ``Hx == H`` or no GQA, and ``Qx == Lq``). A per-query-head reduction over
   the group (``Hx == Hkv < H``) and a query reduction (``Qx == 1``) happen in-kernel.
b. ``Kx == Lk``, ``Qx == 1`` with a batch or kv-head broadcast: temporary ``(B, Hkv|H, 1, Lk)``
   of in-kernel query-reduced partials, summed with torch.
c. ``Kx == Lk``, ``Qx == Lq`` with a batch or kv-head broadcast: deterministic -> programs
   serialise the ``(b, kv head)`` pairs that share a bias slice (less parallelism, no
   temporary); otherwise fp32 atomics into a bias-shaped buffer.
d. ``Kx == 1`` (bias broadcast over keys): temporary ``(B, Hkv|H, Qx, nK)`` of per-key-tile
   partial row sums (``nK`` = number of key tiles), summed with torch.

Packed sequences (``VARLEN``, :func:`attention_backward_varlen`) use the same kernels with one
``(sequence, kv head)`` pair per dK/dV program; their per-key dbias is case (a)/(b) with
``Qx == 1`` and never needs atomics. With a per-key mask they walk
:class:`~flash_dmattn.planning.tiles.VarlenKeyLists` (live key tiles per (sequence, mask
head)): the dQ kernel iterates its row up to the causal limit, the dK/dV kernel looks its own
key tile up there,
visits no query tile for a head where it is dead (zero dK/dV/dbias, no Q/dO read; K/V not
read when dead for the whole group) and skips the mask load where it is full.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...planning.rows import aligned_rows
from .common import (
    LOG2E,
    _dot,
    _tanh,
    alloc_output,
    broadcast_strides,
    bwd_blocks,
    dot_upcast,
    head_block,
    interpret_mode,
    last_dim_contiguous,
    launch_tuned,
    seqlen_bucket,
)
from .dropout_mask import (
    _dropout_keep_tile,
    _dropout_keep_tile_t,
    _dropout_seed,
    dropout_args,
)
from .scores import (
    _gathered_row_bits,
    _key_bounds,
    _key_tile,
    _load_bcast,
    _load_mask_tile,
    _scores,
)
from .varlen import (
    _varlen_key_tiles,
    _varlen_list_len,
    _varlen_list_need_elem,
    _varlen_need_elem,
    _varlen_seq,
    _varlen_tile_state,
    varlen_aux_4d,
    varlen_list_args,
    varlen_tail_rows,
)
from ...intmath import cdiv
from ...planning.gather import gather_policy
from ...planning.plan import BackwardPlan, plan_backward

# dbias modes of the dK/dV kernel.
_DB_NONE, _DB_TILE, _DB_QRED, _DB_KRED, _DB_SCALAR = 0, 1, 2, 3, 4
# How _DB_TILE / _DB_KRED write: plain store, load-add-store (exclusive owner), fp32 atomics.
_ACC_STORE, _ACC_RMW, _ACC_ATOMIC = 0, 1, 2


@triton.jit
def _bwd_preprocess(
    Out, DO, Delta,
    stride_ob, stride_om, stride_oh,
    stride_db, stride_dm, stride_dh,
    num_heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :],
                 mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seqlen_q + offs_m, tl.sum(o * do, 1), mask=offs_m < seqlen_q)


@triton.jit
def _scores_t(k, q, bias_base, mask_base, offs_n, offs_m, need_elem, mask_klim, bias_klim,
              stride_bm, stride_bn, stride_mm, stride_mn,
              seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
              HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_UPCAST: tl.constexpr,
              ELEM: tl.constexpr):
    """Transposed scores (keys x queries) in log2 units, plus tanh (for the softcap chain).

    ``ELEM`` as in :func:`.scores._scores` (1: always masked, 2: ``need_elem`` decides).
    """
    st = _dot(k, tl.trans(q), DOT_UPCAST)
    if HAS_SOFTCAP:
        th = _tanh(st * cap_scale)
        st = (softcap * 1.4426950408889634) * th
    else:
        th = st
        st = st * qk_scale
    if HAS_BIAS:
        bv = _load_bcast(bias_base, offs_n, offs_m, stride_bn, stride_bm, bias_klim, seqlen_q,
                         BIAS_KB, BIAS_QB, 0.0)
        st = st + bv.to(tl.float32) * 1.4426950408889634
    if HAS_MASK:  # outside the branch so it is pipelined (see _load_mask_tile)
        mv = _load_mask_tile(mask_base, offs_n, offs_m, stride_mn, stride_mm, mask_klim, seqlen_q,
                             MASK_KB, MASK_QB, need_elem)
    else:
        mv = 1
    if ELEM == 1:
        st = _hide_t(st, mv, offs_n, offs_m, seqlen_q, seqlen_k, HAS_MASK, IS_CAUSAL)
    elif ELEM == 2:
        if need_elem:
            st = _hide_t(st, mv, offs_n, offs_m, seqlen_q, seqlen_k, HAS_MASK, IS_CAUSAL)
    return st, th


@triton.jit
def _hide_t(st, mv, offs_n, offs_m, seqlen_q, seqlen_k, HAS_MASK: tl.constexpr,
            IS_CAUSAL: tl.constexpr):
    """-inf where a (key, query) element is out of range, masked or causally hidden."""
    vis = offs_n[:, None] < seqlen_k
    if HAS_MASK:
        vis = vis & (mv != 0)
    if IS_CAUSAL:
        vis = vis & (offs_n[:, None] <= offs_m[None, :] + (seqlen_k - seqlen_q))
    return tl.where(vis, st, float("-inf"))


@triton.jit
def _varlen_group_live(ListIdx, ListCnt, b, hk, group, list_hdiv,
                       stride_lb, stride_lh, stride_cb, stride_ch, tile):
    """Whether key tile ``tile`` of packed sequence ``b`` holds a live key for any query head
    of kv head ``hk``'s group (varlen key-tile lists, one row per (sequence, mask head))."""
    live = tile < 0
    for g in range(0, group):
        lh = (hk * group + g) // list_hdiv
        n = tl.load(ListCnt + b * stride_cb + lh * stride_ch)
        live_g, _ = _varlen_tile_state(ListIdx + b * stride_lb + lh * stride_lh, n, tile)
        live = live | live_g
    return live


@triton.jit
def _dkdv_tile(dk, dv, col_acc, sc_acc, k, v, start_m, need_elem, mask_klim, bias_klim,
               Q, DO, DB, lse_row, delta_row, bias_base, mask_base, db_base,
               b64, h64, offs_m0, offs_n, offs_d, d_ok, n_ok, pid_n,
               stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
               stride_bm, stride_bn, stride_mm, stride_mn, stride_tm, stride_tn,
               seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
               HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
               HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_UPCAST: tl.constexpr,
               STORE_DKV: tl.constexpr, DB_MODE: tl.constexpr, DB_ACC: tl.constexpr,
               ELEM: tl.constexpr, seed=0, offset=0, bh=0, drop_thresh=0, drop_scale=1.0,
               DROPOUT: tl.constexpr = False):
    """One query tile of the dK/dV kernel: returns the updated ``(dk, dv, col_acc, sc_acc)``
    (dbias modes 1 and 3 store their part directly).

    With ``DROPOUT``, ``O = dropout(P) V``: dV takes the kept, scaled probabilities, and the
    gradient reaching ``P`` is ``dO V^T`` at the kept entries, scaled (0 elsewhere); ``delta``
    (rowsum of ``dO * O``) is unchanged."""
    offs_m = start_m + offs_m0
    m_ok = offs_m < seqlen_q
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    # Rows past Lq and rows with no visible key (lse = -inf) get lse = +inf: p = 0.
    lse = tl.load(lse_row + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_row + offs_m, mask=m_ok, other=0.0)

    st, th = _scores_t(k, q, bias_base, mask_base, offs_n, offs_m, need_elem, mask_klim, bias_klim,
                       stride_bm, stride_bn, stride_mm, stride_mn,
                       seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                       HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB,
                       IS_CAUSAL, HAS_SOFTCAP, DOT_UPCAST, ELEM)
    pt = tl.exp2(st - lse2[None, :])
    if DROPOUT:
        # The keep tile is made after dP^T and applied to both of its uses at once, so it is
        # never live across a dot (a (N, M) boolean tile costs a register per element).
        dpt = _dot(v, tl.trans(do), DOT_UPCAST)
        keep = _dropout_keep_tile_t(seed, offset, bh, offs_m, offs_n, drop_thresh)
        dpt = tl.where(keep, dpt * drop_scale, 0.0)
        if STORE_DKV:
            dv += _dot(tl.where(keep, pt * drop_scale, 0.0).to(do.dtype), do, DOT_UPCAST)
    else:
        if STORE_DKV:
            dv += _dot(pt.to(do.dtype), do, DOT_UPCAST)
        dpt = _dot(v, tl.trans(do), DOT_UPCAST)
    # dst: gradient w.r.t. the final (soft-capped + bias) score, natural units.
    dst = pt * (dpt - delta[None, :])

    if DB_MODE == 1:
        t_ptrs = db_base + offs_n[:, None] * stride_tn + offs_m[None, :] * stride_tm
        t_ok = n_ok[:, None] & m_ok[None, :]
        if DB_ACC == 0:
            tl.store(t_ptrs, dst.to(DB.dtype.element_ty), mask=t_ok)
        elif DB_ACC == 1:
            # Earlier iterations' stores came from other threads' layouts.
            tl.debug_barrier()
            old = tl.load(t_ptrs, mask=t_ok, other=0.0)
            tl.store(t_ptrs, old + dst, mask=t_ok)
        else:
            tl.atomic_add(t_ptrs, dst, mask=t_ok)
    elif DB_MODE == 2:
        col_acc += tl.sum(dst, 1)
    elif DB_MODE == 3:
        r_ptrs = db_base + offs_m * stride_tm + pid_n * stride_tn
        rsum = tl.sum(dst, 0)
        if DB_ACC == 1:
            tl.debug_barrier()
            old = tl.load(r_ptrs, mask=m_ok, other=0.0)
            tl.store(r_ptrs, old + rsum, mask=m_ok)
        else:
            tl.store(r_ptrs, rsum, mask=m_ok)
    elif DB_MODE == 4:
        sc_acc += tl.sum(tl.sum(dst, 1), 0)

    if HAS_SOFTCAP:
        dst = dst * (1.0 - th * th)
    dst_lp = dst.to(q.dtype)
    if STORE_DKV:
        dk += _dot(dst_lp, q, DOT_UPCAST)
    return dk, dv, col_acc, sc_acc


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Mask, Bias, DB, ListIdx, ListCnt, CuQ, CuK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_tb, stride_th, stride_tm, stride_tn, db_hdiv,
    stride_lb, stride_lh, stride_ln, stride_cb, stride_ch, stride_cn, list_hdiv,
    num_heads, group, seqlen_q, seqlen_k, n_q_tiles, stride_lse_h,
    n_pairs, pair_h, slots_h,
    sm_scale, qk_scale, cap_scale, softcap,
    lq_bucket, lk_bucket,
    Rng, drop_thresh, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_LIST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    STORE_DKV: tl.constexpr,
    DB_MODE: tl.constexpr, DB_ACC: tl.constexpr, DB_GROUP: tl.constexpr,
    VARLEN: tl.constexpr = False, MASK_PAD: tl.constexpr = False, BIAS_PAD: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
):
    # MASK_PAD / BIAS_PAD: padded mask / bias rows, as in the forward kernel.
    # VARLEN: packed sequences (one pair per program, slot_b = sequence index); pointers are
    # moved to the sequence's first query / key row and lengths become per sequence.
    # DROPOUT: as in the forward kernel (the same keep-mask, regenerated per tile).
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if IS_CAUSAL:
        # Key tile n's work shrinks with n (fewer query tiles see it). Launch every slot's
        # tile 0 first, then every tile 1, ...: heaviest programs first. With GQA the grid
        # is small (e.g. 64 key tiles x 4 kv heads on 132 SMs) and the default order (all of
        # slot 0, then slot 1, ...) leaves the heavy tiles of the last slots for the tail:
        # a greedy-schedule model of that grid gives about 1.5x the steps of this order.
        lin = pid_n + slot * tl.num_programs(0)
        pid_n = lin // tl.num_programs(1)
        slot = lin % tl.num_programs(1)
    slot_b = slot // slots_h
    slot_h = slot % slots_h
    if VARLEN:
        q_start, seqlen_q, k_start, seqlen_k = _varlen_seq(CuQ, CuK, slot_b)
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        K += k_start * stride_kn
        V += k_start * stride_vn
        DK += k_start * stride_dkn
        DV += k_start * stride_dvn
        Mask += k_start * stride_mn
        Bias += k_start * stride_bn
        DB += k_start * stride_tn
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < seqlen_k
    n_edge = start_n + BLOCK_N > seqlen_k
    mask_klim, bias_klim = _key_bounds(stride_mm, stride_bm, seqlen_k, MASK_PAD, BIAS_PAD)
    seed, offset = _dropout_seed(Rng, DROPOUT)

    # Usually one pair; several only when this program must own a bias slice shared by them.
    for r in range(0, n_pairs):
        b = slot_b + r // pair_h
        hk = slot_h + r % pair_h
        b64 = b.to(tl.int64)
        kv_ok = n_ok
        if VARLEN:
            if USE_LIST:
                # A key tile dead for every head of the group is never read (dK/dV become 0):
                # its K/V loads get an empty key range.
                group_live = _varlen_group_live(ListIdx, ListCnt, b, hk, group, list_hdiv,
                                                stride_lb, stride_lh, stride_cb, stride_ch,
                                                pid_n)
                kv_ok = offs_n < tl.where(group_live, seqlen_k, 0)
        k = tl.load(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        col_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        sc_acc = tl.sum(col_acc, 0)
        for g in range(0, group):
            h = hk * group + g
            h64 = h.to(tl.int64)
            bh = b * num_heads + h
            if not DB_GROUP:
                col_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                sc_acc = tl.sum(col_acc, 0)
            mask_base = Mask + b64 * stride_mb + (h // mask_hdiv).to(tl.int64) * stride_mh
            bias_base = Bias + b64 * stride_bb + (h // bias_hdiv).to(tl.int64) * stride_bh
            db_base = DB + b64 * stride_tb + (h // db_hdiv).to(tl.int64) * stride_th
            if USE_LIST:
                lh = h // list_hdiv
                list_row = ListIdx + b * stride_lb + lh * stride_lh + pid_n * stride_ln
                n_iter = tl.load(ListCnt + b * stride_cb + lh * stride_ch + pid_n * stride_cn)
            else:
                list_row = ListIdx
                n_iter = n_q_tiles
            t_lo = 0
            if VARLEN:
                n_q_seq = tl.where(start_n < seqlen_k, tl.cdiv(seqlen_q, BLOCK_M), 0)
                if USE_LIST:
                    # The list is of key tiles: this program's tile is dead (no query tile
                    # visited, no Q / dO read) or full / partial for every query tile.
                    tile_live, tile_partial = _varlen_tile_state(list_row, n_iter, pid_n)
                    n_iter = tl.where(tile_live, n_q_seq, 0)
                else:
                    n_iter = n_q_seq
                if IS_CAUSAL:
                    # first query row that sees key start_n (bottom-right alignment)
                    t_lo = tl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M
                lse_row = Lse + h64 * stride_lse_h + q_start
                delta_row = Delta + h64 * stride_lse_h + q_start
            else:
                lse_row = Lse + bh.to(tl.int64) * seqlen_q
                delta_row = Delta + bh.to(tl.int64) * seqlen_q
            if USE_LIST and not VARLEN:
                # One loop with a per-tile branch, unlike the forward and dQ kernels: two loop
                # copies push this kernel (two fp32 128x128 accumulators) into heavy spilling.
                # Entries one iteration ahead, as in the forward's listed loop.
                entry_next = tl.load(list_row, mask=n_iter > 0, other=0)
                for t in range(0, n_iter):
                    entry = entry_next
                    entry_next = tl.load(list_row + t + 1, mask=t + 1 < n_iter, other=0)
                    dk, dv, col_acc, sc_acc = _dkdv_tile(
                        dk, dv, col_acc, sc_acc, k, v, (entry >> 1) * BLOCK_M, (entry & 1) != 0,
                        mask_klim, bias_klim,
                        Q, DO, DB, lse_row, delta_row, bias_base, mask_base, db_base,
                        b64, h64, offs_m0, offs_n, offs_d, d_ok, n_ok, pid_n,
                        stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
                        stride_bm, stride_bn, stride_mm, stride_mn, stride_tm, stride_tn,
                        seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                        HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
                        HAS_SOFTCAP, DOT_UPCAST, STORE_DKV, DB_MODE, DB_ACC, 2, seed=seed,
                        offset=offset, bh=bh, drop_thresh=drop_thresh, drop_scale=drop_scale,
                        DROPOUT=DROPOUT)
            else:
                for t in range(t_lo, n_iter):
                    start_m = t * BLOCK_M
                    need_elem = n_edge
                    if VARLEN:
                        if USE_LIST:
                            need_elem = _varlen_list_need_elem(tile_partial, start_m, start_n,
                                                               seqlen_q, seqlen_k, BLOCK_M,
                                                               BLOCK_N, IS_CAUSAL)
                        else:
                            need_elem = _varlen_need_elem(need_elem, start_m, start_n,
                                                          seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                                          HAS_MASK, IS_CAUSAL)
                    dk, dv, col_acc, sc_acc = _dkdv_tile(
                        dk, dv, col_acc, sc_acc, k, v, start_m, need_elem, mask_klim, bias_klim,
                        Q, DO, DB, lse_row, delta_row, bias_base, mask_base, db_base,
                        b64, h64, offs_m0, offs_n, offs_d, d_ok, n_ok, pid_n,
                        stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
                        stride_bm, stride_bn, stride_mm, stride_mn, stride_tm, stride_tn,
                        seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                        HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
                        HAS_SOFTCAP, DOT_UPCAST, STORE_DKV, DB_MODE, DB_ACC, 2, seed=seed,
                        offset=offset, bh=bh, drop_thresh=drop_thresh, drop_scale=drop_scale,
                        DROPOUT=DROPOUT)
            if not DB_GROUP:
                if DB_MODE == 2:
                    tl.store(db_base + offs_n * stride_tn, col_acc, mask=n_ok)
                elif DB_MODE == 4:
                    tl.store(db_base + pid_n * stride_tn, sc_acc)
        if DB_GROUP:
            db_base_g = DB + b64 * stride_tb + ((hk * group) // db_hdiv).to(tl.int64) * stride_th
            if DB_MODE == 2:
                tl.store(db_base_g + offs_n * stride_tn, col_acc, mask=n_ok)
            elif DB_MODE == 4:
                tl.store(db_base_g + pid_n * stride_tn, sc_acc)
        if STORE_DKV:
            dk = dk * sm_scale
            tl.store(DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
                     dk.to(DK.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
            tl.store(DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
                     dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base,
             offs_m, offs_n, offs_d, d_ok, n_ok, mask_cols, mask_lim, need_elem, bias_klim,
             stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
             seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
             HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
             HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
             IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_UPCAST: tl.constexpr,
             ELEM: tl.constexpr, BIAS_GATHERED: tl.constexpr = False,
             mask_bits=0, MASK_BITS: tl.constexpr = 0, seed=0, offset=0, bh=0, drop_thresh=0,
             drop_scale=1.0, DROPOUT: tl.constexpr = False):
    """One key tile of the dQ kernel: returns ``dq`` plus this tile's ``dS @ K`` (with
    ``DROPOUT`` the gradient reaching ``P`` is taken at the kept entries, as in
    :func:`_dkdv_tile`)."""
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None],
                 mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    s, th = _scores(q, tl.trans(k), bias_base, mask_base, offs_m, offs_n, n_ok, mask_cols,
                    mask_lim, need_elem, bias_klim, mask_bits, stride_bm, stride_bn, stride_mm,
                    stride_mn, seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                    HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB,
                    IS_CAUSAL, HAS_SOFTCAP, DOT_UPCAST, ELEM, BIAS_GATHERED, MASK_BITS)
    p = tl.exp2(s - lse2[:, None])
    dp = _dot(do, vt, DOT_UPCAST)
    if DROPOUT:
        # Gathered keys or a key tile alike: one Philox evaluation per 16 rows of a key.
        keep = _dropout_keep_tile(seed, offset, bh, offs_m, offs_n, drop_thresh)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - th * th)
    return dq + _dot(ds.to(k.dtype), k, DOT_UPCAST)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Mask, Bias, ListIdx, ListCnt, CuQ, CuK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_lb, stride_lh, stride_lm, stride_cb, stride_ch, stride_cm, list_hdiv,
    num_heads, group, seqlen_q, seqlen_k, n_k_tiles, stride_lse_h,
    sm_scale, qk_scale, cap_scale, softcap,
    lq_bucket, lk_bucket,
    Rng, drop_thresh, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_LIST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, GATHER: tl.constexpr, VARLEN: tl.constexpr = False,
    MASK_PAD: tl.constexpr = False, BIAS_PAD: tl.constexpr = False,
    BIAS_GATHERED: tl.constexpr = False, DROPOUT: tl.constexpr = False,
):
    # MASK_PAD / BIAS_PAD: padded mask / bias rows, as in the forward kernel.
    # GATHER, BIAS_GATHERED: as in the forward kernel (key lists of a KeyGather, its mask
    # bits words, gathered per-key bias).
    # VARLEN: as in the forward kernel (b is the packed sequence index).
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest (bottom) query tiles first
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    if VARLEN:
        q_start, seqlen_q, k_start, seqlen_k = _varlen_seq(CuQ, CuK, b)
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        DQ += q_start * stride_dqm
        K += k_start * stride_kn
        V += k_start * stride_vn
        Mask += k_start * stride_mn
        Bias += k_start * stride_bn
        lse_off = h64 * stride_lse_h + q_start
    else:
        lse_off = pid_bh.to(tl.int64) * seqlen_q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seqlen_q

    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(Lse + lse_off + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + lse_off + offs_m, mask=m_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b64 * stride_mb + (h // mask_hdiv).to(tl.int64) * stride_mh
    bias_base = Bias + b64 * stride_bb + (h // bias_hdiv).to(tl.int64) * stride_bh
    if BIAS_GATHERED:
        bias_base += pid_m.to(tl.int64) * stride_bm
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed, offset = _dropout_seed(Rng, DROPOUT)

    if USE_LIST:
        lh = h // list_hdiv
        list_row = ListIdx + b * stride_lb + lh * stride_lh + pid_m * stride_lm
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
        # One loop with the partial flag per tile, entries loaded one iteration ahead (see
        # the forward kernel).
        entry_next = tl.load(list_row, mask=n_iter > 0, other=0)
        for t in range(0, n_iter):
            entry = entry_next
            entry_next = tl.load(list_row + t + 1, mask=t + 1 < n_iter, other=0)
            offs_n = (entry >> 1) * BLOCK_N + offs_n0
            need_elem = (entry & 1) != 0
            if VARLEN:
                need_elem = _varlen_list_need_elem(need_elem, pid_m * BLOCK_M,
                                                   (entry >> 1) * BLOCK_N, seqlen_q, seqlen_k,
                                                   BLOCK_M, BLOCK_N, IS_CAUSAL)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base,
                          offs_m, offs_n, offs_d, d_ok, offs_n < seqlen_k, offs_n, mask_klim,
                          need_elem, bias_klim,
                          stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                          seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                          HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
                          HAS_SOFTCAP, DOT_UPCAST, 2, seed=seed, offset=offset, bh=pid_bh,
                          drop_thresh=drop_thresh, drop_scale=drop_scale, DROPOUT=DROPOUT)
    elif GATHER:
        # Gathered keys: indices by position in the row's key list, masked per element.
        # Unlike the forward, the index load stays in the step that uses it: with 3 stages the
        # pipeliner already issues it a stage ahead as an async copy (compile_check --dump);
        # loaded a step ahead by hand it became a synchronous load and the kernel grew.
        n_keys = n_iter
        bits_rows = mask_base + offs_m.to(tl.int64) * stride_mm
        for t in range(0, tl.cdiv(n_keys, BLOCK_N)):
            cols = t * BLOCK_N + offs_n0
            keys = tl.load(list_row + cols, mask=cols < n_keys, other=0)
            row_bits = _gathered_row_bits(bits_rows, t, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base,
                          offs_m, keys, offs_d, d_ok, cols < n_keys, cols, stride_mm, True, bias_klim,
                          stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                          seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                          HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
                          HAS_SOFTCAP, DOT_UPCAST, 1, BIAS_GATHERED, row_bits, 2, seed=seed,
                          offset=offset, bh=pid_bh, drop_thresh=drop_thresh,
                          drop_scale=drop_scale, DROPOUT=DROPOUT)
    else:
        for t in range(0, n_iter):
            offs_n, n_ok, need_elem = _key_tile(t, offs_n0, pid_m * BLOCK_M, seqlen_q, seqlen_k,
                                                BLOCK_M, BLOCK_N, HAS_MASK, IS_CAUSAL, VARLEN)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base,
                          offs_m, offs_n, offs_d, d_ok, n_ok, offs_n, mask_klim, need_elem, bias_klim,
                          stride_kn, stride_vn, stride_bm, stride_bn, stride_mm, stride_mn,
                          seqlen_q, seqlen_k, qk_scale, cap_scale, softcap,
                          HAS_MASK, MASK_QB, MASK_KB, HAS_BIAS, BIAS_QB, BIAS_KB, IS_CAUSAL,
                          HAS_SOFTCAP, DOT_UPCAST, 2, seed=seed, offset=offset, bh=pid_bh,
                          drop_thresh=drop_thresh, drop_scale=drop_scale, DROPOUT=DROPOUT)
    dq = dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------
# Launch configuration
# ------------------------------------------------------------------------------------------

_BWD_KEY = ["HEAD_DIM", "IS_CAUSAL", "HAS_MASK", "HAS_BIAS", "HAS_SOFTCAP", "USE_LIST",
            "VARLEN", "DROPOUT", "lq_bucket", "lk_bucket"]


def _bwd_configs():
    return [triton.Config({}, num_warps=w, num_stages=s)
            for w, s in ((8, 3), (8, 2), (4, 3), (4, 2), (8, 1))]


def _prune_dkdv(configs, named_args, **kwargs):
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
    bn = kwargs.get("BLOCK_N", named_args.get("BLOCK_N", 128))
    out = []
    for c in configs:
        if bn >= 128 and bd >= 64 and c.num_warps < 8:
            continue  # two 128 x D fp32 accumulators on one warpgroup spill
        if bd >= 256 and c.num_stages > 2:
            continue  # shared memory
        out.append(c)
    return out or configs[:1]


def _prune_dq(configs, named_args, **kwargs):
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 64))
    out = [c for c in configs
           if not (bd >= 256 and c.num_stages > 2) and not (bm >= 128 and c.num_warps < 8)]
    return out or configs[:1]


_dkdv_tuned = triton.autotune(
    configs=_bwd_configs(),
    key=_BWD_KEY + ["STORE_DKV", "DB_MODE", "DB_ACC"],
    prune_configs_by={"early_config_prune": _prune_dkdv},
    reset_to_zero=["DB"],
)(_attn_bwd_dkdv_kernel)

_dq_tuned = triton.autotune(
    configs=_bwd_configs(), key=_BWD_KEY + ["GATHER"], prune_configs_by={"early_config_prune": _prune_dq}
)(_attn_bwd_dq_kernel)


def _dbias_plan(bias: torch.Tensor, B: int, H: int, Hkv: int, Lq: int, Lk: int,
                n_k_tiles: int, deterministic: bool, dense: bool):
    """Choose the dbias target buffer and kernel mode (cases a-d of the module docstring).

    Returns (target, mode, acc, group_reduce, n_pairs, pair_h, slots_b, slots_h, finish) where
    ``finish(target)`` turns the kernel's buffer into dbias of the bias' shape and dtype.
    """
    bx, hx, qx, kx = bias.shape
    G = H // Hkv
    dev = bias.device
    q_red = qx == 1 and Lq != 1
    k_red = kx == 1 and Lk != 1
    th = H if hx == H else Hkv  # target head count when the target is per (b, kv head) pair
    group_reduce = th != H
    reduce_b = bx == 1 and B > 1
    reduce_h = hx == 1 and Hkv > 1
    one_pair = (1, 1, B, Hkv)

    def sum_to_bias(t):
        if reduce_b:
            t = t.sum(0, keepdim=True)
        if hx == 1 and t.size(1) > 1:
            t = t.sum(1, keepdim=True)
        return t.to(bias.dtype)

    if k_red:
        # (d) per-key-tile partial row sums.
        target = torch.zeros((B, th, qx, n_k_tiles), dtype=torch.float32, device=dev)
        mode = _DB_SCALAR if q_red else _DB_KRED
        acc = _ACC_RMW if (group_reduce and G > 1) else _ACC_STORE
        return (target, mode, acc, group_reduce, *one_pair,
                lambda t: sum_to_bias(t.sum(3, keepdim=True)))
    if not reduce_b and not reduce_h:
        # (a) exclusive ownership: write the bias-shaped result in place.
        if q_red:
            target = torch.zeros(bias.shape, dtype=torch.float32, device=dev)
            return (target, _DB_QRED, _ACC_STORE, group_reduce, *one_pair,
                    lambda t: t.to(bias.dtype))
        if group_reduce and G > 1:
            target = torch.zeros(bias.shape, dtype=torch.float32, device=dev)
            return (target, _DB_TILE, _ACC_RMW, group_reduce, *one_pair,
                    lambda t: t.to(bias.dtype))
        # Every visited element is stored exactly once; skipped (dead) tiles must read as 0.
        if dense:
            target = alloc_output(bias.shape, bias.dtype, dev)
        else:
            target = torch.zeros(bias.shape, dtype=bias.dtype, device=dev)
        return (target, _DB_TILE, _ACC_STORE, group_reduce, *one_pair, lambda t: t)
    if q_red:
        # (b) query-reduced partials per (b, kv head or head), summed with torch.
        target = torch.zeros((B, th, 1, Lk), dtype=torch.float32, device=dev)
        return (target, _DB_QRED, _ACC_STORE, group_reduce, *one_pair, sum_to_bias)
    # (c) full (Lq, Lk) tiles shared across batch and/or kv heads.
    target = torch.zeros(bias.shape, dtype=torch.float32, device=dev)
    if not deterministic:
        return (target, _DB_TILE, _ACC_ATOMIC, group_reduce, *one_pair,
                lambda t: t.to(bias.dtype))
    pair_b = B if reduce_b else 1
    pair_h = Hkv if reduce_h else 1
    return (target, _DB_TILE, _ACC_RMW, group_reduce, pair_b * pair_h, pair_h,
            B // pair_b, Hkv // pair_h, lambda t: t.to(bias.dtype))


def _target_strides(target: torch.Tensor, H: int):
    st = [0 if target.size(d) == 1 else target.stride(d) for d in range(4)]
    return st[0], st[1], st[2], st[3], H // target.size(1)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    deterministic: bool,
    bias_needs_grad: bool,
    needs_dq: bool = True,
    needs_dkv: bool = True,
    plan: Optional[BackwardPlan] = None,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
):
    """Attention backward.

    Args:
        dout, out: ``(B, Lq, H, D)``; q ``(B, Lq, H, D)``; k, v ``(B, Lk, Hkv, D)``; lse
            ``(B, H, Lq)`` fp32 from :func:`attention_forward`; mask/bias/scale/causal/softcap
            exactly as given to the forward.
        deterministic: bitwise reproducible (only dbias of a bias shared across batch or kv
            heads ever uses atomics; this serialises those programs instead).
        bias_needs_grad: compute dbias (requires ``bias``).
        needs_dq / needs_dkv: skip work for gradients nobody wants.
        plan: the lists and gather plan the forward of this call worked out for the backward
            (:func:`.forward.attention_forward` with ``keep_plan``); planned here if None.
        dropout_p, dropout_rng: the forward's attention dropout (its keep-mask is
            regenerated here).

    Returns:
        ``(dq, dk, dv, dbias)``; dq/dk/dv in q/k/v's dtype (None when not requested), dbias of
        the bias view's exact shape and dtype (None unless requested).
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    lse = lse.contiguous()
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    device = q.device
    want_db = bool(bias_needs_grad) and bias is not None

    dq = alloc_output(q.shape, q.dtype, device) if needs_dq else None
    dk = alloc_output(k.shape, k.dtype, device) if needs_dkv else None
    dv = alloc_output(v.shape, v.dtype, device) if needs_dkv else None
    if B * H * Lq * Lk == 0:
        for t in (dq, dk, dv):
            if t is not None:
                t.zero_()
        return dq, dk, dv, (torch.zeros_like(bias) if want_db else None)

    (block_m, block_n), (block_m2, block_n2) = bwd_blocks(D)
    n_q_tiles = cdiv(Lq, block_m)
    n_k_tiles = cdiv(Lk, block_n)
    bd = head_block(D)
    interp = interpret_mode()

    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=device)
    pre_bm = 16 if interp else 64
    _bwd_preprocess[(cdiv(Lq, pre_bm), B * H)](
        out, dout, delta,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        H, Lq, HEAD_DIM=D, BLOCK_D=bd, BLOCK_M=pre_bm,
    )

    run_dkdv = needs_dkv or want_db
    run_dq_kernel = needs_dq
    use_list = mask is not None or bool(is_causal)
    mask, mask_pad = aligned_rows(mask, Lq, Lk)
    if plan is None or plan.policy != gather_policy("dq"):
        plan = plan_backward(mask, bias, Lq, Lk, H, is_causal, ((block_m, block_n),
                             (block_m2, block_n2)), device, run_dq=run_dq_kernel,
                             run_dkdv=run_dkdv)
    gather = plan.gather if run_dq_kernel else None
    tiles, tiles_q = plan.tiles, plan.tiles_q

    mask_arg = mask.view(torch.uint8) if mask is not None else q
    # The bias is read through a row-aligned copy when needed; dbias keeps the bias's own
    # shape and layout (_dbias_plan below works from ``bias`` itself).
    bias_read, bias_pad = aligned_rows(bias, Lq, Lk)
    bias_arg = bias_read if bias_read is not None else q
    ms = broadcast_strides(mask, H)
    bs = broadcast_strides(bias_read, H)
    has_softcap = softcap > 0.0
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    scal = (softmax_scale, softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0,
            softcap, seqlen_bucket(Lq), seqlen_bucket(Lk), *drop_args)
    flags = dict(
        HEAD_DIM=D, BLOCK_D=bd, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        MASK_QB=mask is not None and mask.size(2) == 1,
        MASK_KB=mask is not None and mask.size(3) == 1,
        HAS_BIAS=bias is not None,
        BIAS_QB=bias is not None and bias.size(2) == 1,
        BIAS_KB=bias is not None and bias.size(3) == 1,
        IS_CAUSAL=bool(is_causal), USE_LIST=use_list, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), MASK_PAD=mask_pad, BIAS_PAD=bias_pad,
        DROPOUT=dropout,
    )

    dbias = None
    if run_dkdv:
        if want_db:
            (target, db_mode, db_acc, db_group, n_pairs, pair_h, slots_b, slots_h,
             finish) = _dbias_plan(bias, B, H, Hkv, Lq, Lk, n_k_tiles, deterministic, not use_list)
            ts = _target_strides(target, H)
        else:
            # Never pass a real input here: the autotuner zeroes DB between trials.
            target = torch.empty(1, dtype=torch.float32, device=device)
            db_mode, db_acc, db_group = _DB_NONE, _ACC_STORE, False
            n_pairs, pair_h, slots_b, slots_h, finish = 1, 1, B, Hkv, None
            ts = (0, 0, 0, 0, 1)
        dk_arg = dk if needs_dkv else q
        dv_arg = dv if needs_dkv else q
        if use_list:
            idx, cnt, lst, lhd = tiles.bwd_idx, tiles.bwd_cnt, tiles.bwd_strides(), tiles.head_div
        else:
            idx, cnt, lst, lhd = q, q, (0, 0, 0, 0, 0, 0), 1
        args = (
            q, k, v, dout, lse, delta, dk_arg, dv_arg, mask_arg, bias_arg, target, idx, cnt, q, q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dk_arg.stride(0), dk_arg.stride(1), dk_arg.stride(2),
            dv_arg.stride(0), dv_arg.stride(1), dv_arg.stride(2),
            *ms, *bs, *ts, *lst, lhd,
            H, G, Lq, Lk, n_q_tiles, 0,
            n_pairs, pair_h, slots_h,
            *scal,
        )
        meta = dict(flags, STORE_DKV=needs_dkv,
                    DB_MODE=db_mode, DB_ACC=db_acc, DB_GROUP=db_group, VARLEN=False)
        grid = (n_k_tiles, slots_b * slots_h)
        _launch_dkdv(grid, args, meta)
        if want_db:
            dbias = finish(target)

    if run_dq_kernel:
        flags = dict(flags, BLOCK_M=block_m2, BLOCK_N=block_n2, GATHER=gather is not None)
        dq_mask, dq_ms = mask_arg, ms
        dq_bias, dq_bs = bias_arg, bs
        if gather is not None:
            idx, cnt, lst, lhd = gather.idx, gather.cnt, gather.list_strides(), gather.head_div
            dq_mask, dq_ms = gather.gbits, gather.mask_strides(H)
            flags.update(USE_LIST=True)
            if gather.gbias is not None:
                dq_bias, dq_bs = gather.gbias, gather.bias_strides(H)
                flags.update(BIAS_PAD=True, BIAS_GATHERED=True)
        elif use_list:
            idx, cnt = tiles_q.fwd_idx, tiles_q.fwd_cnt
            lst, lhd = tiles_q.fwd_strides(), tiles_q.head_div
        else:
            idx, cnt, lst, lhd = q, q, (0, 0, 0, 0, 0, 0), 1
        args = (
            q, k, v, dout, lse, delta, dq, dq_mask, dq_bias, idx, cnt, q, q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            *dq_ms, *dq_bs, *lst, lhd,
            H, G, Lq, Lk, cdiv(Lk, block_n2), 0,
            *scal,
        )
        grid = (cdiv(Lq, block_m2), B * H)
        _launch_dq(grid, args, dict(flags, VARLEN=False))

    return dq, dk, dv, dbias


def _launch_dkdv(grid, args, meta) -> None:
    launch_tuned(_attn_bwd_dkdv_kernel, _dkdv_tuned, grid, args, meta)


def _launch_dq(grid, args, meta) -> None:
    launch_tuned(_attn_bwd_dq_kernel, _dq_tuned, grid, args, meta)


def attention_backward_varlen(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    bias_needs_grad: bool,
    needs_dq: bool = True,
    needs_dkv: bool = True,
    dropout_p: float = 0.0,
    dropout_rng: Optional[torch.Tensor] = None,
):
    """Attention backward over packed sequences (the inverse of ``attention_forward_varlen``).

    Args:
        dout, out, q: ``(total_q, H, D)``; k, v: ``(total_k, Hkv, D)``; lse ``(H, total_q)``
            fp32 from :func:`~.forward_varlen.attention_forward_varlen`; cu_seqlens / max_seqlen /
            mask / bias / scale / causal / softcap exactly as given to the forward.
        bias_needs_grad: compute dbias (requires ``bias``). needs_dq / needs_dkv: skip work
            for gradients nobody wants. dropout_p / dropout_rng: the forward's dropout.

    Every gradient element has exactly one writing program (a key belongs to one sequence and
    the dK/dV program of its (key tile, sequence, kv head) reduces the GQA group in registers),
    so there are no atomics and the result is always bitwise reproducible.

    Returns:
        ``(dq, dk, dv, dbias)``; dq/dk/dv in q/k/v's dtype (None when not requested; rows past
        ``cu_seqlens[-1]`` are 0), dbias of the bias's ``(1|Hkv|H, total_k)`` shape and dtype.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    lse = lse.contiguous()
    total_q, H, D = q.shape
    total_k, Hkv = k.shape[0], k.shape[1]
    G = H // Hkv
    n_seqs = cu_seqlens_q.numel() - 1
    device = q.device
    want_db = bool(bias_needs_grad) and bias is not None

    dq = alloc_output(q.shape, q.dtype, device) if needs_dq else None
    dk = alloc_output(k.shape, k.dtype, device) if needs_dkv else None
    dv = alloc_output(v.shape, v.dtype, device) if needs_dkv else None
    if n_seqs <= 0 or H * total_q * total_k == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        for t in (dq, dk, dv):
            if t is not None:
                t.zero_()
        return dq, dk, dv, (torch.zeros_like(bias) if want_db else None)

    (block_m, block_n), (block_m2, block_n2) = bwd_blocks(D)
    bd = head_block(D)
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)

    # delta = rowsum(dout * out) in lse's (H, total_q) layout: the packed rows are batch 1.
    delta = torch.empty((H, total_q), dtype=torch.float32, device=device)
    pre_bm = 16 if interpret_mode() else 64
    _bwd_preprocess[(cdiv(total_q, pre_bm), H)](
        out, dout, delta,
        0, out.stride(0), out.stride(1),
        0, dout.stride(0), dout.stride(1),
        H, total_q, HEAD_DIM=D, BLOCK_D=bd, BLOCK_M=pre_bm,
    )

    mask4, bias4 = varlen_aux_4d(mask), varlen_aux_4d(bias)
    mask_arg = mask4.view(torch.uint8) if mask4 is not None else q
    bias_arg = bias4 if bias4 is not None else q
    ms = broadcast_strides(mask4, H)
    bs = broadcast_strides(bias4, H)
    # Live key-tile lists of a per-key mask, per key-tile size (dK/dV and dQ may differ),
    # built when a kernel that walks them runs.
    lists = {}

    def list_args(bn):
        if bn not in lists:
            lists[bn] = varlen_list_args(mask, cu_k, max_seqlen_k, H, bn, q)
        return lists[bn]

    has_softcap = softcap > 0.0
    drop_args, dropout = dropout_args(dropout_p, dropout_rng, q)
    scal = (softmax_scale, softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0,
            softcap, seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_k), *drop_args)
    flags = dict(
        HEAD_DIM=D, BLOCK_D=bd, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, MASK_QB=True, MASK_KB=False,
        HAS_BIAS=bias is not None, BIAS_QB=True, BIAS_KB=False,
        IS_CAUSAL=bool(is_causal), USE_LIST=mask is not None, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), VARLEN=True, DROPOUT=dropout,
    )

    dbias = None
    if needs_dkv or want_db:
        if want_db:
            # Per-key dbias summed over each key's queries in-kernel (mode QRED). The target has
            # one row per query head, or per kv head with the group reduced in registers; a
            # single shared row is summed from the per-kv-head rows afterwards. Zero-filled so
            # keys no sequence owns read 0.
            hx = bias.shape[0]
            th = H if hx == H else Hkv
            target = torch.zeros((th, total_k), dtype=torch.float32, device=device)
            ts = _target_strides(target[None, :, None, :], H)
            db_mode, db_group = _DB_QRED, th != H
        else:
            # Never pass a real input here: the autotuner zeroes DB between trials.
            target = torch.empty(1, dtype=torch.float32, device=device)
            ts = (0, 0, 0, 0, 1)
            db_mode, db_group = _DB_NONE, False
        dk_arg = dk if needs_dkv else q
        dv_arg = dv if needs_dkv else q
        idx, cnt, lst = list_args(block_n)
        args = (
            q, k, v, dout, lse, delta, dk_arg, dv_arg, mask_arg, bias_arg, target, idx, cnt,
            cu_q, cu_k,
            0, q.stride(0), q.stride(1),
            0, k.stride(0), k.stride(1),
            0, v.stride(0), v.stride(1),
            0, dout.stride(0), dout.stride(1),
            0, dk_arg.stride(0), dk_arg.stride(1),
            0, dv_arg.stride(0), dv_arg.stride(1),
            *ms, *bs, *ts, *lst,
            H, G, max_seqlen_q, max_seqlen_k, 0, lse.stride(0),
            1, 1, Hkv,
            *scal,
        )
        meta = dict(flags, STORE_DKV=needs_dkv, DB_MODE=db_mode, DB_ACC=_ACC_STORE,
                    DB_GROUP=db_group)
        _launch_dkdv((cdiv(max_seqlen_k, block_n), n_seqs * Hkv), args, meta)
        if needs_dkv:
            tail_k = varlen_tail_rows(cu_k, total_k)[:, None, None]
            dk.masked_fill_(tail_k, 0.0)
            dv.masked_fill_(tail_k, 0.0)
        if want_db:
            if bias.shape[0] == 1 and target.shape[0] > 1:
                target = target.sum(0, keepdim=True)
            dbias = target.to(bias.dtype)

    if needs_dq:
        idx, cnt, lst = list_args(block_n2)
        args = (
            q, k, v, dout, lse, delta, dq, mask_arg, bias_arg, idx, cnt, cu_q, cu_k,
            0, q.stride(0), q.stride(1),
            0, k.stride(0), k.stride(1),
            0, v.stride(0), v.stride(1),
            0, dout.stride(0), dout.stride(1),
            0, dq.stride(0), dq.stride(1),
            *ms, *bs, *lst,
            H, G, max_seqlen_q, max_seqlen_k, cdiv(max_seqlen_k, block_n2), lse.stride(0),
            *scal,
        )
        meta = dict(flags, BLOCK_M=block_m2, BLOCK_N=block_n2, GATHER=False)
        _launch_dq((cdiv(max_seqlen_q, block_m2), n_seqs * H), args, meta)
        dq.masked_fill_(varlen_tail_rows(cu_q, total_q)[:, None, None], 0.0)

    return dq, dk, dv, dbias
