"""The torch-reference backend's CPU path: PyTorch's fused attention over bounded query chunks.

On CPU the oracle (:mod:`.attention`) runs each score block through separate PyTorch ops and
is several times slower than :func:`torch.nn.functional.scaled_dot_product_attention`. Where
SDPA computes exactly this library's attention -- no soft cap, no KV cache, no attention
probabilities asked for, no dropout, a bias in the query's dtype, float32 / bfloat16 / float16 (float64
stays on the oracle, the tests' ground truth) -- the backend calls SDPA instead, one chunk of
query rows at a time:

* the chunk's visibility (the mask's rows, the bottom-right causal diagonal, key intervals)
  and the bias become one additive mask with the fewest heads they allow: one, ``Hkv`` or
  ``H``. A mask with one head per kv head is never repeated over the query heads: SDPA runs
  once per member of a query-head group (query heads ``kv * g + m`` for one ``m``, against
  their own kv heads), each call reading the same mask; otherwise SDPA broadcasts the mask and
  groups the query heads itself (``enable_gqa``). K/V are never repeated;
* causal chunks stop at their last visible key: keys past the diagonal are not computed;
* a row that sees no key (hidden by the mask, or a ``-inf`` bias on every key) attends to
  every key with finite scores instead and its output is multiplied by 0 afterwards: it gives
  0, and nothing of it reaches any gradient;
* a training call keeps its chunks' masks for the backward while they total at most
  ``SAVED_ELEMENTS`` (128 MiB in float32); beyond that each chunk is checkpointed, and the
  backward recomputes its mask and attention: memory stays bounded, as in the oracle.

With no mask, bias or intervals (and causal only where ``Lq == Lk``, SDPA's own alignment) one
SDPA call covers the whole problem and nothing of size ``(Lq, Lk)`` is built.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Elements of one chunk's scores (B * H * rows * Lk): about 32 MiB in float32.
CHUNK_ELEMENTS = 1 << 23
# Training calls whose masks together stay within this many elements keep them for the
# backward (as SDPA with a built mask would); larger ones recompute each chunk's.
SAVED_ELEMENTS = 1 << 25
# Causal calls split their queries into at least this many chunks (of at least
# CAUSAL_MIN_ROWS rows) so that each chunk skips the keys past its diagonal.
CAUSAL_CHUNKS = 4
CAUSAL_MIN_ROWS = 128
# Below this many score elements a chunk's call overhead outweighs repeating its mask over the
# query heads: one SDPA call for all heads instead of one per group member.
PER_MEMBER_ELEMENTS = 1 << 19

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NEG_INF = float("-inf")
_FILLS: dict = {}


def _fills(dtype: torch.dtype):
    """0-d ``(0, -inf)`` of ``dtype``, made once (never written to)."""
    if dtype not in _FILLS:
        _FILLS[dtype] = (torch.zeros((), dtype=dtype), torch.full((), _NEG_INF, dtype=dtype))
    return _FILLS[dtype]


def sdpa_cpu_reasons(inputs) -> list:
    """Why a call cannot take the SDPA path (empty: it can)."""
    reasons = []
    if inputs.device.type != "cpu":
        reasons.append("not on CPU")
    if inputs.dtype not in _DTYPES:
        reasons.append(f"dtype {inputs.dtype} stays on the oracle")
    if inputs.softcap > 0.0:
        reasons.append("soft cap")
    if inputs.return_attn_probs:
        reasons.append("attention probabilities asked for")
    if inputs.cache_seqlens is not None or inputs.block_table is not None:
        reasons.append("KV cache")
    if inputs.attn_bias is not None and inputs.attn_bias.dtype != inputs.dtype:
        reasons.append("bias dtype differs from the query's")
    if inputs.seqlen_q == 0 or inputs.seqlen_k == 0:
        reasons.append("no queries or no keys")
    if getattr(inputs, "dropout_p", 0.0) > 0.0:
        reasons.append("attention dropout (SDPA's own random stream is not flash_dmattn's)")
    return reasons


def _heads(t: Optional[Tensor], num_heads: int, dim: int = 1) -> Optional[Tensor]:
    """A mask / bias / bounds tensor whose ``dim`` holds 1, ``Hkv`` or ``H`` heads, with one
    per kv head repeated over its group (rows of one chunk only)."""
    if t is None or t.shape[dim] in (1, num_heads):
        return t
    return t.repeat_interleave(num_heads // t.shape[dim], dim=dim)


def _keys(t: Optional[Tensor], end: int) -> Optional[Tensor]:
    """``t`` limited to keys ``0 .. end`` (last dim; a per-query value stays as it is)."""
    return t if t is None or t.shape[-1] == 1 else t[..., :end]


def _chunk(q, k, v, mask, bias, bounds, scale, is_causal, i0, lq, per_member, repeat_heads,
           finite_bias):
    """Attention ``(B, rows, H, Dv)`` of query rows ``i0 .. i0 + rows``.

    ``q`` is that chunk ``(B, rows, H, D)``, ``k``/``v`` all keys ``(B, Lk, Hkv, D)``, ``mask``
    and ``bias`` the chunk's rows (or their single broadcast row), ``bounds`` key intervals
    ``(2, Bx, Hx, Lk)``. ``per_member``: one SDPA call per query-head group member, against a
    mask with one head per kv head; ``repeat_heads``: one call for all query heads, so a mask
    with one head per kv head is repeated over the query heads. ``finite_bias``: the bias has no ``-inf``, so only
    ``mask``, causality and intervals hide keys.
    """
    rows, heads = q.shape[1], q.shape[2]
    lk, kv_heads = k.shape[1], k.shape[2]
    shift = lk - lq
    if is_causal:
        # Keys past the chunk's last diagonal are hidden from all its rows (at least one key
        # stays, so that rows seeing nothing still go through SDPA and give 0 below).
        end = max(1, min(lk, i0 + rows + shift))
        if end < lk:
            k, v = k[:, :end], v[:, :end]
            mask, bias, bounds = _keys(mask, end), _keys(bias, end), _keys(bounds, end)
    if repeat_heads and heads in {t.shape[d] for t, d in ((mask, 1), (bias, 1), (bounds, 2))
                                  if t is not None}:
        # Parts per query head and parts per kv head: these are repeated before they meet.
        mask, bias, bounds = _heads(mask, heads), _heads(bias, heads), _heads(bounds, heads, 2)
    visible = mask
    pos = None
    if is_causal or bounds is not None:
        pos = torch.arange(i0 + shift, i0 + rows + shift, device=q.device).unsqueeze(1)
    if is_causal:
        causal = torch.arange(k.shape[1], device=q.device) <= pos
        visible = causal if visible is None else visible & causal
    if bounds is not None:
        inside = (bounds[0].unsqueeze(2) <= pos) & (pos < bounds[1].unsqueeze(2))
        visible = inside if visible is None else visible & inside
    if bias is not None and not finite_bias:
        seen = bias > _NEG_INF
        visible = seen if visible is None else visible & seen
    zero, neg_inf = _fills(q.dtype)
    live = None
    if visible is None:
        add = bias
    else:
        while visible.dim() < 4:
            visible = visible.unsqueeze(0)
        # Every row sees key 0 when only the causal diagonal (with Lk >= Lq) hides keys.
        if mask is not None or bounds is not None or not finite_bias or shift < 0:
            # A row that sees no key attends to every key with finite scores instead, and its
            # output is zeroed below.
            live = visible.any(-1, keepdim=True)
            fill = torch.where(live, neg_inf, zero)
        else:
            fill = neg_inf
        # Hidden pairs -inf, rows that see nothing 0: one pass over the chunk's scores.
        add = torch.where(visible, zero if bias is None else bias, fill)
    if per_member:
        # Query heads kv * g + m for one m: (B, Hkv, rows, D) views, one SDPA call each.
        members = q.unflatten(2, (kv_heads, heads // kv_heads)).unbind(3)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        outs = [F.scaled_dot_product_attention(m.transpose(1, 2), kh, vh, attn_mask=add,
                                               scale=scale).transpose(1, 2) for m in members]
        out = torch.stack(outs, dim=3)  # (B, rows, Hkv, g, Dv)
        if live is not None:
            out = out * live.transpose(1, 2).unsqueeze(-1)
        return out.flatten(2, 3)
    # One call for all query heads: a mask per kv head is repeated once, as the finished mask.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=_heads(add, heads),
                                         scale=scale, enable_gqa=True).transpose(1, 2)
    if live is None:
        return out
    if live.shape[1] in (1, heads):
        return out * live.transpose(1, 2)
    grouped = out.unflatten(2, (kv_heads, heads // kv_heads))
    return (grouped * live.transpose(1, 2).unsqueeze(-1)).flatten(2, 3)


def _rows(t: Optional[Tensor], rows: int, count: int) -> list:
    """``count`` chunks of ``t``'s query rows (split: its backward is one concatenation), or
    ``t`` itself for each when it has a single broadcast row."""
    if t is None or t.shape[2] == 1:
        return [t] * count
    return list(t.split(rows, dim=2))


def sdpa_cpu_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                       bias: Optional[Tensor], scale: float, is_causal: bool,
                       key_intervals: Optional[Tensor] = None) -> Tensor:
    """``(B, Lq, H, Dv)`` attention of ``(B, L, H, D)`` tensors (see the module docstring);
    ``mask``/``bias`` 4-D broadcastable to ``(B, H, Lq, Lk)`` with ``H`` or ``Hkv`` or 1
    heads, ``key_intervals`` the ``(2, Bx, Hx, Lk)`` bounds of a KeyIntervals mask."""
    batch, lq, heads = q.shape[0], q.shape[1], q.shape[2]
    lk, kv_heads = k.shape[1], k.shape[2]
    # SDPA's own causal masking scales scores it has already set to -inf (0 * -inf is NaN for
    # softmax_scale 0): with scale 0 causality goes through the additive mask below.
    if (mask is None and bias is None and key_intervals is None
            and (not is_causal or (lq == lk and scale != 0.0))):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=is_causal,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    aux_heads = {t.shape[1] for t in (mask, bias) if t is not None}
    if key_intervals is not None:
        aux_heads.add(key_intervals.shape[2])
    grouped = heads != kv_heads and kv_heads in aux_heads
    rows = max(1, CHUNK_ELEMENTS // max(1, batch * heads * lk))
    if is_causal:
        rows = min(rows, max(CAUSAL_MIN_ROWS, -(-lq // CAUSAL_CHUNKS)))
    per_member = (grouped and heads not in aux_heads
                  and batch * heads * min(rows, lq) * lk >= PER_MEMBER_ELEMENTS)
    repeat_heads = grouped and not per_member
    # A bias without -inf hides nothing: visibility comes from the rest alone (a compiled
    # graph cannot branch on the bias's values, so it always takes the general path).
    finite_bias = bias is None or (not torch.compiler.is_compiling()
                                   and bool(bias.detach().amin() > _NEG_INF))
    count = -(-lq // rows)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias))
    recompute = needs_grad and batch * heads * lq * lk > SAVED_ELEMENTS
    chunks = zip(range(0, lq, rows), q.split(rows, dim=1), _rows(mask, rows, count),
                 _rows(bias, rows, count))
    outs = []
    for i0, qc, mc, bc in chunks:
        args = (qc, k, v, mc, bc, key_intervals, scale, is_causal, i0, lq, per_member,
                repeat_heads, finite_bias)
        if recompute:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    return outs[0] if count == 1 else torch.cat(outs, dim=1)
