"""The Triton backward's host side: launch configurations, the dbias target of each bias
shape, and the launches of the kernels of :mod:`.backward_kernel` for dense batches
(:func:`attention_backward`) and packed sequences (:func:`attention_backward_varlen`). The
kernels, the dbias modes and the packed-sequence walks are described there.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ...planning.rows import aligned_rows
from .common import (
    LOG2E,
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
from .dropout_mask import dropout_args
from .varlen import varlen_aux_4d, varlen_list_args, varlen_tail_rows
from ...intmath import cdiv
from ...planning.gather import gather_policy
from ...planning.plan import BackwardPlan, plan_backward
from .backward_kernel import (
    _ACC_ATOMIC,
    _ACC_RMW,
    _ACC_STORE,
    _DB_KRED,
    _DB_NONE,
    _DB_QRED,
    _DB_SCALAR,
    _DB_TILE,
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _bwd_preprocess,
)

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
