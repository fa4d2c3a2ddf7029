"""Debug entries for tests: the attention-dropout keep-mask a call used.

A call with ``dropout_p > 0`` draws its int64 ``(seed, offset)`` from torch's default
generator for the query's device (:func:`flash_dmattn.dropout.draw_rng`) and keeps entry
``(b, h, i, j)`` by a pure function of those and the coordinates. To rebuild the mask of a
call, draw its rng the same way from the same generator state, then ask for the mask::

    torch.manual_seed(0)
    rng = flash_dmattn.testing.dropout_rng(q.device)      # what the next call draws
    torch.manual_seed(0)
    out = flash_dmattn_func(q, k, v, dropout_p=0.1)
    keep = flash_dmattn.testing.dropout_mask(rng, B, H, Lq, Lk, 0.1)   # (B, H, Lq, Lk) bool
    # out == reference attention with p replaced by p * keep / 0.9

For packed sequences (``flash_dmattn_varlen_func``) sequence ``i`` is batch ``i`` and its rows
and keys count from the sequence's start: its mask is ``dropout_mask(rng, n, H, max_seqlen_q,
max_seqlen_k, p)[i, :, :lq_i, :lk_i]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dropout import check_dropout_p, dense_keep_mask, draw_rng


def dropout_rng(device) -> Tensor:
    """Draw an rng tensor exactly as a dropout call on ``device`` does (it advances the
    generator the same way): int64 ``(seed, offset)``."""
    return draw_rng(torch.device(device))


def dropout_mask(rng: Tensor, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> Tensor:
    """Bool ``(batch, num_heads, seqlen_q, seqlen_k)``, True where a call with this ``rng``
    and ``dropout_p`` kept the probability (on ``rng``'s device). Materialises the whole
    mask: a testing aid for small shapes."""
    p = check_dropout_p(dropout_p)
    if not isinstance(rng, Tensor) or rng.dtype != torch.int64 or rng.numel() < 2:
        raise TypeError("rng must be the int64 (seed, offset) tensor of a call "
                        "(flash_dmattn.testing.dropout_rng)")
    with torch.no_grad():
        return dense_keep_mask(rng, p, int(batch), int(num_heads), int(seqlen_q), int(seqlen_k))
