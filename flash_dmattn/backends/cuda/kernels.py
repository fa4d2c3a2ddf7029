"""Host side of the ``cuda`` backend: pick the compiled specialisation, build live-tile lists
(or, for a per-query mask whose query tiles share few keys, gathered key lists), call the
extension's ``fwd`` / ``fwd_gathered`` / ``bwd``, and reduce per-key dbias partials to the
bias's shape.

The live-tile lists are the ones the Triton kernels use (:mod:`flash_dmattn.planning.tiles`),
built at the
CUDA kernels' own tile sizes (the extension reports them), so dead tiles cost no loads and no
matrix products and full tiles no element checks.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .extension import (NO_DROPOUT, dropout_args, kernel_bias, kernel_module, kernel_modules,
                        reduce_key_partials, vector_ready)
from .spec import DTYPES, HEAD_DIM_BUCKETS

MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


# How cuda_backward produces dbias (dbias_mode): written whole by the dQ kernel, per-key sums
# reduced on the host, zero (a per-query bias constant over the keys), or per group of heads
# (per-query rows shared by several heads or batches, see _shared_bias_backward).
DBIAS_FULL, DBIAS_KEYS, DBIAS_ZERO, DBIAS_SHARED = 1, 2, 3, 4


def dbias_mode(bias: Optional[torch.Tensor], batch: int, heads: int, seqlen_q: int,
               seqlen_k: int) -> int:
    """How the backward produces dbias for ``bias`` (0: no bias): :data:`DBIAS_FULL` for a
    ``(B, H, Lq, Lk)`` bias, :data:`DBIAS_KEYS` for any bias broadcast over queries,
    :data:`DBIAS_ZERO` for a per-query bias broadcast over keys (``(.., Lq, 1)``: it shifts
    each softmax row by a constant, so its gradient is 0), :data:`DBIAS_SHARED` for per-query
    rows shared by several heads or batches."""
    if bias is None:
        return 0
    if tuple(bias.shape) == (batch, heads, seqlen_q, seqlen_k):
        return DBIAS_FULL
    if bias.size(2) == 1:
        return DBIAS_KEYS
    if bias.size(3) == 1 and seqlen_k > 1:
        return DBIAS_ZERO
    return DBIAS_SHARED


def input_reasons(q, k, v, mask, bias, bias_needs_grad: bool) -> List[str]:
    """Why the kernels cannot take these tensors (beyond device and option checks).

    Two things the kernels do not read are made on the host instead: a float32 bias is
    converted to the inputs' dtype (:func:`~.extension.kernel_bias`, its gradient comes back
    in float32) and a head dim that is not a multiple of 8 is zero-padded to one
    (:func:`pad_head_dim`)."""
    reasons = []
    if q.dtype not in DTYPES.values():
        reasons.append(f"dtype {q.dtype} is not supported (float16, bfloat16)")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        reasons.append(f"head_dim {d} > {MAX_HEAD_DIM}")
    if v.shape[-1] != d:
        reasons.append("value head dim differs from the query's")
    if bias is not None and bias.dtype not in (q.dtype, torch.float32):
        reasons.append(f"bias dtype {bias.dtype} is neither q's {q.dtype} nor float32")
    return reasons


# The kernels read rows of q, k, v as 16-byte vectors: head dims are multiples of 8 elements.
HEAD_DIM_ALIGN = 8


def head_dim_padding(head_dim: int) -> int:
    """Zero columns :func:`pad_head_dim` appends to rows of ``head_dim`` elements."""
    return -head_dim % HEAD_DIM_ALIGN


def pad_head_dim(*tensors):
    """``tensors`` (q, k, v, or dout and out) with their head dim zero-padded to a multiple
    of 8 (copies; the tensors as they are when it already is one).

    Exact: zero columns of q and k add nothing to ``q . k``, and zero columns of v give zero
    output columns, which are dropped, as are the padded columns of dq, dk and dv (the
    scale is the call's, computed from the caller's head dim). Costs one padded copy of
    q, k, v (and of dout and out in the backward). Equivalent plain PyTorch::

        t = torch.nn.functional.pad(t, (0, -t.shape[-1] % 8))"""
    pad = head_dim_padding(tensors[0].shape[-1])
    if not pad:
        return tensors
    return tuple(None if t is None else torch.nn.functional.pad(t, (0, pad)) for t in tensors)


def _unpad(t, head_dim: int):
    """``t`` without the columns :func:`pad_head_dim` added (a contiguous copy)."""
    if t is None or t.shape[-1] == head_dim:
        return t
    return t[..., :head_dim].contiguous()


def _wants_summary(mask, seqlen_q, seqlen_k) -> bool:
    """Whether :func:`_summary` classifies ``mask`` (a per-query mask) rather than give None."""
    from ...planning.mask_summary import wants_summary

    return wants_summary(mask, seqlen_q, seqlen_k)


def _summary(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n, key_bits=False):
    """The one-pass classification of a per-query mask (as in the Triton backend), or None;
    ``key_bits``: with the mask's key bits (what the sm_90 dK/dV kernel reads)."""
    from ...planning.mask_summary import KEY_BITS_ROWS, summarize_mask

    if not _wants_summary(mask, seqlen_q, seqlen_k):
        return None
    key_bits = key_bits and block_m % KEY_BITS_ROWS == 0
    return summarize_mask(mask, block_m, block_n, is_causal, key_bits=key_bits)


