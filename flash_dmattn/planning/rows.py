"""Mask and bias rows the kernels can read vectorised: 16-byte aligned, copied when they are not.

Both the triton and the cuda backend read a per-query mask or bias through its row stride; a
row that does not start on a 16-byte boundary is read element by element, so such a tensor is
copied into zero-padded rows first (:func:`aligned_rows`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# A per-query mask or bias whose rows are not 16-byte aligned (odd Lk, or an odd row stride)
# is read element by element, which Triton neither vectorises nor software-pipelines; on sm_90
# that compile also spills heavily (tools/compile_check.py --seqlen 500: 780 bytes in the
# forward with a mask, 584 with a full bias). Such a tensor is copied into zero-padded rows of
# a multiple of ROW_ALIGN elements first, for reading only (gradients keep the input's shape).
ROW_ALIGN = 64


def aligned_rows(t: Optional[torch.Tensor], seqlen_q: int,
                 seqlen_k: int) -> Tuple[Optional[torch.Tensor], bool]:
    """``(t, padded)``: a per-query mask / bias with 16-byte aligned rows, copied if needed.

    The copy has the same shape and values (a view of the first ``seqlen_k`` columns of
    zero-padded rows), so kernels given ``MASK_PAD`` / ``BIAS_PAD`` may bound their reads by
    the row stride. Broadcast and per-key tensors are returned as they are (their rows are
    small or shared). Equivalent plain PyTorch::

        rows = torch.zeros(*t.shape[:3], round_up(seqlen_k, 64), dtype=t.dtype)
        rows[..., :seqlen_k] = t
        t = rows[..., :seqlen_k]
    """
    if t is None or seqlen_q <= 1 or t.size(2) != seqlen_q or t.size(3) != seqlen_k:
        return t, False
    vec = max(1, 16 // t.element_size())  # elements per 16 bytes
    if (t.stride(3) == 1 and t.stride(2) % vec == 0 and seqlen_k % vec == 0
            and all(t.stride(d) % vec == 0 or t.size(d) == 1 for d in (0, 1))):
        return t, False
    bx, hx = t.shape[0], t.shape[1]
    width = -(-seqlen_k // ROW_ALIGN) * ROW_ALIGN
    rows = torch.empty((bx, hx, seqlen_q, width), dtype=t.dtype, device=t.device)
    rows[..., seqlen_k:] = 0
    rows[..., :seqlen_k] = t.detach()
    return rows[..., :seqlen_k], True
