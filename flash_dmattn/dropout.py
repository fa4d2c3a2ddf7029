"""Attention dropout's random stream: where it comes from and which entries it keeps.

Every implementation (the torch oracle, the Triton kernels, the cuda backend's sm_90
kernels: ``csrc/flash_dmattn/dropout.cuh``) decides whether probability
``P[b, h, i, j]`` is kept from the same counter-based generator, so forward and backward
regenerate the mask instead of storing it and any implementation can reproduce any other's:

* a call draws its **rng tensor**, int64 ``(seed, offset)`` on the query's device, from
  torch's default generator of that device (:func:`draw_rng`): ``torch.manual_seed`` makes
  calls reproducible, every call advances the generator, and the draw is an ordinary random
  op, so CUDA-graph capture and ``torch.compile`` handle it like any other;
* one Philox4x32-7 evaluation (:data:`ROUNDS`) serves 16 consecutive query rows of one key (the stream is
  **key-major**): entry ``(b, h, i, j)`` (batch -- for packed sequences the sequence index --,
  query head, query row and key position, rows and keys counted from the start of the
  sequence) reads byte ``i % 4`` (low byte first) of output word ``(i % 16) // 4`` of
  Philox4x32-7 keyed by ``seed`` (its low and high 32 bits) at counter ``(j, i // 16, b * H +
  h, offset mod 2**32)``: Triton's ``tl.philox`` with those words, reimplemented exactly
  below. Byte ``k`` of the 16 output bytes (word ``k // 4``, byte ``k % 4``) is row ``16 * (i
  // 16) + k``. A kernel's query tile is a whole number of 16-row groups, so whatever keys it
  visits -- a key tile, a gathered list, scattered key-interval picks -- it needs one
  evaluation per (16-row group, key): the same count for every walk, where a stream of 16
  consecutive keys would need one per (row, key) wherever the listed keys are scattered;
* the entry is kept iff that byte is at least :func:`keep_threshold` ``(p) = round(p *
  256)``, compared as integers so every implementation agrees bit for bit: ``p`` is rounded
  to a multiple of ``1/256`` (as PyTorch's fused attention kernels round it to 8 bits), so
  the keep rate is ``1 - round(256 p) / 256``, within ``1/512`` of ``1 - p``; ``p <= 1/512``
  keeps everything and ``p >= 1 - 1/512`` drops everything;
* kept probabilities are scaled by ``1 / (1 - p)`` with the ``p`` asked for (as PyTorch's
  fused kernels do; the rounding of the keep rate is not compensated): ``O = dropout(P) @
  V`` as in SDPA.

The mask depends on nothing but those coordinates: not on tile sizes, splits or which kernel
ran. The rng tensor may carry a third element, the batch index of the call's first row, for
implementations that run a packed batch one sequence at a time.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

# Philox4x32 constants: multipliers of the round function and the Weyl sequence of the key.
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
# Rounds of the dropout stream's Philox: 7, the count of FlashAttention's and Apex's fused
# dropout. Salmon et al. ("Parallel random numbers: as easy as 1, 2, 3") find Philox4x32
# passes BigCrush from 7 rounds; 10 is their margin. The generator's cost is proportional to
# its rounds, and the kernels pay it in their inner loop, once per (16 query rows, key).
ROUNDS = 7
_MASK32 = 0xFFFFFFFF
# Both numbers of a call are drawn below 2**62; the offset's low 32 bits are a counter word.
_DRAW_HIGH = 1 << 62


def check_dropout_p(dropout_p) -> float:
    """``dropout_p`` as a float in ``[0, 1)``; ``TypeError`` / ``ValueError`` otherwise."""
    if dropout_p is None:
        return 0.0
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:  # the usual case, on every call
        return dropout_p
    if isinstance(dropout_p, (bool, str, bytes)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} "
                        f"{dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return p


def draw_rng(device) -> Tensor:
    """A call's int64 ``(seed, offset)`` drawn from torch's default generator for ``device``
    (one random op, no host sync: CUDA graphs replay it with fresh numbers)."""
    return torch.randint(0, _DRAW_HIGH, (2,), dtype=torch.int64, device=device)


def keep_threshold(dropout_p: float) -> int:
    """The random byte below which an entry is dropped: ``round(p * 256)``, in ``[0, 256]``
    (``p`` rounded to 8 bits)."""
    return int(round(dropout_p * 256))


def keep_scale(dropout_p: float) -> float:
    """The factor of a kept probability, ``1 / (1 - p)``."""
    return 1.0 / (1.0 - dropout_p)


def _mulhilo(a: Tensor, m: int):
    """High and low 32-bit words of ``a * m`` for int64 ``a`` in ``[0, 2**32)`` and a 32-bit
    constant ``m``, in int64 arithmetic (16-bit halves of ``m`` keep every product < 2**48)."""
    x = a * (m >> 16)
    y = a * (m & 0xFFFF)
    lo = (((x & 0xFFFF) << 16) + y) & _MASK32
    hi = (x + (y >> 16)) >> 16
    return hi, lo


def philox4x32(k0: Tensor, k1: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor,
               rounds: int = ROUNDS):
    """The four output words of Philox4x32 (``rounds`` rounds) with key ``(k0, k1)`` and
    counter ``(c0, c1, c2, c3)``: broadcasting int64 tensors holding 32-bit values, results
    likewise."""
    for _ in range(rounds):
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor) -> Tensor:
    """First output word (int64 in ``[0, 2**32)``) of the stream's Philox4x32 at counter
    ``(c0, c1, c2, c3)`` keyed by the 64-bit ``seed`` (its low word first): Triton's
    ``tl.philox`` with ``n_rounds=ROUNDS``."""
    return philox4x32(seed & _MASK32, (seed >> 32) & _MASK32, c0, c1, c2, c3)[0]


def keep_mask(rng: Tensor, dropout_p: float, batch: Tensor, num_heads: int, head: Tensor,
              rows: Tensor, cols: Tensor) -> Tensor:
    """Bool: whether entries ``(batch, head, rows, cols)`` are kept (int64 index tensors that
    broadcast against each other; ``batch`` counts from the rng tensor's first batch)."""
    rng = rng.to(torch.int64)
    seed, offset = rng[0], rng[1] & _MASK32
    if rng.numel() > 2:
        batch = batch + rng[2]
    words = philox4x32(seed & _MASK32, (seed >> 32) & _MASK32, cols, rows >> 4,
                       batch * num_heads + head, offset)
    pick = (rows >> 2) & 3
    word = torch.where(pick == 0, words[0], torch.where(pick == 1, words[1], torch.where(
        pick == 2, words[2], words[3])))
    return ((word >> ((rows & 3) * 8)) & 0xFF) >= keep_threshold(dropout_p)


def dense_keep_mask(rng: Tensor, dropout_p: float, batch: int, num_heads: int, seqlen_q: int,
                    seqlen_k: int, rows: Optional[slice] = None) -> Tensor:
    """Bool ``(batch, num_heads, rows, seqlen_k)``: the keep-mask of query rows ``rows`` (all
    by default) of a ``(batch, num_heads, seqlen_q, seqlen_k)`` call, on ``rng``'s device."""
    dev = rng.device
    r0, r1 = (0, seqlen_q) if rows is None else (rows.start, rows.stop)
    b = torch.arange(batch, device=dev, dtype=torch.int64).view(-1, 1, 1, 1)
    h = torch.arange(num_heads, device=dev, dtype=torch.int64).view(1, -1, 1, 1)
    i = torch.arange(r0, r1, device=dev, dtype=torch.int64).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=dev, dtype=torch.int64).view(1, 1, 1, -1)
    return keep_mask(rng, dropout_p, b, num_heads, h, i, j)
