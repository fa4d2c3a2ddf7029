"""Fused Triton forward kernel: masked / biased / soft-capped attention with tile skipping.

One program computes one query tile of one (batch, query head) and walks only the key tiles that
the tile lists mark live (see :mod:`.tiles`); full tiles skip every per-element mask. The softmax
is online in fp32 in the log2 domain (scores are pre-multiplied by log2(e) so the inner loop
uses exp2).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .gather import plan_key_gather
from .tiles import TileLists, build_tile_lists

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tests flip this to fill kernel-written outputs with NaN first, so unwritten elements show.
DEBUG_POISON = False


def interpret_mode() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def alloc_output(shape, dtype, device) -> torch.Tensor:
    """``torch.empty`` that the kernels must fully overwrite (NaN-poisoned in debug mode)."""
    if DEBUG_POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot fp32 copies (bf16 under the interpreter)."""
    return interpret_mode() and dtype == torch.bfloat16


def head_block(head_dim: int) -> int:
    """Padded head dim: next power of two, at least 16 (tl.dot's minimum K)."""
    return max(16, triton.next_power_of_2(head_dim))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def seqlen_bucket(n: int) -> int:
    """Autotune key bucket: sequence lengths within a power of two share tuned configs."""
    return triton.next_power_of_2(max(n, 1))


def broadcast_strides(t: Optional[torch.Tensor], num_heads: int):
    """(stride_b, stride_h, stride_q, stride_k, head_div) for a 4-D mask/bias view.

    Size-1 dims get stride 0 so the kernels can index them with the full program index; the
    head index is ``h // head_div`` which maps query heads to 1, Hkv or H mask heads.
    """
    if t is None:
        return 0, 0, 0, 0, 1
    st = [0 if t.size(d) == 1 else t.stride(d) for d in range(4)]
    return st[0], st[1], st[2], st[3], num_heads // t.size(1)


# ------------------------------------------------------------------------------------------
# Shared jit helpers (the backward kernels import these)
# ------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The CPU interpreter's tl.dot mishandles bfloat16 operands; it gets them as fp32 (exact).
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # fp32 inputs (testing only) must not silently drop to tf32 on the GPU.
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _tanh(x):
    # tanh via exp2: saturates cleanly to +-1 for large |x| (exp2 -> inf or 0), no NaN.
    e = tl.exp2(x * 2.8853900817779268)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _load_bcast(base, offs_r, offs_c, stride_r, stride_c, lim_r, lim_c,
                R_BCAST: tl.constexpr, C_BCAST: tl.constexpr, other):
    """Load a 2-D tile of a broadcastable mask/bias; a broadcast dim loads as size 1."""
    if R_BCAST:
        r = tl.zeros([1, 1], dtype=tl.int32)
        r_ok = r == 0
    else:
        r = offs_r[:, None]
        r_ok = r < lim_r
    if C_BCAST:
        c = tl.zeros([1, 1], dtype=tl.int32)
        c_ok = c == 0
    else:
        c = offs_c[None, :]
        c_ok = c < lim_c
    return tl.load(base + r * stride_r + c * stride_c, mask=r_ok & c_ok, other=other)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, Bias, ListIdx, ListCnt,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_mb, stride_mh, stride_mm, stride_mn, mask_hdiv,
    stride_bb, stride_bh, stride_bm, stride_bn, bias_hdiv,
    stride_lb, stride_lh, stride_lm, stride_cb, stride_ch, stride_cm, list_hdiv,
    num_heads, group, seqlen_q, seqlen_k, n_k_tiles,
    qk_scale, cap_scale, softcap,
    lq_bucket, lk_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_QB: tl.constexpr, BIAS_KB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_LIST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, GATHER: tl.constexpr,
):
    # GATHER: ListIdx/ListCnt are a KeyGather's idx/cnt (key indices, not tile entries) and
    # Mask is its gathered mask, addressed by position in the list (see .gather).
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        # Bottom query tiles see the most keys: launch them first to shorten the tail.
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    b64 = b.to(tl.int64)

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

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if USE_LIST:
        lh = h // list_hdiv
        list_row = ListIdx + b * stride_lb + lh * stride_lh + pid_m * stride_lm
        n_iter = tl.load(ListCnt + b * stride_cb + lh * stride_ch + pid_m * stride_cm)
    else:
        list_row = ListIdx
        n_iter = n_k_tiles
    n_keys = n_iter
    if GATHER:
        n_iter = tl.cdiv(n_keys, BLOCK_N)

    for t in range(0, n_iter):
        if GATHER:
            mask_cols = t * BLOCK_N + offs_n0
            n_ok = mask_cols < n_keys
            offs_n = tl.load(list_row + mask_cols, mask=n_ok, other=0)
            mask_lim = n_keys
            need_elem = True
        else:
            if USE_LIST:
                entry = tl.load(list_row + t)
                start_n = (entry >> 1) * BLOCK_N
                need_elem = ((entry & 1) != 0) | (start_n + BLOCK_N > seqlen_k)
            else:
                start_n = t * BLOCK_N
                need_elem = start_n + BLOCK_N > seqlen_k
            offs_n = start_n + offs_n0
            n_ok = offs_n < seqlen_k
            mask_cols = offs_n
            mask_lim = seqlen_k

        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, kt, DOT_UPCAST)
        if HAS_SOFTCAP:
            s = (softcap * 1.4426950408889634) * _tanh(s * cap_scale)
        else:
            s = s * qk_scale
        if HAS_BIAS:
            bv = _load_bcast(bias_base, offs_m, offs_n, stride_bm, stride_bn, seqlen_q, seqlen_k,
                             BIAS_QB, BIAS_KB, 0.0)
            s = s + bv.to(tl.float32) * 1.4426950408889634
        if need_elem:
            vis = n_ok[None, :]
            if HAS_MASK:
                mv = _load_bcast(mask_base, offs_m, mask_cols, stride_mm, stride_mn, seqlen_q, mask_lim,
                                 MASK_QB, MASK_KB, 0)
                vis = vis & (mv != 0)
            if IS_CAUSAL:
                vis = vis & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
            s = tl.where(vis, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST)
        m_i = m_new

    has_any = l_i > 0.0
    l_use = tl.where(has_any, l_i, 1.0)
    out = acc / l_use[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))
    o_ptrs = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(Lse + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=m_ok)


