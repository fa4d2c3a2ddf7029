"""Whether a per-key mask's forward runs its uncut rows without the mask: a lagged decision.

A per-key mask's list row (one query tile of one batch and mask head) is *uncut* when the
mask hides no key of any tile it lists: its partial tiles are partial only by causality or
a ragged end, so the forward needs no mask there at all. A kernel that never reads the
mask's bits runs such rows a few percent faster than the one that reads them beside every
entry (the block-sparse suite, benchmarks/results/<gpu>/SUMMARY.md), and a block-sparse mask
whose blocks align with the key tiles leaves every row uncut.

Which rows are uncut is known on the device only (the planner counts each row's cut tiles
in ``TileLists.fwd_cut``); the host does not wait for it. So the forward launches either

* one kernel that reads the bits (always correct), or
* two kernels: every row without the mask, on counts that give cut rows no tile (so they
  store zeros), then a net that runs the cut rows again with the bits (``CUT_ROWS``, a grid
  of about one wave that checks the cut counts with a vector load and does nothing when
  there are none). A guard in the first kernel instead (a load deciding whether the row
  runs) costs a measurable share of the block-sparse forward; the counts cost nothing there:
  the kernel loads a count anyway.

Both compute the same attention. Under ``auto`` the second is chosen when no alike call
(same device, mask shape, lengths, causality, blocks) sampled since the last look had a cut
row. The planner raises a device flag when a row is cut; every ``SAMPLE_EVERY``-th call
copies the flag to pinned host memory behind an event and clears it, and a later call reads
the copy once the event has passed -- nothing waits, and the host cost (two small copies and
an event, tens of microseconds) is paid once per sample. Calls of fewer than ``MIN_WAVES``
waves of programs never split: their time is mostly the host's, and the split adds a launch.
Tests force one way with the private hook ``_FORCED``.

The verdicts of alike calls live in :data:`VERDICTS`, a :class:`VerdictMemo` for the
process's lifetime: at most ``max_keys`` keys, the least recently used dropped first. It
changes only which of the two launches a call takes, never its result; tests give each case
a fresh one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from .decode import sm_count

# Private test hook: True always launches the two kernels, False always the one; None (the
# library's behaviour) decides per call as described above.
_FORCED: Optional[bool] = None
SAMPLE_EVERY = 8   # calls per look at the planner's flag (tests set 1)
MIN_WAVES = 4      # programs per SM below which a call never splits (tests set 0)


class PlainRows:
    """One call's decision: ``cut_flag`` (for the planner to raise, or None) and
    :meth:`split` (asked once, after planning)."""

    def __init__(self, fixed: Optional[bool], memo: "Optional[_LaggedVerdict]" = None,
                 capturing: bool = False):
        self.fixed, self.memo, self.capturing = fixed, memo, capturing
        self.cut_flag = memo.flag if memo is not None else None

    def split(self) -> bool:
        """Whether to launch the two kernels; under ``auto`` also takes this call's sample."""
        if self.memo is None:
            return bool(self.fixed)
        if self.capturing:
            return bool(self.memo.verdict)  # events may not be queried while capturing
        self.memo.refresh()
        split = bool(self.memo.verdict)
        self.memo.sample()
        return split


def plan_plain_rows(key: Optional[tuple], device: torch.device, n_programs: int) -> PlainRows:
    """The decision object of a call with per-key lists and mask bits; ``key`` says which
    calls are alike (None: lists planned by the caller, no flag to read: one
    kernel), ``n_programs`` is the forward's grid size."""
    if _FORCED is not None or key is None:
        return PlainRows(bool(_FORCED))
    if device.type == "cuda" and n_programs < MIN_WAVES * sm_count(device):
        return PlainRows(False)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    # A new verdict's buffers would come from the graph's pool while capturing: none then.
    memo = VERDICTS.get(key, device, create=not capturing)
    if memo is None:
        return PlainRows(False)
    return PlainRows(None, memo, capturing)


class VerdictMemo:
    """The :class:`_LaggedVerdict` of each key of alike calls, at most ``max_keys`` of them,
    the least recently used dropped first. Not a ``functools.lru_cache``: an entry is device
    state that every call updates, and a call under graph capture must look one up without
    creating it."""

    def __init__(self, max_keys: int = 64):
        self.max_keys = max_keys
        self._entries: "OrderedDict[tuple, _LaggedVerdict]" = OrderedDict()

    def get(self, key: tuple, device: torch.device, create: bool) -> "Optional[_LaggedVerdict]":
        """``key``'s verdict, now the most recently used; when it has none, a new one on
        ``device`` if ``create``, else None."""
        memo = self._entries.get(key)
        if memo is None:
            if not create:
                return None
            memo = self._entries[key] = _LaggedVerdict(device)
            while len(self._entries) > self.max_keys:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return memo

    def __len__(self) -> int:
        return len(self._entries)


# The process's verdicts (see the module docstring); tests replace it with a fresh one.
VERDICTS = VerdictMemo()


class _LaggedVerdict:
    """The planner's cut flag for alike calls, its last copy on the host and the verdict.
    Raced updates from several streams can only blur the verdict, which is a speed choice."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.verdict: Optional[bool] = None  # True: no cut row; None: no sample read yet
        self.pending = False
        self.calls = 0

    def refresh(self) -> None:
        if self.pending and (self.event is None or self.event.query()):
            self.verdict = int(self.host[0]) == 0
            self.pending = False

    def sample(self) -> None:
        due = self.calls % SAMPLE_EVERY == 0
        self.calls += 1
        if not due or self.pending:
            return
        # Queued after this call's planner: the copy holds every cut raised since the last
        # sample, this call's included.
        self.host.copy_(self.flag, non_blocking=True)
        self.flag.zero_()
        if self.event is not None:
            self.event.record()
        self.pending = True

