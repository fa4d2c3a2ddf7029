"""The fused Triton forward kernel: masked / biased / soft-capped attention with tile skipping,
its autotuning configurations and its launch.

One program computes one query tile of one (batch, query head) and walks only the key tiles that
the tile lists mark live (see :mod:`flash_dmattn.planning.tiles`); full tiles skip every
per-element mask. The softmax is online in fp32 in the log2 domain (scores are pre-multiplied
by log2(e) so the inner loop uses exp2). With ``GATHER`` it walks a query tile's gathered keys
(:mod:`flash_dmattn.planning.gather`) instead of key tiles.

With ``VARLEN`` the same kernel runs packed sequences: the packed ``(total, H, D)`` tensors are
batch 1, the batch grid index is the sequence index, and each program moves its pointers to
its sequence's first query / key row read from ``cu_seqlens``; query tiles past the
sequence's length do nothing. A per-key mask gets per-(sequence, mask head) lists of live key
tiles (:class:`~flash_dmattn.planning.tiles.VarlenKeyLists`), which the program walks up to its
causal limit: dead key tiles cost nothing, full ones skip the mask.

The host sides that assemble the kernel's arguments are :mod:`.forward` (dense calls) and
:mod:`.forward_varlen` (packed sequences); both launch through :func:`launch_fwd` and
:func:`launch_fwd_untuned`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, launch_tuned
from .dropout_mask import _dropout_keep_tile, _dropout_seed
from .scores import _gathered_row_bits, _key_bounds, _key_tile, _scores
from .varlen import _query_tile_keys, _varlen_list_need_elem, _varlen_seq


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
        # Gathered keys or a key tile alike: one Philox evaluation per 16 rows of a key.
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

    list_off, n_iter = _query_tile_keys(ListIdx, ListCnt, b, h, pid_m, list_hdiv, stride_lb,
                                        stride_lh, stride_lm, stride_cb, stride_ch, stride_cm,
                                        n_k_tiles, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                        IS_CAUSAL, USE_LIST, VARLEN)
    list_row = ListIdx + list_off
    bits_row = MaskBits + list_off

    mask_klim, bias_klim = _key_bounds(stride_mm, stride_bm, seqlen_k, MASK_PAD, BIAS_PAD)
    if USE_LIST and not GATHER:
        # One loop, the tile's partial flag deciding per-element masking at run time. Two
        # loops (full tiles, then partial ones; the lists are ordered for it) measured clearly
        # slower on the dense and the dynamic workloads. Each loop fills and drains its own
        # pipeline and the second one's buffers cost up to 40 KB more shared memory
        # (tools/compile_check.py); which of these costs more is not established.
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


def launch_fwd(grid, args, meta) -> None:
    """The forward kernel on ``grid`` with positional ``args`` and constexpr ``meta``,
    autotuned (see :func:`.common.launch_tuned`)."""
    launch_tuned(_attn_fwd_kernel, _attn_fwd_tuned, grid, args, meta)


def launch_fwd_untuned(grid, args, meta) -> None:
    """:func:`launch_fwd` without autotuning: the first (pruned) configuration that fits."""
    launch_tuned(_attn_fwd_kernel, _attn_fwd_tuned, grid, args, meta, autotune=False)
