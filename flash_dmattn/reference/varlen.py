"""Packed-sequence reference: one dense reference call per sequence (docs/contract.md §4)."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .attention import reference_attention, reference_probs


def _offsets(cu: Tensor, total: int, name: str) -> List[int]:
    offs = [int(x) for x in cu.tolist()]
    if offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])) or offs[-1] > total:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at most at the packed length "
            f"{total}; got {offs}"
        )
    return offs


def _per_key(t: Optional[Tensor], k0: int, k1: int) -> Optional[Tensor]:
    # (Hx, total_k) -> (1, Hx, 1, Lk_i): one value per key for every query of the sequence.
    return None if t is None else t[:, k0:k1].unsqueeze(0).unsqueeze(2)


def _key_intervals(bounds: Optional[Tensor], k0: int, k1: int) -> Optional[Tensor]:
    # (2, Hx, total_k) -> (2, 1, Hx, Lk_i): positions are per sequence, as in a dense call.
    return None if bounds is None else bounds[:, :, k0:k1].unsqueeze(1)


def reference_varlen_attention(inputs):
    """Run :func:`reference_attention` sequence by sequence on packed inputs.

    Returns ``(out (total_q, H, D), lse (H, total_q), probs or None)``; queries past
    ``cu_seqlens_q[-1]`` get output 0 and lse -inf. Equivalent plain PyTorch::

        for i in range(n):
            qs, ks = slice(cu_q[i], cu_q[i+1]), slice(cu_k[i], cu_k[i+1])
            out[qs] = dense_attention(q[None, qs], k[None, ks], v[None, ks],
                                      mask[:, ks][None, :, None], bias[:, ks][None, :, None])[0]

    Key intervals (``inputs.key_intervals``) are sliced per sequence the same way, their
    positions relative to the sequence. Dropout uses the sequence index as its batch.
    """
    q, k, v = inputs.query, inputs.key, inputs.value
    total_q, H, D = q.shape
    cu_q = _offsets(inputs.cu_seqlens_q, total_q, "cu_seqlens_q")
    cu_k = _offsets(inputs.cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    outs, lses, probs = [], [], []
    for i in range(inputs.num_seqs):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        args = (
            q[q0:q1].unsqueeze(0),
            k[k0:k1].unsqueeze(0),
            v[k0:k1].unsqueeze(0),
            _per_key(inputs.attn_mask, k0, k1),
            _per_key(inputs.attn_bias, k0, k1),
        )
        intervals = _key_intervals(inputs.key_intervals, k0, k1)
        rng = None
        if inputs.dropout_p > 0.0:
            # Sequence i is batch i of the dropout coordinates: the rng's third element.
            rng = torch.cat([inputs.dropout_rng[:2], inputs.dropout_rng.new_full((1,), i)])
        out_i, lse_i = reference_attention(
            *args, inputs.softmax_scale, inputs.is_causal, inputs.softcap,
            key_intervals=intervals, dropout_p=inputs.dropout_p, dropout_rng=rng,
        )
        outs.append(out_i[0])
        lses.append(lse_i[0])
        if inputs.return_attn_probs:
            p = reference_probs(
                args[0], args[1], args[3], args[4],
                inputs.softmax_scale, inputs.is_causal, inputs.softcap,
                key_intervals=intervals,
            )[0]
            padded = p.new_zeros(H, inputs.max_seqlen_q, inputs.max_seqlen_k)
            padded[:, : p.shape[1], : p.shape[2]] = p[:, : inputs.max_seqlen_q, : inputs.max_seqlen_k]
            probs.append(padded)
    tail = total_q - cu_q[-1]
    if tail:
        outs.append(q.new_zeros(tail, H, v.shape[-1]))
        lses.append(torch.full((H, tail), float("-inf"), device=q.device))
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, H, v.shape[-1])
    lse = torch.cat(lses, 1) if lses else torch.zeros(H, 0, device=q.device)
    return out, lse, (torch.stack(probs) if inputs.return_attn_probs and probs else None)
