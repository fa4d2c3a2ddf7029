"""The ``auto`` gather policy's verdicts (:mod:`.gather`): whether gathering beats tile skipping
(:func:`prefers_tiles`), the plan's two totals on their way to the host behind an event
(:class:`TotalsToHost`), and the memo that lets a lagged plan follow the last counted alike
call instead of waiting for its own totals.

The memo lives for the process: one entry per (device, mask shape, lengths, causal, block
sizes), at most :data:`_LAGGED_KEYS` of them, the least recently counted dropped first. It
changes only how fast a call runs, never its result (either verdict computes the same
attention); tests clear it between cases.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Tuple

import torch

# Use gather mode when it visits at most this fraction (numerator, denominator) of the key
# tiles that tile skipping would visit. Gathered tiles always mask per element and load their
# K/V rows by index, so they cost a little more than a partial tile of the plain path.
GATHER_MAX_RATIO = (3, 4)


def prefers_tiles(live_tiles: int, gathered_tiles: int) -> bool:
    """The ``auto`` policy: tile skipping unless gathering visits at most ``GATHER_MAX_RATIO``
    of the live tiles (integer form, the same test the bits kernels make on the device)."""
    num, den = GATHER_MAX_RATIO
    return gathered_tiles * den > live_tiles * num


class TotalsToHost:
    """The totals of one auto plan copied to the host behind an event: :meth:`values` waits
    for the work queued before it, not for what was queued after it; ``planned_with`` is the
    verdict the call was planned with (None: its own totals)."""

    def __init__(self, totals: torch.Tensor, planned_with: Optional[bool] = None):
        self.planned_with = planned_with
        self.read = None
        self.event = None
        if totals.is_cuda:
            self.host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
            self.host.copy_(totals, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(totals.device))
        else:
            self.host = totals

    def values(self):
        if self.read is None:
            if self.event is not None:
                self.event.synchronize()
            self.read = self.host.tolist()
        return self.read

    def gathers(self, capturing: bool, wait: bool = True) -> Optional[bool]:
        """Whether the totals choose gathering; while capturing (no event may be waited on
        or queried) the totals if already read, else the verdict this call was planned with;
        with ``wait`` False that verdict too while the totals are still on their way (a call
        planned from its own totals, ``planned_with`` None, is always waited for)."""
        if self.read is None:
            if capturing:
                return self.planned_with
            if (not wait and self.planned_with is not None and self.event is not None
                    and not self.event.query()):
                return self.planned_with
        return not prefers_tiles(*self.values())


class _LaggedTotals:
    """The last counted totals of alike lagged plans and how many plans have used them."""

    __slots__ = ("on_host", "calls")

    def __init__(self, on_host: "TotalsToHost"):
        self.on_host = on_host
        self.calls = 0


# Lagged plans of alike calls count their tiles (a zeroed device counter, a pinned copy and
# an event: host time on every call of a host-bound forward) every this many calls; the
# others follow the last count. Tests set 1.
LAGGED_SAMPLE_EVERY = 8
# Totals of the last lagged auto plan per (device, mask shape, lengths, causal, blocks).
_LAGGED_TOTALS: "OrderedDict[tuple, _LaggedTotals]" = OrderedDict()
_LAGGED_KEYS = 64


def lagged_verdict(key: tuple, capturing: bool) -> Tuple[Optional[bool], bool]:
    """``(verdict, sample)`` of a lagged ``auto`` plan with memo ``key``: the verdict of the last
    counted alike plan (None when there was none: decide from this call's own totals) and
    whether this call counts its tiles for later ones (every :data:`LAGGED_SAMPLE_EVERY`-th)."""
    memo = _LAGGED_TOTALS.get(key)
    if memo is None:
        return None, True
    verdict = memo.on_host.gathers(capturing, wait=False)
    memo.calls += 1
    return verdict, memo.calls % LAGGED_SAMPLE_EVERY == 0


def remember_totals(key: tuple, on_host: "TotalsToHost") -> None:
    """Keep ``on_host`` as the totals that later lagged plans with memo ``key`` follow (the
    least recently counted keys beyond :data:`_LAGGED_KEYS` are dropped)."""
    memo = _LAGGED_TOTALS.get(key)
    if memo is None:
        memo = _LAGGED_TOTALS[key] = _LaggedTotals(on_host)
    memo.on_host = on_host
    _LAGGED_TOTALS.move_to_end(key)
    while len(_LAGGED_TOTALS) > _LAGGED_KEYS:
        _LAGGED_TOTALS.popitem(last=False)
