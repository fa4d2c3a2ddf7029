"""Whether a per-key mask's forward runs its uncut rows without the mask: a lagged decision.

A per-key mask's list row (one query tile of one batch and mask head) is *uncut* when the
mask hides no key of any tile it lists: its partial tiles are partial only by causality or
a ragged end, so the forward needs no mask there at all. A kernel that never reads the
mask's bits runs such rows 3-6 % faster than the one that reads them beside every entry
(T3 on an H200: 1.07-1.10 against 1.12-1.15 ms, ``t3-probe-2026-11-22j-*.log``), and a
block-sparse mask whose blocks align with the key tiles leaves every row uncut.

Which rows are uncut is known on the device only (the planner counts each row's cut tiles
in ``TileLists.fwd_cut``); the host does not wait for it. So the forward launches either

* one kernel that reads the bits (always correct), or
* two kernels: every row without the mask, on counts that give cut rows no tile (so they
  store zeros), then a net that runs the cut rows again with the bits (``CUT_ROWS``, a grid
  of about one wave that checks the cut counts with a vector load and does nothing when
  there are none). A guard in the first kernel instead (a load deciding whether the row
  runs) cost 2.5 % of T3; the counts cost nothing there: the kernel loads a count anyway.

Both compute the same attention. The second is chosen (``auto``) when the previous call with
the same shapes had no cut row at all: its count reaches the host on a side stream, so
neither stream nor host waits for it. ``FLASH_DMATTN_TRITON_PLAIN_ROWS`` = ``never`` /
``always`` forces one way (A/B timing, tests).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import torch

PLAIN_ROWS_ENV = "FLASH_DMATTN_TRITON_PLAIN_ROWS"
_MODES = ("auto", "never", "always")


def plain_rows_mode() -> str:
    """``auto`` (default), ``never`` or ``always`` (see ``PLAIN_ROWS_ENV``)."""
    mode = os.environ.get(PLAIN_ROWS_ENV, "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"{PLAIN_ROWS_ENV}={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def split_plain_rows(cut: torch.Tensor, key: tuple) -> bool:
    """Whether this call launches the uncut rows without the mask (and a net for cut rows).

    ``cut``: the call's per-row cut counts (device, ``TileLists.fwd_cut[..., 0]``); ``key``: what makes calls alike (device,
    mask shape, lengths, causality, blocks). Under ``auto``, records this call's verdict for
    the next alike call, unless a CUDA graph is being captured (the decision taken is then
    part of the graph, and either one is correct)."""
    mode = plain_rows_mode()
    if mode != "auto":
        return mode == "always"
    memo = _MEMO.get(key)
    if memo is None:
        memo = _MEMO[key] = _LaggedVerdict()
        while len(_MEMO) > _MEMO_KEYS:
            _MEMO.popitem(last=False)
    _MEMO.move_to_end(key)
    if cut.is_cuda and torch.cuda.is_current_stream_capturing():
        return bool(memo.verdict)  # events may not be queried while capturing
    split = memo.uncut()
    memo.record(cut)
    return split


_MEMO: "OrderedDict[tuple, _LaggedVerdict]" = OrderedDict()
_MEMO_KEYS = 64


class _LaggedVerdict:
    """Whether the last call seen had no cut row; its count travels to the host on a side
    stream. A count still in flight is not replaced, so a host running far ahead of the GPU
    still sees a verdict of some earlier call instead of none."""

    def __init__(self):
        self.verdict: Optional[bool] = None  # None: no alike call finished yet
        self.host: Optional[torch.Tensor] = None
        self.event: Optional[torch.cuda.Event] = None

    def uncut(self) -> bool:
        if self.host is not None and (self.event is None or self.event.query()):
            self.verdict = int(self.host.item()) == 0
            self.host = self.event = None
        return bool(self.verdict)

    def record(self, cut: torch.Tensor) -> None:
        if self.host is not None:
            return
        if not cut.is_cuda:
            self.host = cut.max().reshape(1)
            return
        main = torch.cuda.current_stream(cut.device)
        side = _side_stream(cut.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            worst = cut.max().reshape(1)
            self.host = torch.empty(1, dtype=worst.dtype, pin_memory=True)
            self.host.copy_(worst, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(side)
        cut.record_stream(side)  # the main stream may free ``cut`` before the side reads it


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream
