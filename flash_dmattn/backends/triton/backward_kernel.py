"""Triton backward kernels (FlashAttention-2 style) with tile skipping and bias gradients;
:mod:`.backward` plans and launches them.

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

import triton
import triton.language as tl

from .common import _dot, _tanh
from .dropout_mask import _dropout_keep_tile, _dropout_keep_tile_t, _dropout_seed
from .scores import (
    _gathered_row_bits,
    _key_bounds,
    _key_tile,
    _load_bcast,
    _load_mask_tile,
    _scores,
)
from .varlen import (
    _query_tile_keys,
    _varlen_list_need_elem,
    _varlen_need_elem,
    _varlen_seq,
    _varlen_tile_state,
)

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

    list_off, n_iter = _query_tile_keys(ListIdx, ListCnt, b, h, pid_m, list_hdiv, stride_lb,
                                        stride_lh, stride_lm, stride_cb, stride_ch, stride_cm,
                                        n_k_tiles, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                        IS_CAUSAL, USE_LIST, VARLEN)
    list_row = ListIdx + list_off
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