def _backward_summary_blocks(fwd_mod, bwd_mod) -> Tuple[int, int]:
    """``(row_block, key_block)`` of a summary that serves the forward's and the backward's
    tiles (and key bits, 64 rows a word); ``fwd_mod`` / ``bwd_mod``: the spec's forward and
    backward modules."""
    from ...planning.mask_summary import KEY_BITS_ROWS, summary_blocks

    rows, keys = summary_blocks(tuple(fwd_mod.block_sizes()), tuple(bwd_mod.block_sizes()))
    if bwd_mod.bwd_key_bits():
        rows = math.gcd(rows, KEY_BITS_ROWS)
    return rows, keys


# Private test hook: False keeps key bits out of every summary, so that the paths they
# replace (dK/dV transposing mask tiles, gathered bits from the mask rows) can be compared
# with them on the same inputs.
_KEY_BITS = True


def _wants_key_bits(mod) -> bool:
    """Whether a training step's summary should carry key bits: the backward module's dK/dV
    reads them (instead of transposing each step's mask tile)."""
    return mod.bwd_key_bits() and _KEY_BITS


def _summary_serves(summary, mod) -> bool:
    """Whether a forward's summary answers the backward's tile questions (and carries the
    key bits the backward module ``mod`` reads)."""
    bwd_m, bwd_n = mod.block_sizes()
    if summary is None or bwd_m % summary.row_block or bwd_n % summary.key_block:
        return False
    return summary.key_bits is not None or not _wants_key_bits(mod)


def _lists(mask, seqlen_q, seqlen_k, heads, is_causal, block_m, block_n, device, need_bwd,
           summary=None):
    """Live-tile lists at the kernels' tile sizes (None: no mask, not causal). A per-query mask
    is classified by the one-pass summary kernel, as in the Triton backend, instead of
    several torch reductions over the whole mask."""
    from ...planning.tiles import build_tile_lists

    if summary is None:
        summary = _summary(mask, seqlen_q, seqlen_k, is_causal, block_m, block_n)
    return build_tile_lists(mask, seqlen_q, seqlen_k, heads, is_causal, block_m, block_n, device,
                            need_fwd=True, need_bwd=need_bwd, summary=summary)


def _gather_plan(mod, mask, bias, seqlen_q, seqlen_k, heads, is_causal, block_m, block_n,
                 summary):
    """Gathered key lists for the forward (the union of each query tile's live keys, see
    planning/gather.py), or None (key tiles instead): the forward module ``mod`` must have the
    gathered forward, a bias must be per key (gathered with the keys), and the planner's policy must
    find that gathering saves work (:func:`~flash_dmattn.planning.gather.gather_policy`)."""
    if mask is None or not mod.fwd_gathers():
        return None
    if bias is not None and not (bias.size(2) == 1 and bias.size(3) == seqlen_k):
        return None
    from ...planning.gather import plan_key_gather

    gather = plan_key_gather(mask, bias, seqlen_q, seqlen_k, heads, is_causal, block_m, block_n,
                             summary=summary, lagged=True)
    if gather is None or (bias is not None and gather.gbias is None):
        return None
    return gather


def _read_ready(mask, bias, seqlen_q, seqlen_k):
    """Per-query masks / biases with unaligned rows get zero-padded aligned copies (read only)
    so the kernels can copy their tiles as 16-byte vectors."""
    from ...planning.rows import aligned_rows

    mask, _ = aligned_rows(mask, seqlen_q, seqlen_k)
    bias, _ = aligned_rows(bias, seqlen_q, seqlen_k)
    return mask, bias


class CudaPlan:
    """What a forward worked out for its backward (kept on the autograd node, see
    :class:`...ops._PlannedAttention`): the gathered key lists the forward walked (None when it
    walked key tiles), which the backward's dQ kernel walks too, and the per-query mask's
    summary, at tiles that serve the backward's lists, with the key bits its dK/dV kernel
    reads (None: no per-query mask)."""

    __slots__ = ("gather", "summary")

    def __init__(self, gather=None, summary=None):
        self.gather = gather
        self.summary = summary


def cuda_planned_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                         key_intervals=None, key_window=None, dropout_p=0.0, dropout_rng=None):
    """:func:`cuda_forward` plus its :class:`CudaPlan` (``(out, lse, plan)``); a key-interval
    call's plan is its interval lists (or :class:`~.intervals.DenseEquivalent`)."""
    d = q.shape[-1]
    q, k, v = pad_head_dim(q, k, v)
    out, lse, plan = _planned_forward(q, k, v, mask, kernel_bias(bias, q.dtype), scale,
                                      is_causal, softcap, cache_seqlens, key_intervals,
                                      key_window, dropout_args(dropout_p, dropout_rng))
    return _unpad(out, d), lse, plan


def _planned_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                     key_intervals=None, key_window=None, drop=NO_DROPOUT):
    """:func:`cuda_planned_forward` on what the kernels read (head dim a multiple of 8, the
    bias in q's dtype); ``drop``: the extension's dropout arguments (:func:`dropout_args`)."""
    if key_intervals is not None:
        from .intervals import DenseEquivalent, interval_forward, plan_for

        plan = plan_for(q, k, bias, key_intervals, is_causal, backward=True, window=key_window)
        if not plan[0].hides_nothing:
            return interval_forward(q, k, v, bias, key_intervals, scale, is_causal, softcap, plan,
                                    drop=drop)
        out, lse, dense_plan = _planned_forward(q, k, v, None, bias, scale, is_causal, softcap,
                                                drop=drop)
        return out, lse, DenseEquivalent(dense_plan)
    # The decode kernel has no dropout: calls with dropout and no KV cache run the dense one.
    if drop[0] is None and use_cuda_decode(q.shape[1], q.shape[2], k.shape[2], k.shape[1],
                                           cache_seqlens is not None):
        # Decode shapes gather nothing; a KV cache's backward folds its lengths into the mask.
        out, lse = cuda_decode_forward(q, k, v, mask, bias, scale, is_causal, softcap,
                                       cache_seqlens, None)
        return out, lse, CudaPlan()
    out, lse, gather, summary = _dense_forward(q, k, v, mask, bias, scale, is_causal, softcap,
                                               for_backward=True, drop=drop)
    return out, lse, CudaPlan(gather, summary)