# ------------------------------------------------------------------------------------------
# Launch configuration
# ------------------------------------------------------------------------------------------

_FWD_KEY = ["HEAD_DIM", "IS_CAUSAL", "HAS_MASK", "HAS_BIAS", "HAS_SOFTCAP", "USE_LIST",
            "GATHER", "lq_bucket", "lk_bucket"]


def fwd_blocks(head_dim: int) -> Tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the forward kernel; the tile lists are built for this shape.

    Block sizes are fixed per head dim (not autotuned) because the live-tile lists depend on
    them; autotuning covers num_warps / num_stages. Chosen from sm_90 register/smem reports of
    ahead-of-time compiles (no spills at 8 warps with mask + bias + softcap enabled).
    """
    if interpret_mode():
        return 16, 16
    if head_block(head_dim) <= 128:
        return 128, 64
    return 64, 64


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
        if bd >= 128 and c.num_stages > 3:
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
    tiles: Optional[TileLists] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward.

    Args:
        q: ``(B, Lq, H, D)``; k, v: ``(B, Lk, Hkv, D)``, fp16/bf16 (fp32 accepted). Last dim
            contiguous (made so otherwise); other strides arbitrary.
        mask: None or bool ``(Bx, Hx, Qx, Kx)`` view (broadcast dims of size 1), True = attend.
        bias: None or float ``(Bx, Hx, Qx, Kx)`` view (q's dtype or fp32), added after softcap.
        softmax_scale: multiplies q.k (0.0 allowed). is_causal: bottom-right aligned causal.
        softcap: 0.0 = off, else ``softcap * tanh(s / softcap)``.
        tiles: optional prebuilt forward tile lists for :func:`fwd_blocks` (built if None).

    Returns:
        ``out`` ``(B, Lq, H, D)`` in q's dtype (contiguous) and ``lse`` ``(B, H, Lq)`` fp32
        (natural log; -inf and zero output for rows with no visible key).
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
        return out, lse

    block_m, block_n = fwd_blocks(D)
    gather = None
    if tiles is None:
        gather = plan_key_gather(mask, bias, Lq, Lk, H, is_causal, block_m, block_n)
        if gather is None:
            tiles = build_tile_lists(mask, Lq, Lk, H, is_causal, block_m, block_n, device,
                                     need_fwd=True, need_bwd=False)
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

    if gather is not None:
        mask_arg, ms = gather.gmask, gather.mask_strides(H)
    else:
        mask_arg = mask.view(torch.uint8) if mask is not None else q
        ms = broadcast_strides(mask, H)
    bias_arg = bias if bias is not None else q
    bs = broadcast_strides(bias, H)
    n_k_tiles = triton.cdiv(Lk, block_n)
    grid = (triton.cdiv(Lq, block_m), B * H)
    has_softcap = softcap > 0.0
    args = (
        q, k, v, out, lse, mask_arg, bias_arg, idx, cnt,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *ms, *bs, *lst, list_hdiv,
        H, H // Hkv, Lq, Lk, n_k_tiles,
        softmax_scale * LOG2E, (softmax_scale / softcap) if has_softcap else 0.0, softcap,
        seqlen_bucket(Lq), seqlen_bucket(Lk),
    )
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        MASK_QB=mask is not None and mask.size(2) == 1,
        MASK_KB=mask is not None and mask.size(3) == 1,
        HAS_BIAS=bias is not None,
        BIAS_QB=bias is not None and bias.size(2) == 1,
        BIAS_KB=bias is not None and bias.size(3) == 1,
        IS_CAUSAL=bool(is_causal), USE_LIST=use_list, HAS_SOFTCAP=has_softcap,
        DOT_UPCAST=dot_upcast(q.dtype), GATHER=gather is not None,
    )
    if interpret_mode():
        _attn_fwd_kernel[grid](*args, **meta, num_warps=4, num_stages=1)
    else:
        _attn_fwd_tuned[grid](*args, **meta)
    return out, lse
