"""The torch-reference backend's CPU path: PyTorch's fused attention over bounded query chunks.

On CPU the oracle (:mod:`.attention`) runs each score block through separate PyTorch ops and
is several times slower than :func:`torch.nn.functional.scaled_dot_product_attention`. Where
SDPA computes exactly this library's attention -- no soft cap, no KV cache, no attention
probabilities asked for, no dropout, a bias in the query's dtype, float32 / bfloat16 / float16 (float64
stays on the oracle, the tests' ground truth) -- the backend calls SDPA instead, one chunk of
query rows at a time:

* the chunk's visibility (the mask's rows, the bottom-right causal diagonal, key intervals)
  and the bias become one mask of at most ``(B, H, rows, Lk)``; SDPA broadcasts it and groups
  the query heads onto their kv head itself (``enable_gqa``), so K/V are not repeated;
* without a bias the visibility goes to SDPA as a bool mask, with one as the additive mask;
  a row that sees no key (hidden by the mask, or a ``-inf`` bias on every key) attends to
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

# Elements of one chunk's additive mask (B * H * rows * Lk): about 32 MiB in float32.
CHUNK_ELEMENTS = 1 << 23
# Training calls whose masks together stay within this many elements keep them for the
# backward (as SDPA with a built mask would); larger ones recompute each chunk's.
SAVED_ELEMENTS = 1 << 25

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _heads(t: Optional[Tensor], num_heads: int) -> Optional[Tensor]:
    """A ``(Bx, Hx, ...)`` mask / bias with ``Hx`` broadcastable to the query heads: one per
    kv head is repeated over its group (rows of one chunk only)."""
    if t is None or t.shape[1] in (1, num_heads):
        return t
    return t.repeat_interleave(num_heads // t.shape[1], dim=1)


def _chunk(q, k, v, mask, bias, bounds, scale, is_causal, i0: int, lk: int, lq: int):
    """Attention of query rows ``i0 .. i0 + rows`` (``q`` is that chunk, ``(B, H, rows, D)``)."""
    rows, heads = q.shape[2], q.shape[1]
    cols = torch.arange(lk, device=q.device)
    visible = None
    if mask is not None:
        visible = _heads(mask if mask.shape[2] == 1 else mask[:, :, i0:i0 + rows], heads)
    if is_causal:
        pos = torch.arange(i0, i0 + rows, device=q.device).unsqueeze(1) + (lk - lq)
        causal = cols <= pos
        visible = causal if visible is None else visible & causal
    if bounds is not None:
        pos = torch.arange(i0, i0 + rows, device=q.device).view(-1, 1) + (lk - lq)
        inside = _heads((bounds[0].unsqueeze(2) <= pos) & (pos < bounds[1].unsqueeze(2)), heads)
        visible = inside if visible is None else visible & inside
    # A row that sees no key (hidden by the mask, or -inf bias everywhere) attends to every
    # key with finite scores instead, and its output is zeroed below.
    live = None
    if bias is None:
        add = visible
        if visible is not None:
            live = visible.any(-1, keepdim=True)
            add = visible | ~live
    else:
        add = _heads(bias if bias.shape[2] == 1 else bias[:, :, i0:i0 + rows], heads)
        seen = add > float("-inf")
        if visible is not None:
            seen = seen & visible
        live = seen.any(-1, keepdim=True)
        # Hidden pairs -inf, rows that see nothing 0: one pass over the chunk's scores.
        fill = torch.where(live, torch.full((), float("-inf"), dtype=q.dtype),
                           torch.zeros((), dtype=q.dtype))
        add = torch.where(seen, add, fill)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale, enable_gqa=True)
    if live is not None:
        out = out * live.to(out.dtype)
    return out


def sdpa_cpu_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                       bias: Optional[Tensor], scale: float, is_causal: bool,
                       key_intervals: Optional[Tensor] = None) -> Tensor:
    """``(B, Lq, H, Dv)`` attention of ``(B, L, H, D)`` tensors (see the module docstring);
    ``mask``/``bias`` 4-D broadcastable to ``(B, H, Lq, Lk)`` with ``H`` or ``Hkv`` or 1
    heads, ``key_intervals`` the ``(2, Bx, Hx, Lk)`` bounds of a KeyIntervals mask."""
    lq, heads = q.shape[1], q.shape[2]
    lk = k.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if mask is None and bias is None and key_intervals is None and (not is_causal or lq == lk):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)
    rows = max(1, CHUNK_ELEMENTS // max(1, q.shape[0] * heads * lk))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias))
    recompute = needs_grad and q.shape[0] * heads * lq * lk > SAVED_ELEMENTS
    outs = []
    for i0 in range(0, lq, rows):
        qc = qh[:, :, i0:i0 + rows]
        args = (qc, kh, vh, mask, bias, key_intervals, scale, is_causal, i0, lk, lq)
        if recompute:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    return torch.cat(outs, dim=2).transpose(1, 2)
