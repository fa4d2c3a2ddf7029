"""Split-KV decode over selected keys: a step reads only the K/V rows of the keys it selected.

A decoding step of Dynamic Mask Attention keeps the ``W`` best keys of a long cache. The dense
decode kernel (:mod:`.decode`) walks every key tile of the cache, reading the per-key mask and
bias of all ``Lk`` keys to find the ``W`` it must load. This kernel instead walks a list of key
positions, ``index (B|1, Hkv|1, W)`` (one list per batch and kv head; entries ``< 0`` are empty
slots): each key tile loads ``BLOCK_N`` positions, then those keys' K/V rows (by index, like
the decode kernel's paged mode with one page id per key) and their bias, so a step reads
``O(W)`` K/V rows, bias values and index entries, whatever ``Lk``.

Everything else is the decode kernel's: the ``G = H / Hkv`` query heads of a group and the
``Lq`` queries share each K/V tile (one program per key split, batch and kv head), splits write
fp32 partials that :func:`.decode._decode_combine_kernel` merges, ``cache_seqlens`` hides the
positions at or past a batch's used length, and causality compares a key's *position* (not its
slot) with the query's. With ``BIAS_VIS`` a slot is also empty where its bias is not finite or
not above ``bias_floor``: a transformers additive mask's masked entries (dtype-min), so that a
model's additive mask can be read as the bias without building a bool mask first.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...intmath import cdiv
from ...planning.decode import DECODE_MAX_ROWS, MAX_SPLITS, sm_count
from .common import LOG2E, _dot, _tanh, broadcast_strides, interpret_mode, last_dim_contiguous
from .decode import (
    DecodePlan,
    _group_rows,
    _store_split,
    empty_outputs,
    launch_split_decode,
    row_invariant,
    split_meta,
    split_plan,
)

# At least this many slots per split: a selection of a few hundred keys per (batch, kv head)
# runs as one split, with no combine launch (a decode step is bound by launches, not bytes, at
# that size). Longer selections split like the dense decode kernel's key range.
MIN_SLOTS_PER_SPLIT = 256


@triton.jit
def _selected_split_kernel(
    Q, K, V, Bias, Index, CacheSeqlens, OPart, LPart,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_ib, stride_ih,
    batch, num_heads, group, seqlen_q, seqlen_k, num_slots, slots_per_split,
    qk_scale, cap_scale, softcap, bias_floor,
    stride_ob, stride_om, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_ROWB: tl.constexpr, BIAS_VIS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CACHE: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
):
    # One program: slot split pid_s of (batch b, kv head hk), for every query head of the group
    # and every query (row r: query head hk*group + r // seqlen_q, query r % seqlen_q), as in
    # the dense decode kernel. BIAS_ROWB: one bias value per key for every row of the tile.
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)

    row_ok, qi, h, offs_d, d_ok, q = _group_rows(Q, b64, hk, group, seqlen_q, stride_qb,
                                                 stride_qm, stride_qh, HEAD_DIM, BLOCK_D, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    if HAS_CACHE:
        # Clamped: values are not checked on the GPU (that would sync), memory stays safe.
        kv_len = tl.minimum(tl.maximum(tl.load(CacheSeqlens + b), 0), seqlen_k)
    else:
        kv_len = seqlen_k
    start = pid_s * slots_per_split
    end = tl.minimum(start + slots_per_split, num_slots)

    idx_base = Index + b64 * stride_ib + hk64 * stride_ih
    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    if BIAS_ROWB:
        bias_base = Bias + b64 * stride_bb + ((hk * group) // bias_hdiv).to(tl.int64) * stride_bh
    else:
        bias_base = (Bias + b64 * stride_bb + (h // bias_hdiv).to(tl.int64)[:, None] * stride_bh
                     + qi.to(tl.int64)[:, None] * stride_bm)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n0
        in_range = offs < end
        pos = tl.load(idx_base + offs, mask=in_range, other=-1).to(tl.int64)
        # A slot holds a key when its position is one of the batch's used keys; empty slots
        # read position 0 (a valid address) and are hidden.
        key_ok = in_range & (pos >= 0) & (pos < kv_len)
        pos = tl.where(key_ok, pos, 0)
        if HAS_BIAS:
            if BIAS_ROWB:
                bv = tl.load(bias_base + pos * stride_bn, mask=key_ok, other=0.0).to(tl.float32)
                if BIAS_VIS:
                    key_ok = key_ok & (bv > bias_floor) & (bv < float("inf"))
                badd = (bv * 1.4426950408889634)[None, :]
            else:
                bv = tl.load(bias_base + pos[None, :] * stride_bn,
                             mask=row_ok[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
                badd = bv * 1.4426950408889634
        vis = key_ok[None, :]
        if HAS_BIAS:
            if BIAS_VIS:
                if not BIAS_ROWB:
                    vis = vis & (bv > bias_floor) & (bv < float("inf"))
        if IS_CAUSAL:
            vis = vis & (pos[None, :] <= qi[:, None] + (kv_len - seqlen_q))
        # The keys some row sees: K/V rows of the others are never loaded. With a bias per
        # row that hides keys, reduce over the real rows; otherwise every such key is seen by
        # the last query row (a real one), which causality lets see every used key.
        key_live = key_ok
        if HAS_BIAS:
            if BIAS_VIS:
                if not BIAS_ROWB:
                    key_live = tl.max((vis & row_ok[:, None]).to(tl.int32), 0) > 0

        kt = tl.load(k_base + pos[None, :] * stride_kn + offs_d[:, None],
                     mask=key_live[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, kt, DOT_UPCAST)
        if HAS_SOFTCAP:
            s = (softcap * 1.4426950408889634) * _tanh(s * cap_scale)
        else:
            s = s * qk_scale
        if HAS_BIAS:
            s = s + badd
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; subtracting 0 avoids inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + pos[:, None] * stride_vn + offs_d[None, :],
                     mask=key_live[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, DOT_UPCAST)
        m_i = m_new

    # The dense decode kernel's outputs: its partial layout, or the output with one split.
    _store_split(acc, m_i, l_i, OPart, LPart, pid_s, b, batch, num_heads, seqlen_q, row_ok, qi,
                 h, offs_d, d_ok, stride_ob, stride_om, stride_oh, HEAD_DIM, SINGLE_SPLIT)


def selected_num_splits(batch: int, num_kv_heads: int, num_slots: int,
                        device: torch.device) -> int:
    """Slot splits per (batch, kv head): as many as fill four programs per SM, at most
    ``MAX_SPLITS``, and at least :data:`MIN_SLOTS_PER_SPLIT` slots each (so a few hundred
    selected keys run as one split and need no combine). Under the interpreter: a few, so
    the combine is exercised."""
    if num_slots <= 0:
        return 1
    if device.type != "cuda":
        return max(1, min(3, cdiv(num_slots, 16)))
    want = max(1, (4 * sm_count(device)) // max(1, batch * num_kv_heads))
    return max(1, min(want, MAX_SPLITS, cdiv(num_slots, MIN_SLOTS_PER_SPLIT)))


@functools.lru_cache(maxsize=256)
def _launch_plan(device: torch.device, dtype: torch.dtype, head_dim: int, rows: int,
                 batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int, num_slots: int,
                 num_splits: Optional[int], interp: bool, has_bias: bool, bias_rowb: bool,
                 bias_vis: bool, is_causal: bool, has_softcap: bool, has_cache: bool
                 ) -> DecodePlan:
    """Everything a launch needs that depends only on the shapes and flags (shared by every
    layer of a decoding step and by every step of the same length): the split kernel's
    tiles, warps and flags (bias, its row invariance and visibility test, causality, soft
    cap, KV cache), the split count and the combine's configuration."""
    # The decode kernel's tile and warps, without its register cap: capped at 128, this kernel
    # spilled (88 bytes with a per-key additive-mask bias, 344 with a per-query-head bias on
    # sm_90; tools/compile_check.py --workload decode-selected), and a selection of a few
    # hundred keys runs one split per (batch, kv head), far from four per SM.
    meta = split_meta(dtype, head_dim, rows, interp, cap_registers=False)
    meta.update(HAS_BIAS=has_bias, BIAS_ROWB=bias_rowb, BIAS_VIS=bias_vis, IS_CAUSAL=is_causal,
                HAS_SOFTCAP=has_softcap, HAS_CACHE=has_cache)
    if num_splits is None:
        num_splits = selected_num_splits(batch, num_kv_heads, num_slots, device)
    return split_plan(meta, device, num_slots, num_splits, meta["BLOCK_N"],
                      batch * num_heads * seqlen_q)


