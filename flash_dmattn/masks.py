"""Structured masks: masks described in O(L) numbers instead of an (Lq, Lk) tensor.

:class:`KeyIntervals` is the mask of Dynamic Mask Attention. For every mask the library builds
from a per-key bias, the queries that see a key form one interval of query positions:

* a shared top-W selection (not causal): a selected key is seen by every query, the others by
  none;
* a causal top-W selection per query (query ``i`` keeps the W best keys of ``0..i``): key ``j``
  is seen by queries ``j .. t_j - 1``, where ``t_j`` is the position of the W-th key (in
  position order) that outranks ``j`` — the candidate sets are nested prefixes, so once W
  better keys have appeared, ``j`` is never kept again;
* padding keys: the empty interval; a sliding window ``[j, j + w)``; attention sinks: every
  query.

So the mask is two integers per key, and query ``i`` sees key ``j`` iff
``start[j] <= pos(i) < end[j]``, where ``pos(i) = i + Lk - Lq`` is the query's position in
the key sequence (bottom-right alignment, as ``is_causal``; ``pos(i) = i`` when ``Lq == Lk``).
Intervals built over the whole sequence therefore also serve a KV-cache step whose queries
are the last ``Lq`` positions.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["KeyIntervals"]

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
# Bounds are stored as int32; anything outside this range means "before every query" or
# "after every query" alike, so clamping keeps the mask unchanged.
_CLAMP = 1 << 30


def _check_window(window) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"KeyIntervals window must be a positive int or None, got {window!r}")
    return window


class KeyIntervals:
    """A key-interval attention mask: query position ``p`` sees key ``j`` iff
    ``start[..., j] <= p < end[..., j]``.

    Pass it as ``attn_mask=`` to :func:`flash_dmattn.flash_dmattn_func` (and the functions of
    :func:`flash_dmattn.flash_dmattn_func_auto`). It combines with ``is_causal`` and
    ``attn_bias`` like any mask: with ``is_causal`` a key must also satisfy ``j <= pos(i)``.

    Args:
        start, end: integer tensors (int32 or int64; any other integer dtype is widened) on
            the query's device, of shapes that broadcast together to ``(B or 1, H or Hkv or 1,
            Lk)`` (fewer dims are left-padded with 1s). Values are query positions
            ``pos(i) = i + Lk - Lq``; values outside ``0..Lk`` are allowed (clipped
            implicitly), and ``start >= end`` is the empty interval.

        window: optional promise about the selection, for the kernels' planning: no query
            position sees more than ``window`` keys, and each position sees at most one key
            that the position before it did not. Top-``window`` selections
            (:func:`flash_dmattn.utils.mask.topk_intervals` sets it) and sliding windows of
            ``window`` keys keep it. With it the planner sizes its per-tile key lists
            (``window + 128`` keys a tile) without waiting for the GPU; a mask that breaks
            the promise gives wrong results, so leave it None unless the mask is one of those.

    The two bounds are kept as one int32 tensor ``bounds`` of shape ``(2, Bx, Hx, Lk)``
    (:attr:`bounds`), made once; O(B·H·Lk) memory, never (Lq, Lk).

    Example (self-attention, ``L`` keys, a sliding window of 128 plus 4 sink tokens)::

        j = torch.arange(L)
        start = torch.where(j < 4, 0, j)
        end = torch.where(j < 4, L, j + 128)
        out = flash_dmattn_func(q, k, v, attn_mask=KeyIntervals(start, end), is_causal=True)
    """

    __slots__ = ("bounds", "window")

    def __init__(self, start: torch.Tensor, end: torch.Tensor, window: Optional[int] = None):
        self.window = _check_window(window)
        for name, t in (("start", start), ("end", end)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"KeyIntervals {name} must be an integer torch.Tensor, got "
                    f"{type(t).__name__}"
                )
            if t.dtype not in _INT_DTYPES:
                raise TypeError(
                    f"KeyIntervals {name} must be an integer tensor (int32 or int64), got "
                    f"{t.dtype} with shape {tuple(t.shape)}"
                )
            if t.dim() < 1 or t.dim() > 3:
                raise ValueError(
                    f"KeyIntervals {name} must have 1 to 3 dims (batch, heads, keys), got shape "
                    f"{tuple(t.shape)}"
                )
        if start.device != end.device:
            raise ValueError(
                f"KeyIntervals start is on {start.device} but end is on {end.device}"
            )
        try:
            shape = torch.broadcast_shapes(start.shape, end.shape)
        except RuntimeError as exc:
            raise ValueError(
                f"KeyIntervals start {tuple(start.shape)} and end {tuple(end.shape)} do not "
                f"broadcast together"
            ) from exc
        shape = (1,) * (3 - len(shape)) + tuple(shape)

        def norm(t):
            t = t.reshape((1,) * (3 - t.dim()) + tuple(t.shape)).expand(shape)
            return t.to(torch.int64).clamp(-_CLAMP, _CLAMP).to(torch.int32)

        self.bounds = torch.stack([norm(start), norm(end)])

    @classmethod
    def from_bounds(cls, bounds: torch.Tensor, window: Optional[int] = None) -> "KeyIntervals":
        """Wrap an already normalised ``(2, Bx, Hx, Lk)`` int32 tensor (no copy)."""
        obj = cls.__new__(cls)
        obj.bounds = bounds
        obj.window = _check_window(window)
        return obj

    # ------------------------------------------------------------------------------------
    @property
    def start(self) -> torch.Tensor:
        """``(Bx, Hx, Lk)`` int32: the first query position that sees each key."""
        return self.bounds[0]

    @property
    def end(self) -> torch.Tensor:
        """``(Bx, Hx, Lk)`` int32: one past the last query position that sees each key."""
        return self.bounds[1]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """``(Bx, Hx, Lk)``."""
        return tuple(self.bounds.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.bounds.device

    def to(self, device) -> "KeyIntervals":
        return KeyIntervals.from_bounds(self.bounds.to(device), self.window)

    def visible(self, query_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``(Bx, Hx, n, Lk)``: which keys each of the query positions ``query_pos (n,)``
        sees. Evaluate it on bounded chunks of queries: it is (n, Lk)."""
        p = query_pos.to(self.bounds.device, torch.int64).view(1, 1, -1, 1)
        return (self.start.unsqueeze(2) <= p) & (p < self.end.unsqueeze(2))

    def to_dense(self, seqlen_q: int, seqlen_k: Optional[int] = None) -> torch.Tensor:
        """The equivalent bool mask ``(Bx, Hx, Lq, Lk)`` (for tests and small problems)."""
        lk = self.shape[2]
        if seqlen_k is not None and seqlen_k != lk:
            raise ValueError(f"KeyIntervals cover {lk} keys, not seqlen_k={seqlen_k}")
        pos = torch.arange(seqlen_q, device=self.device) + (lk - seqlen_q)
        return self.visible(pos)

    def __repr__(self) -> str:
        return f"KeyIntervals(shape={self.shape}, device={self.device})"
