"""Which local attention calls compute one (query shard, key block) pair of a ring step.

A rank's queries and a block of keys are each a few *segments* of consecutive global
positions (one for the contiguous layout, two for zigzag). Under a causal mask a segment pair
is fully visible, fully hidden, or a diagonal. The local kernels know one causal rule,
bottom-right aligned: key column ``j`` is visible from query row ``i`` iff ``j <= i + Lk - Lq``.
The planner covers the visible pairs with as few calls as it can, each a rectangle of local
query rows and key columns on which that rule (or no causal rule) gives exactly the global
visibility; hidden pairs are left out, and with them whole blocks (contiguous layout, keys
after every query).

Every call also names the global positions of its query rows (``query_ranges``, in row order),
so that key-interval bounds (positions compared against each query's position) can be
translated to the call's rows even when its rows are two pieces of the sequence (a zigzag
shard): positions increase with the rows, so an interval of positions is an interval of rows
(:func:`.local.translate_bounds`). ``consecutive_queries`` asks for calls whose rows are
consecutive positions (one query range each) instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

Segment = Tuple[int, int]  # (global start, length)

_ALL, _NONE = "all", "none"


@dataclass(frozen=True)
class Call:
    """One local attention call of a block.

    ``rows``: local query rows ``[r0, r1)``; ``cols``: key columns ``[c0, c1)`` of the block;
    ``causal``: the bottom-right causal rule applies; ``query_pos``: global position of row
    ``r0`` (rows are consecutive positions whenever the plan was asked for it);
    ``key_ranges``: the global positions of the columns, as ``[start, end)`` ranges in column
    order; ``query_ranges``: those of the rows, likewise (None: one range from ``query_pos``).
    """

    rows: Tuple[int, int]
    cols: Tuple[int, int]
    causal: bool
    query_pos: int
    key_ranges: Tuple[Tuple[int, int], ...]
    query_ranges: Optional[Tuple[Tuple[int, int], ...]] = None

    @property
    def row_ranges(self) -> Tuple[Tuple[int, int], ...]:
        """The global positions of the rows as ``[start, end)`` ranges in row order."""
        if self.query_ranges is not None:
            return self.query_ranges
        return ((self.query_pos, self.query_pos + self.num_rows),)

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def num_cols(self) -> int:
        return self.cols[1] - self.cols[0]


def _relation(offset: int, rows: int, cols: int):
    """Visibility of ``cols`` keys from ``rows`` queries when key ``jj`` is visible from query
    ``ii`` iff ``jj <= ii + offset``: all, none, or ``("diag", offset)``."""
    if offset >= cols - 1:
        return _ALL
    if offset <= -rows:
        return _NONE
    return ("diag", offset)


def _offsets(segs: Sequence[Segment]) -> List[int]:
    out, acc = [], 0
    for _, length in segs:
        out.append(acc)
        acc += length
    return out


def plan_block(q_segs: Sequence[Segment], k_segs: Sequence[Segment], causal: bool,
               consecutive_queries: bool) -> List[Call]:
    """The calls that compute queries ``q_segs`` against the key block ``k_segs``.

    Every visible (query, key) pair is in exactly one call and no hidden pair is visible in
    any call. ``consecutive_queries``: every call's rows must be consecutive positions.
    """
    q_off, k_off = _offsets(q_segs), _offsets(k_segs)

    def global_rel(i: int, j: int):
        if not causal:
            return _ALL
        (qa, m), (kb, n) = q_segs[i], k_segs[j]
        return _relation(qa - kb, m, n)

    rel = [[global_rel(i, j) for j in range(len(k_segs))] for i in range(len(q_segs))]

    def make_call(qi: Sequence[int], kj: Sequence[int]) -> Optional[Call]:
        """One call over the query segments ``qi`` and key segments ``kj`` (each consecutive
        in local order), if some causal flag reproduces every pair's visibility."""
        if consecutive_queries:
            for a, b in zip(qi, qi[1:]):
                if q_segs[a][0] + q_segs[a][1] != q_segs[b][0]:
                    return None
        r0, r1 = q_off[qi[0]], q_off[qi[-1]] + q_segs[qi[-1]][1]
        c0, c1 = k_off[kj[0]], k_off[kj[-1]] + k_segs[kj[-1]][1]
        needs_causal = any(rel[i][j] != _ALL for i in qi for j in kj)
        if needs_causal:
            shift = (c1 - c0) - (r1 - r0)
            for i in qi:
                for j in kj:
                    local = _relation((q_off[i] - r0) - (k_off[j] - c0) + shift,
                                      q_segs[i][1], k_segs[j][1])
                    if local != rel[i][j]:
                        return None
        ranges = tuple((k_segs[j][0], k_segs[j][0] + k_segs[j][1]) for j in kj)
        rows = tuple((q_segs[i][0], q_segs[i][0] + q_segs[i][1]) for i in qi)
        return Call((r0, r1), (c0, c1), needs_causal, q_segs[qi[0]][0], ranges, rows)

    def consecutive(idx: Sequence[int]) -> bool:
        return all(b == a + 1 for a, b in zip(idx, idx[1:]))

    live_q = [i for i in range(len(q_segs)) if any(r != _NONE for r in rel[i])]
    if not live_q:
        return []
    live_k = [j for j in range(len(k_segs)) if any(rel[i][j] != _NONE for i in live_q)]
    if consecutive(live_q) and consecutive(live_k):
        call = make_call(live_q, live_k)
        if call is not None:
            return [call]
    calls = []
    for i in live_q:
        keys = [j for j in range(len(k_segs)) if rel[i][j] != _NONE]
        call = make_call([i], keys) if consecutive(keys) else None
        if call is not None:
            calls.append(call)
            continue
        for j in keys:
            call = make_call([i], [j])
            if call is not None:
                calls.append(call)
            else:  # a diagonal off the bottom-right corner
                calls.extend(_diagonal_calls(q_segs[i], k_segs[j], q_off[i], k_off[j], rel[i][j][1]))
    return calls


def _diagonal_calls(q_seg: Segment, k_seg: Segment, row0: int, col0: int,
                    offset: int) -> List[Call]:
    """One query segment against one key segment (local rows from ``row0``, columns from
    ``col0``) where key ``jj`` is visible from query ``ii`` iff ``jj <= ii + offset``, for any
    diagonal ``offset``: the rows that see part of the keys as one bottom-right causal call on
    the columns they reach, the rows that see every key as one call without a causal rule
    (rows that see none are left out). Layouts never need it (a rank's segments and another
    block's are the same or disjoint, and a segment against itself is the bottom-right
    diagonal); segments that overlap otherwise do."""
    (qa, m), (kb, n) = q_seg, k_seg
    first = max(0, -offset)  # rows before it see no key
    full = min(m, n - 1 - offset)  # rows from it see every key
    calls = []
    if full > first:
        cols = full + offset  # what row full - 1 sees; the bottom-right rule gives jj <= ii + offset
        calls.append(Call((row0 + first, row0 + full), (col0, col0 + cols), True, qa + first,
                          ((kb, kb + cols),)))
    if full < m:
        calls.append(Call((row0 + full, row0 + m), (col0, col0 + n), False, qa + full,
                          ((kb, kb + n),)))
    return calls
