"""Packed sequences with a key-interval mask, as one key-interval call over the packed tokens.

A varlen call (``flash_dmattn_varlen_func``) with a :class:`~flash_dmattn.masks.KeyIntervals`
mask gives every key one interval of its own sequence's query positions. Laid side by side,
the sequences are one batch-1 call with ``Lq = total_q`` queries and ``Lk = total_k`` keys in
which key ``j`` of sequence ``s`` is seen by the packed queries

    ``[cu_q[s] + lo_j, cu_q[s] + hi_j)``

where ``[lo_j, hi_j)`` is the range of the sequence's query indices that see it (its interval
moved from positions to indices by the sequence's own bottom-right offset ``lk_s - lq_s``,
causality folded in as ``lo_j >= j_local - (lk_s - lq_s)``, and clipped to ``0..lq_s``). Every
other sequence's queries lie outside that range, so no query sees a key of another sequence,
and the packed call runs *not* causal: the causal limit is already in the ranges. Keys no
sequence owns (past ``cu_k[-1]``) get the empty interval; queries past ``cu_q[-1]`` fall in
no range and give 0, as the varlen contract says.

The remap is O(Hx · total_k) elementwise work and a search of ``cu_seqlens_k`` per key, on
the device, with no host synchronisation; the packed call then runs on the key-interval
kernels (``backends/*/intervals.py``), which visit the selected keys only, and its gradients
come back in the varlen layouts through the views it is made of (``q[None]``, a per-key bias
``(Hx, total_k)`` as ``(1, Hx, 1, total_k)``).

**The window promise** (:attr:`~flash_dmattn.masks.KeyIntervals.window`) bounds the keys a
tile of consecutive query positions meets by ``W + rows - 1``. A tile of the packed call that
straddles sequences meets up to ``W`` keys of each, so the promise holds for the packed call
only when there is a single sequence (causality folded in only narrows ranges, so it cannot
break the bound); with several sequences it is dropped, and the planner waits once for its
lists' length as for any mask without a window.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..inputs import AttentionInputs, VarlenInputs

__all__ = ["pack_key_intervals", "packed_window", "packed_interval_inputs",
           "packed_interval_reasons"]


def pack_key_intervals(bounds: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, total_q: int, is_causal: bool) -> torch.Tensor:
    """The ``(2, 1, Hx, total_k)`` int32 bounds of the packed call (see the module docstring)
    from a varlen call's per-sequence ``(2, Hx, total_k)`` bounds.

    Query ``i`` of the packed call has position ``i + total_k - total_q``; the result is to be
    run with ``is_causal=False``. No host synchronisation; no tensor larger than the bounds.
    """
    _, hx, total_k = bounds.shape
    device = bounds.device
    n = cu_seqlens_k.numel() - 1
    if n < 1 or total_k == 0:
        return bounds.new_zeros((2, 1, hx, total_k))
    cu_q = cu_seqlens_q.to(device=device, dtype=torch.int64)
    cu_k = cu_seqlens_k.to(device=device, dtype=torch.int64)
    j = torch.arange(total_k, device=device, dtype=torch.int64)
    # The sequence that owns key j: the last s with cu_k[s] <= j (empty sequences, whose
    # offsets repeat, are skipped by right=True); s == n or -1: no sequence owns it.
    seq = torch.searchsorted(cu_k, j, right=True) - 1
    owned = (seq >= 0) & (seq < n)
    s = seq.clamp(0, n - 1)
    k0, q0 = cu_k[s], cu_q[s]
    lq = (cu_q[s + 1] - q0).clamp(min=0)
    shift = (cu_k[s + 1] - k0) - lq  # local query index i sits at local key position i + shift
    lo = bounds[0].to(torch.int64) - shift
    if is_causal:
        lo = torch.maximum(lo, (j - k0) - shift)
    lo = torch.minimum(lo.clamp(min=0), lq)
    hi = torch.minimum((bounds[1].to(torch.int64) - shift).clamp(min=0), lq)
    hi = torch.where(owned & (lo < hi), hi, lo)  # empty where not owned or hidden
    pos = q0 + (total_k - total_q)  # packed position of the sequence's first query
    packed = torch.stack([pos + lo, pos + hi]).clamp(-(1 << 30), 1 << 30)
    return packed.to(torch.int32).unsqueeze(1)


def packed_window(window: Optional[int], num_seqs: int) -> Optional[int]:
    """The window promise that holds for the packed call: the mask's own with one sequence,
    none with several (see the module docstring)."""
    return window if num_seqs == 1 else None


def packed_interval_reasons(inputs: VarlenInputs) -> List[str]:
    """Why a varlen key-interval call cannot run as one packed key-interval call (empty: it
    can); the backend's own reasons for the packed call come on top."""
    reasons = []
    if inputs.dropout_p > 0.0:
        reasons.append("dropout with key intervals on packed sequences: the packed call would "
                       "draw its keep-mask at packed coordinates, not per sequence "
                       "(torch-reference runs it)")
    return reasons


def packed_interval_inputs(inputs: VarlenInputs, remap: bool = True) -> AttentionInputs:
    """The batch-1 :class:`~flash_dmattn.inputs.AttentionInputs` a varlen key-interval call
    is (see the module docstring): q/k/v as ``(1, total, heads, D)`` views, the per-key bias
    as a ``(1, Hx, 1, total_k)`` view, the packed bounds, not causal.

    ``remap=False`` leaves the bounds as a view of the varlen ones, of the packed call's shape
    but not its values: enough for a backend to say whether it could run the call (its reasons
    read shapes), without work on the device.
    """
    bounds = inputs.key_intervals
    if remap:
        bounds = pack_key_intervals(bounds, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                    inputs.query.shape[0], inputs.is_causal)
    else:
        bounds = bounds.unsqueeze(1)
    bias = inputs.attn_bias
    return AttentionInputs(
        query=inputs.query.unsqueeze(0),
        key=inputs.key.unsqueeze(0),
        value=inputs.value.unsqueeze(0),
        attn_mask=None,
        attn_bias=None if bias is None else bias[None, :, None, :],
        softmax_scale=inputs.softmax_scale,
        is_causal=False,
        softcap=inputs.softcap,
        deterministic=inputs.deterministic,
        return_attn_probs=inputs.return_attn_probs,
        key_intervals=bounds,
        key_window=packed_window(inputs.key_window, inputs.num_seqs),
    )