def cuda_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                 block_table=None, key_intervals=None, key_window=None, dropout_p=0.0,
                 dropout_rng=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Lq, H, D), lse (B, H, Lq) fp32)`` through the compiled kernels.

    Few query rows per kv head (decoding), a KV cache's ``cache_seqlens`` or paged K/V
    (``block_table``) run the split-KV decode kernel (:func:`cuda_decode_forward`); a
    key-interval mask (``key_intervals``) the kernels of :mod:`.intervals`, unless it hides
    nothing beyond ``is_causal`` (then the dense kernels run without it). A float32 bias is
    read in q's dtype and a head dim that is not a multiple of 8 zero-padded
    (:func:`input_reasons`). ``dropout_p`` / ``dropout_rng``: attention dropout
    (:mod:`flash_dmattn.dropout`; the sm_90 kernels draw its keep-mask)."""
    d = q.shape[-1]
    q, k, v = pad_head_dim(q, k, v)
    bias = kernel_bias(bias, q.dtype)
    out, lse = _forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens,
                        block_table, key_intervals, key_window,
                        dropout_args(dropout_p, dropout_rng))
    return _unpad(out, d), lse


def _forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens, block_table,
             key_intervals, key_window, drop=NO_DROPOUT):
    if key_intervals is not None:
        from .intervals import interval_forward, plan_for

        plan = plan_for(q, k, bias, key_intervals, is_causal, backward=False, window=key_window)
        if not plan[0].hides_nothing:
            out, lse, _ = interval_forward(q, k, v, bias, key_intervals, scale, is_causal,
                                           softcap, plan, drop=drop)
            return out, lse
        mask = None
    # The decode kernel has no dropout: calls with dropout and no KV cache run the dense one.
    if block_table is not None or (drop[0] is None and use_cuda_decode(
            q.shape[1], q.shape[2], k.shape[2], k.shape[1], cache_seqlens is not None)):
        return cuda_decode_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens,
                                   block_table)
    out, lse, _, _ = _dense_forward(q, k, v, mask, bias, scale, is_causal, softcap, drop=drop)
    return out, lse


def _dense_forward(q, k, v, mask, bias, scale, is_causal, softcap, for_backward=False,
                   drop=NO_DROPOUT):
    """``(out, lse, gather, summary)``: the forward over gathered key lists (``gather``, the
    planner's KeyGather) or over live key tiles (``gather`` None). ``for_backward``: the mask
    summary (None without a per-query mask) is made at tiles the backward can use too, with
    the key bits it reads, so that a training step reads the mask once."""
    q, k, v = vector_ready(q), vector_ready(k), vector_ready(v)
    B, Lq, H, _ = q.shape
    Lk = k.shape[1]
    if for_backward:
        # A training step: its backward's module too (built beside the forward's), whose tiles
        # and key bits the mask summary serves.
        mods = kernel_modules(q, mask is not None, bias is not None, ops=("fwd", "bwd"))
        mod, bwd_mod = mods["fwd"], mods["bwd"]
    else:
        mod = kernel_module(q, mask is not None, bias is not None, op="fwd")
    block_m, block_n = mod.block_sizes()
    mask, bias = _read_ready(mask, bias, Lq, Lk)
    if for_backward:
        # The key bits the dK/dV kernel reads; the gathered forward's bits are then made from
        # them too, faster than from the mask rows.
        rows, keys = _backward_summary_blocks(mod, bwd_mod)
        summary = _summary(mask, Lq, Lk, is_causal, rows, keys,
                           key_bits=_wants_key_bits(bwd_mod))
    else:
        # Key bits only serve the gathered forward's bits here (so only modules that gather
        # write them), and pay: the summary pass writing them costs less than what making the
        # gathered bits from them instead of the mask rows saves (the dynamic suite,
        # benchmarks/results/<gpu>/SUMMARY.md).
        summary = _summary(mask, Lq, Lk, is_causal, block_m, block_n,
                           key_bits=mod.fwd_gathers() and _KEY_BITS)
    gather = _gather_plan(mod, mask, bias, Lq, Lk, H, is_causal, block_m, block_n, summary)
    if gather is not None:
        out, lse = mod.fwd_gathered(q, k, v, None, float(scale), bool(is_causal), float(softcap),
                                    *_gather_args(gather, H), *drop)
        return out, lse, gather, summary
    lists = _lists(mask, Lq, Lk, H, is_causal, block_m, block_n, q.device, need_bwd=False,
                   summary=summary)
    idx = cnt = None
    hdiv = 1
    if lists is not None:
        idx, cnt, hdiv = lists.fwd_idx, lists.fwd_cnt, lists.head_div
    out, lse = mod.fwd(q, k, v, mask, bias, None, float(scale), bool(is_causal), float(softcap),
                       idx, cnt, hdiv, None, None, None, 0, 0, *drop)
    return out, lse, None, summary


class KeyListGather:
    """A per-key mask's live keys as the gathered dQ kernel's lists (no bits): one row of key
    indices per (batch, mask head), shared by every query tile (stride 0), and per tile the
    count of those keys the tile's last row can see; a per-key bias gathered along the same
    indices. Built with a few tensor ops and no host sync. Same fields as the planner's
    KeyGather, with no bits (``gbits`` None)."""

    __slots__ = ("idx", "cnt", "head_div", "gbits", "gbias")

    def __init__(self, idx, cnt, head_div, gbias):
        self.idx, self.cnt, self.head_div = idx, cnt, head_div
        self.gbits = None
        self.gbias = gbias


def key_list_gather(mask, bias, seqlen_q: int, seqlen_k: int, heads: int, is_causal: bool,
                    block_m: int) -> Optional[KeyListGather]:
    """:class:`KeyListGather` for a per-key ``mask`` ``(B|1, Hm, 1, Lk)`` and a bias that is
    None or per key ``(B|1, Hb, 1, Lk)``; None for other shapes."""
    # (Row-aligned copies may be wider than Lk: the keys are the first Lk columns.)
    if mask is None or mask.size(2) != 1 or mask.size(3) < seqlen_k or seqlen_k <= 1:
        return None
    if bias is not None and (bias.size(2) != 1 or bias.size(3) < seqlen_k):
        return None
    dev = mask.device
    m = mask[:, :, 0, :seqlen_k]
    bm, hm = m.shape[0], m.shape[1]
    width = -(-seqlen_k // 64) * 64
    live_upto = m.to(torch.int32).cumsum(-1)  # live keys among 0..j
    # Live key j goes to position live_upto[j] - 1; dead keys to a spare slot past the row
    # (64 of them, so every row stays 16-byte aligned: the kernel copies 4 indices at a time).
    dest = torch.where(m, live_upto - 1, torch.full_like(live_upto, width)).long()
    keys = torch.arange(seqlen_k, device=dev, dtype=torch.int32).expand(bm, hm, seqlen_k)
    row = torch.zeros(bm, hm, width + 64, device=dev, dtype=torch.int32).scatter_(-1, dest, keys)
    row = row[..., :width]
    n_q = -(-seqlen_q // block_m)
    if is_causal:
        # Keys < limit are visible to the tile's last row (bottom-right aligned).
        last_row = torch.clamp(torch.arange(1, n_q + 1, device=dev) * block_m, max=seqlen_q)
        limit = torch.clamp(last_row + (seqlen_k - seqlen_q), 0, seqlen_k)
        below = torch.nn.functional.pad(live_upto, (1, 0))  # live keys among 0..x-1
        cnt = below.gather(-1, limit.expand(bm, hm, n_q))
    else:
        cnt = live_upto[..., -1:].expand(bm, hm, n_q)
    cnt = cnt.to(torch.int32).contiguous()
    idx = row.unsqueeze(2).expand(bm, hm, n_q, width)
    gbias = None
    if bias is not None:
        hb = bias.shape[1]
        hx = hm * hb // math.gcd(hm, hb)  # heads fine enough for both (divides `heads`)
        bx = max(bm, bias.shape[0])
        idx_x = row.repeat_interleave(hx // hm, dim=1).expand(bx, hx, width).long()
        bias_x = bias[:, :, 0, :seqlen_k].repeat_interleave(hx // hb, dim=1)
        bias_x = bias_x.expand(bx, hx, seqlen_k)
        gbias = bias_x.gather(-1, idx_x).unsqueeze(2).expand(bx, hx, n_q, width)
    return KeyListGather(idx, cnt, heads // hm, gbias)


def _gather_args(gather, heads: int) -> tuple:
    """The extension's gathered-list arguments ``(idx, cnt, hdiv, bits, bits_hdiv, gbias,
    gbias_hdiv)`` of a KeyGather or KeyListGather (bits None)."""
    gbias = gather.gbias
    return (gather.idx, gather.cnt, gather.head_div, gather.gbits, gather.head_div, gbias,
            heads // gbias.size(1) if gbias is not None else 1)


# ---------------------------------------------------------------------------------------------
# Decoding (split-KV)
# ---------------------------------------------------------------------------------------------

# Tests flip this: the extension fills out, lse and the split partials with NaN before the
# kernels run, so anything they leave unwritten shows.
DEBUG_POISON = False


def use_cuda_decode(seqlen_q: int, num_heads: int, num_kv_heads: int, seqlen_k: int,
                    has_cache_seqlens: bool) -> bool:
    """Whether a (contiguous-KV) cuda forward runs the decode kernel rather than the forward
    kernel: few rows per kv head (the Triton decode kernel's limit, which the backends' shared
    reasons apply, and csrc/flash_decode.cu's tile), and a long key range or a KV cache's used
    lengths (which only the decode kernel honours)."""
    from ...planning.decode import DECODE_MAX_ROWS, DECODE_MIN_SEQLEN_K, decode_rows

    if seqlen_q == 0 or decode_rows(seqlen_q, num_heads, num_kv_heads) > DECODE_MAX_ROWS:
        return False
    return has_cache_seqlens or seqlen_k >= DECODE_MIN_SEQLEN_K


def cuda_decode_splits(batch: int, num_kv_heads: int, seqlen_k: int, head_dim: int,
                       device: torch.device) -> int:
    """Key splits per (batch, kv head): the Triton decode kernel's rule
    (:func:`~flash_dmattn.planning.decode.choose_num_splits`) at this kernel's residency: two
    CTAs per SM up
    to head dim 128 (three K/V buffers take 96 KB of shared memory), one above."""
    from ...planning.decode import choose_num_splits

    return choose_num_splits(batch, num_kv_heads, seqlen_k, device,
                             per_sm=2 if head_dim <= 128 else 1)


def cuda_decode_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                        block_table=None, num_splits: Optional[int] = None):
    """Split-KV decode forward: ``(out (B, Lq, H, D), lse (B, H, Lq) fp32)``.

    ``(H / Hkv) * Lq <= DECODE_MAX_ROWS``. ``cache_seqlens``: int ``(B,)`` used keys per batch
    (causal is bottom-right aligned with it). ``block_table``: int ``(B, P)`` page ids; k, v are
    then pools ``(num_pages, page_size, Hkv, D)`` (page size a multiple of 16) holding
    ``P * page_size`` logical keys per batch. Equivalent plain PyTorch::

        k = k[block_table.long()].flatten(1, 2)          # paged: gather the logical cache
        keys = arange(Lk) < cache_seqlens[:, None]       # (B, Lk), folded into the mask
        out = softmax(scale * q @ k^T + bias, masked) @ v   # per split, then merged by lse
    """
    q, k, v = vector_ready(q), vector_ready(k), vector_ready(v)
    B, Lq, H, D = q.shape
    Hkv = k.shape[2]
    mod = kernel_module(q, mask is not None, bias is not None, op="decode")
    if block_table is not None:
        block_table = block_table.to(torch.int32).contiguous()
        Lk = block_table.shape[1] * k.shape[1]
    else:
        Lk = k.shape[1]
    if cache_seqlens is not None:
        cache_seqlens = cache_seqlens.to(torch.int32).contiguous()
    # Masks / biases go in as they are: the extension copies tiles of 16-byte aligned rows as
    # vectors and reads other layouts element by element (a decode step reads each once).
    if num_splits is None:
        num_splits = cuda_decode_splits(B, Hkv, Lk, D, q.device) if q.is_cuda else 1
    return tuple(mod.decode(q, k, v, mask, bias, cache_seqlens, block_table, float(scale),
                            bool(is_causal), float(softcap), int(num_splits), DEBUG_POISON))


def cuda_backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic,
                  needs, cache_seqlens=None, plan: Optional[CudaPlan] = None,
                  key_intervals=None, key_window=None, dropout_p=0.0, dropout_rng=None):
    """``(dq, dk, dv, dbias)`` with None where ``needs`` did not ask.

    Where the forward walked gathered key lists (``plan``, or planned again here when the call
    came without one), dQ walks the same lists: a deterministic kernel over the query tile's
    live keys instead of every partly live key tile. A per-key mask's live keys are walked the
    same way (:func:`key_list_gather`).

    ``deterministic=False`` lets the Hopper backward compute dQ inside the dK/dV kernel, adding
    each key tile's ``dS K`` into an fp32 accumulator with atomics (one kernel and 5 products
    per tile instead of 7 across two; the summation order, hence the last bits, vary between
    runs). ``deterministic=True`` keeps the separate dQ kernel, which uses no atomics:
    bitwise-identical gradients across runs.

    A float32 bias is read in q's dtype and its gradient summed in fp32 and returned in
    float32; a head dim that is not a multiple of 8 is zero-padded (as in the forward).

    ``dropout_p`` / ``dropout_rng``: the forward's dropout, whose keep-mask the kernels draw
    again (dQ then never walks gathered lists: the gathered dQ kernel has no dropout)."""
    d = q.shape[-1]
    dbias_dtype = bias.dtype if bias is not None else None
    dout, q, k, v, out = pad_head_dim(dout, q, k, v, out)
    dq, dk, dv, dbias = _backward(dout, q, k, v, mask, kernel_bias(bias, q.dtype), out, lse,
                                  scale, is_causal, softcap, deterministic, needs,
                                  cache_seqlens, plan, key_intervals, key_window, dbias_dtype,
                                  dropout_args(dropout_p, dropout_rng))
    return _unpad(dq, d), _unpad(dk, d), _unpad(dv, d), dbias


def _backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic,
              needs, cache_seqlens=None, plan: Optional[CudaPlan] = None, key_intervals=None,
              key_window=None, dbias_dtype=None, drop=NO_DROPOUT):
    """:func:`cuda_backward` on what the kernels read (head dim a multiple of 8, the bias in
    q's dtype); dbias in ``dbias_dtype`` (default: the bias's); ``drop``: the extension's
    dropout arguments (:func:`dropout_args`)."""
    if bias is not None and dbias_dtype is None:
        dbias_dtype = bias.dtype
    if key_intervals is not None:
        from .intervals import DenseEquivalent, interval_backward, plan_for

        if plan is None:
            plan = plan_for(q, k, bias, key_intervals, is_causal, backward=True,
                            window=key_window)
            if plan[0].hides_nothing:
                plan = DenseEquivalent(None)
        if isinstance(plan, DenseEquivalent):
            return _backward(dout, q, k, v, None, bias, out, lse, scale, is_causal, softcap,
                             deterministic, needs, plan=plan.plan, dbias_dtype=dbias_dtype,
                             drop=drop)
        return interval_backward(dout, q, k, v, bias, key_intervals, out, lse, scale, is_causal,
                                 softcap, needs, plan=plan, dbias_dtype=dbias_dtype, drop=drop)
    need_dq, need_dk, need_dv, need_dbias = needs
    if cache_seqlens is not None:
        # The backward kernels take one key length for all batches: the per-batch used length
        # (and its causal diagonal) is folded into the mask, O(B * Lq * Lk) bools at most
        # (cache_seqlens_reasons keeps it so).
        from ...planning.decode import fold_cache_seqlens

        mask = fold_cache_seqlens(mask, cache_seqlens, q.shape[1], k.shape[1], is_causal)
        is_causal = False
        plan = CudaPlan()  # the forward's lists were for the unfolded mask: no gathering
    dout, q, k, v, out = (vector_ready(t) for t in (dout, q, k, v, out))
    B, Lq, H, _ = q.shape
    Lk = k.shape[1]
    mod = kernel_module(q, mask is not None, bias is not None, op="bwd")
    block_m, block_n = mod.block_sizes()
    orig_bias = bias
    mode = dbias_mode(bias, B, H, Lq, Lk) if need_dbias else 0
    if mode == DBIAS_SHARED:
        return _shared_bias_backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal,
                                     softcap, deterministic, needs, dbias_dtype, drop)
    if mode == DBIAS_ZERO:
        dq, dk, dv, _ = _backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal,
                                  softcap, deterministic, (need_dq, need_dk, need_dv, False),
                                  plan=plan, drop=drop)
        return dq, dk, dv, torch.zeros(bias.shape, dtype=dbias_dtype, device=bias.device)
    mask, bias = _read_ready(mask, bias, Lq, Lk)
    summary = plan.summary if plan is not None else None

    def forward_module():
        # The forward's tiles, which a summary and gathered lists serve too: its module (the
        # forward of this backward has loaded it).
        return kernel_module(q, mask is not None, bias is not None, op="fwd")

    if not _summary_serves(summary, mod) and _wants_summary(mask, Lq, Lk):
        rows, keys = _backward_summary_blocks(forward_module(), mod)
        summary = _summary(mask, Lq, Lk, is_causal, rows, keys, key_bits=_wants_key_bits(mod))
    gather = None
    if need_dq and mode != 1 and mod.bwd_gathers() and drop[0] is None:
        fwd_mod = forward_module()
        fwd_m, fwd_n = fwd_mod.block_sizes()
        if plan is not None:
            gather = plan.gather
        else:
            gather = _gather_plan(fwd_mod, mask, bias, Lq, Lk, H, is_causal, fwd_m, fwd_n,
                                  summary)
        if gather is None:
            # A per-key mask (block-sparse, padding, top-k per key): dQ over its live keys
            # instead of a fused dQ whose fp32 accumulator outgrows L2 on long sequences.
            gather = key_list_gather(mask, bias, Lq, Lk, H, is_causal, fwd_m)
    lists = _lists(mask, Lq, Lk, H, is_causal, block_m, block_n, q.device, need_bwd=True,
                   summary=summary)
    args = (None, None, None, None, 1)
    if lists is not None:
        args = (lists.fwd_idx, lists.fwd_cnt, lists.bwd_idx, lists.bwd_cnt, lists.head_div)
    gargs = _gather_args(gather, H) if gather is not None else (None, None, 1, None, 1, None, 1)
    # Summaries carry key bits only where _wants_key_bits (a plan made under the test hook
    # _KEY_BITS would not serve, see _summary_serves).
    key_bits = summary.key_bits if summary is not None and _wants_key_bits(mod) else None
    kargs = (key_bits, H // key_bits.size(1) if key_bits is not None else 1)
    dq, dk, dv, db = mod.bwd(dout, q, k, v, mask, bias, out, lse.contiguous(), float(scale),
                             bool(is_causal), float(softcap), bool(need_dq),
                             bool(need_dk or need_dv), int(mode), *args,
                             bool(not deterministic), None, None, None, 0, 0,
                             *gargs, *kargs, *drop)
    dbias = None
    if mode == 1:
        dbias = db.to(dbias_dtype)
    elif mode == 2:
        dbias = reduce_key_partials(db, orig_bias, dbias_dtype)
    return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dbias)


# Bytes of the per-(batch, head) dbias one step of _shared_bias_backward may write (in the
# inputs' dtype) and reduce in fp32: the backward runs on as many (batch, kv-head group) pairs
# at once as fit, at least one.
SHARED_DBIAS_CHUNK_BYTES = 1 << 28


def _aux_chunk(t, b0, b1, g0, g1, group, heads):
    """The part of a 4-D mask / bias ``t`` that batches ``b0:b1`` and kv heads ``g0:g1`` (their
    query heads ``g0 * group : g1 * group``) read: views, broadcast dims kept."""
    if t is None:
        return None
    if t.size(0) > 1:
        t = t[b0:b1]
    hx = t.size(1)
    if hx == heads and hx > 1:
        t = t[:, g0 * group:g1 * group]
    elif hx > 1:  # per kv head
        t = t[:, g0:g1]
    return t


def _chunk_dropout(drop: tuple, batch0: int, head0: int, heads: int) -> tuple:
    """The dropout arguments of a call on batches ``batch0 ..`` and query heads ``head0 ..``
    of the call with ``drop`` and ``heads`` query heads (see :func:`dropout_args`)."""
    rng, threshold, scale, b0, h0, h = drop
    if rng is None:
        return drop
    return rng, threshold, scale, b0 + batch0, h0 + head0, h or heads


def _shared_bias_backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap,
                          deterministic, needs, dbias_dtype=None, drop=NO_DROPOUT):
    """``(dq, dk, dv, dbias)`` for a per-query bias ``(Bx, Hx, Lq, Lk)`` whose rows several
    heads or batches share (``Bx < B`` or ``Hx < H``), e.g. a ``(1, 1, Lq, Lk)`` position bias.

    The kernels write a per-query dbias for a ``(B, H, Lq, Lk)`` bias only (one row per
    (batch, head)). The backward therefore runs on chunks of (batch, kv head) pairs, each with
    its kv head's whole group of query heads (so dK / dV of a chunk are complete), reading the
    bias through a broadcast view of the chunk's full shape; each chunk's dbias is summed in
    fp32 into the bias's own shape. Extra memory: one fp32 copy of the bias plus one chunk of
    at most :data:`SHARED_DBIAS_CHUNK_BYTES`. dbias comes back in ``dbias_dtype`` (default: the
    bias's). With dropout (``drop``), each chunk draws the whole call's keep-mask at its own
    batches and heads. Equivalent plain PyTorch::

        dbias_full = dS                                # (B, H, Lq, Lk), as for a full bias
        dbias = dbias_full.sum(dims where bias has size 1, keepdim=True)   # per chunk
    """
    from ...planning.rows import aligned_rows

    need_dq, need_dk, need_dv, _ = needs
    B, Lq, H, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    bx, hx = bias.size(0), bias.size(1)
    acc = torch.zeros(bias.shape, dtype=torch.float32, device=q.device)
    # The bias rows, 16-byte aligned once here (not per chunk, and never the broadcast view).
    rows, _ = aligned_rows(bias, Lq, Lk)
    pair_bytes = group * Lq * Lk * (q.element_size() + 4)
    pairs = max(1, SHARED_DBIAS_CHUNK_BYTES // max(pair_bytes, 1))
    # A per-kv-head bias is read by one kv head's group at a time: a broadcast view cannot
    # repeat each kv head's rows for its group.
    kv_step = 1 if 1 < hx < H else min(Hkv, pairs)
    b_step = max(1, min(B, pairs // kv_step))
    dq = torch.empty_like(q) if need_dq else None
    dk = torch.empty_like(k) if need_dk else None
    dv = torch.empty_like(v) if need_dv else None
    lse = lse.contiguous()
    for b0 in range(0, B, b_step):
        b1 = min(B, b0 + b_step)
        for g0 in range(0, Hkv, kv_step):
            g1 = min(Hkv, g0 + kv_step)
            hs = slice(g0 * group, g1 * group)
            nb, nh = b1 - b0, (g1 - g0) * group
            chunk_bias = _aux_chunk(rows, b0, b1, g0, g1, group, H).expand(nb, nh, Lq, Lk)
            cq, ck, cv, cb = _backward(
                dout[b0:b1, :, hs], q[b0:b1, :, hs], k[b0:b1, :, g0:g1], v[b0:b1, :, g0:g1],
                _aux_chunk(mask, b0, b1, g0, g1, group, H), chunk_bias, out[b0:b1, :, hs],
                lse[b0:b1, hs].contiguous(), scale, is_causal, softcap, deterministic,
                (need_dq, need_dk, need_dv, True), drop=_chunk_dropout(drop, b0, g0 * group, H))
            if need_dq:
                dq[b0:b1, :, hs] = cq
            if need_dk:
                dk[b0:b1, :, g0:g1] = ck
            if need_dv:
                dv[b0:b1, :, g0:g1] = cv
            part = cb.float()
            if hx == 1:
                part = part.sum(1, keepdim=True)
            elif hx != H:  # per kv head: sum each group's query heads
                part = part.view(nb, g1 - g0, group, Lq, Lk).sum(2)
            if bx == 1:
                part = part.sum(0, keepdim=True)
            target = acc if bx == 1 else acc[b0:b1]
            if hx == H:
                target[:, hs] += part
            elif hx == 1:
                target += part
            else:
                target[:, g0:g1] += part
    return dq, dk, dv, acc.to(dbias_dtype or bias.dtype)


# ---------------------------------------------------------------------------------------------
# Packed sequences (varlen)
# ---------------------------------------------------------------------------------------------

def varlen_input_reasons(q, v, mask, bias) -> List[str]:
    """Why the kernels cannot take these packed ``(total, heads, D)`` tensors."""
    reasons = input_reasons(q, q, v, None, bias, False)
    if mask is not None and mask.dtype != torch.bool:
        reasons.append(f"mask dtype {mask.dtype} is not bool")
    return reasons


def _packed_lists(mask, cu_k, max_k, heads, block_n):
    """``(idx, cnt, head_div)`` of the sequences' live key tiles at ``block_n`` (a per-key mask),
    as the extension's 4-D (sequence, mask head, 1, n) lists: one row per (sequence, mask
    head), shared by every tile of the sequence (tile stride 0)."""
    if mask is None:
        return None, None, 1
    from ...planning.tiles import build_varlen_key_lists

    lists = build_varlen_key_lists(mask, cu_k, max_k, heads, block_n)
    return (lists.idx.transpose(0, 1).unsqueeze(2), lists.cnt.transpose(0, 1).unsqueeze(2),
            lists.head_div)


AUX_ALIGN = 16  # elements: a sequence's first mask byte / bias element 16-byte aligned


def _aligned_aux(mask, bias, cu_k):
    """Copies of the per-key ``(Hx, total_k)`` mask and bias in which every sequence starts on
    a 16-element boundary, as the kernels' ``(1, Hx, 1, width)`` views, and the int32 offsets
    of those starts.

    Sequences start at arbitrary packed keys, so tiles of the original rows cannot be copied
    as 16-byte vectors; element-by-element loads stall every step on their latency (the varlen
    backward with a mask and bias ran at less than half Triton's speed that way). The copy is
    O(Hx * total_k) and needs no host sync: keys past
    ``cu_k[-1]`` land in a scratch column.
    """
    if mask is None and bias is None:
        return None, None, None
    total_k = (mask if mask is not None else bias).shape[-1]
    n = cu_k.numel() - 1
    cu = cu_k.to(torch.int64)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    cu_aux = torch.zeros(n + 1, dtype=torch.int64, device=cu.device)
    cu_aux[1:] = torch.cumsum((lens + AUX_ALIGN - 1) // AUX_ALIGN * AUX_ALIGN, 0)
    width = -(-(total_k + (AUX_ALIGN - 1) * n) // AUX_ALIGN) * AUX_ALIGN  # bound on cu_aux[-1]
    j = torch.arange(total_k, device=cu.device)
    seq = torch.searchsorted(cu[1:], j, right=True)
    inside = seq < n
    seq = seq.clamp_max(max(n - 1, 0))
    dst = torch.where(inside, j - cu[seq] + cu_aux[seq], width)

    def copy(t):
        if t is None:
            return None
        out = t.new_zeros(t.shape[0], width + AUX_ALIGN)
        out.index_copy_(1, dst, t)
        return out[None, :, None, :]

    return copy(mask), copy(bias), cu_aux.to(torch.int32)


def _packed_call(q, mask, bias, cu_q, cu_k, max_k, op):
    """The kernel module of a packed call (``op``: fwd or bwd) and what the forward and the
    backward alike pass it beside the tensors: ``(mod, (cu_q, cu_k, cu_aux), (idx, cnt, hdiv),
    (mask, bias))``, the cu_seqlens as int32, a per-key mask's key-tile lists at the module's
    block_n (:func:`_packed_lists`) and the mask and bias on aligned rows (:func:`_aligned_aux`).
    q is the kernels' (total_q, H, D), bias already in q's dtype."""
    mod = kernel_module(q, mask is not None, bias is not None, packed=True, op=op)
    _, block_n = mod.block_sizes()
    cu_q, cu_k = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    idx, cnt, hdiv = _packed_lists(mask, cu_k, max_k, q.shape[1], block_n)
    mask_a, bias_a, cu_aux = _aligned_aux(mask, bias, cu_k)
    return mod, (cu_q, cu_k, cu_aux), (idx, cnt, hdiv), (mask_a, bias_a)


def cuda_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal,
                        softcap, dropout_p=0.0,
                        dropout_rng=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: ``(out (total_q, H, D), lse (H, total_q) fp32)``; rows no sequence
    owns (past ``cu_q[-1]``) give 0 / -inf. A float32 bias is read in q's dtype, a head dim
    that is not a multiple of 8 zero-padded (as in :func:`cuda_forward`). ``dropout_p`` /
    ``dropout_rng``: attention dropout, sequence ``s`` drawing the keep-mask of batch entry
    ``s`` (:mod:`flash_dmattn.dropout`)."""
    d = q.shape[-1]
    q, k, v = (vector_ready(t) for t in pad_head_dim(q, k, v))
    bias = kernel_bias(bias, q.dtype)
    mod, (cu_q, cu_k, cu_aux), (idx, cnt, hdiv), (mask_a, bias_a) = _packed_call(
        q, mask, bias, cu_q, cu_k, max_k, "fwd")
    out, lse = mod.fwd(q[None], k[None], v[None], mask_a, bias_a, None, float(scale),
                       bool(is_causal), float(softcap), idx, cnt, hdiv, cu_q, cu_k, cu_aux,
                       int(max_q), int(max_k), *dropout_args(dropout_p, dropout_rng))
    return _unpad(out[0], d), lse


def cuda_varlen_backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, out, lse, scale,
                         is_causal, softcap, deterministic, needs, dropout_p=0.0,
                         dropout_rng=None):
    """``(dq, dk, dv, dbias)`` of packed sequences, None where ``needs`` did not ask; dbias in
    the per-key bias's ``(Hx, total_k)`` shape. Never uses atomics (``deterministic`` is free).
    ``dropout_p`` / ``dropout_rng``: the forward's dropout, whose keep-mask the kernels draw
    again."""
    need_dq, need_dk, need_dv, need_dbias = needs
    d = q.shape[-1]
    dout, q, k, v, out = (vector_ready(t) for t in pad_head_dim(dout, q, k, v, out))
    dbias_dtype = bias.dtype if bias is not None else None
    bias = kernel_bias(bias, q.dtype)
    H = q.shape[1]
    mod, (cu_q, cu_k, cu_aux), (idx, cnt, hdiv), (mask_a, bias_a) = _packed_call(
        q, mask, bias, cu_q, cu_k, max_k, "bwd")
    mode = 2 if (need_dbias and bias is not None) else 0
    dq, dk, dv, db = mod.bwd(dout[None], q[None], k[None], v[None], mask_a, bias_a, out[None],
                             lse.contiguous(), float(scale), bool(is_causal), float(softcap),
                             bool(need_dq), bool(need_dk or need_dv), mode, idx, cnt, None, None,
                             hdiv, False, cu_q, cu_k, cu_aux, int(max_q), int(max_k),
                             None, None, 1, None, 1, None, 1, None, 1,
                             *dropout_args(dropout_p, dropout_rng))
    dbias = None
    if mode == 2:
        hx, total_k = bias.shape
        dbias = db.view(hx, H // hx, total_k).sum(1).to(dbias_dtype)
    return (_unpad(dq[0], d) if need_dq else None, _unpad(dk[0], d) if need_dk else None,
            _unpad(dv[0], d) if need_dv else None, dbias)