def selected_decode_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    bias: Optional[torch.Tensor],
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    cache_seqlens: Optional[torch.Tensor] = None,
    bias_floor: Optional[float] = None,
    num_splits: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of few queries over the keys listed in ``index`` (forward only).

    Args:
        q: ``(B, Lq, H, D)``; k, v: ``(B, Lk, Hkv, D)`` (a KV cache of capacity ``Lk``), last
            dims contiguous, any other strides; ``Lq * H / Hkv <= DECODE_MAX_ROWS``.
        index: int32 / int64 ``(Bi, Hi, W)`` with ``Bi in {1, B}``, ``Hi in {1, Hkv}``: the key
            positions of each (batch, kv head); entries ``< 0`` or ``>= Lk`` are empty slots.
            The positions of one list must be distinct.
        bias: None or a 4-D view ``(Bx, Hx, Qx, Lk)`` broadcastable to ``(B, H, Lq, Lk)`` (head
            dim ``1``, ``Hkv`` or ``H``), read at the listed positions only.
        softmax_scale / is_causal / softcap / cache_seqlens: as :func:`.decode.decode_forward`;
            causality and the used length apply to a slot's position.
        bias_floor: None, or a float: slots whose bias is not finite or ``<= bias_floor`` are
            empty too (an additive mask's masked entries; needs ``bias``).
        num_splits: slot splits per (batch, kv head); default :func:`selected_num_splits`.

    Returns ``out (B, Lq, H, D)`` in q's dtype and ``lse (B, H, Lq)`` fp32. Equivalent to the
    dense decode kernel with ``mask[b, h, :, j] = j in index[b, kv(h)]`` (and, with
    ``bias_floor``, ``isfinite(bias) & (bias > bias_floor)`` at those keys).
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if index.stride(-1) != 1:
        index = index.contiguous()
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    W = index.shape[-1]
    G = H // Hkv
    rows = G * Lq
    if rows > DECODE_MAX_ROWS:
        raise ValueError(f"selected decode takes Lq * H / Hkv <= {DECODE_MAX_ROWS} rows, got {rows}")
    if B * H * Lq == 0 or W == 0 or Lk == 0:
        return empty_outputs(q)
    has_softcap = softcap > 0.0
    has_bias = bias is not None
    plan = _launch_plan(q.device, q.dtype, D, rows, B, H, Hkv, Lq, W, num_splits,
                        interpret_mode(), has_bias, row_invariant(bias, Lq, H, G),
                        has_bias and bias_floor is not None, bool(is_causal) and Lq > 1,
                        has_softcap, cache_seqlens is not None)
    ixs = index.stride()
    return launch_split_decode(
        _selected_split_kernel, plan, q, k, v,
        (bias if has_bias else q, index, cache_seqlens if cache_seqlens is not None else q),
        (*broadcast_strides(bias, H),
         ixs[0] if index.shape[0] > 1 else 0, ixs[1] if index.shape[1] > 1 else 0,
         B, H, G, Lq, Lk, W, plan.keys_per_split,
         softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
         float(bias_floor) if bias_floor is not None else 0.0),
        plan.split_meta,
    )
