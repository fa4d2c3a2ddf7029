"""How a sequence is split over the ranks of a context-parallel group.

A sequence of ``L`` tokens is cut into pieces of consecutive positions, one per rank
(contiguous) or two per rank (zigzag):

* ``"contiguous"``: ``P`` pieces; rank ``r`` holds piece ``r`` (with ``n = L / P``: positions
  ``r·n .. (r+1)·n - 1``);
* ``"zigzag"``: ``2P`` pieces; rank ``r`` holds piece ``r`` followed by piece ``2P - 1 - r``.
  Under a causal mask every rank then has the same amount of work (an early piece with few
  visible keys and a late one with many), where the contiguous split gives the last rank
  ``2P - 1`` times the work of the first.

Any ``L`` splits (at least one token per rank): when the number of pieces does not divide
``L``, the first ``L mod pieces`` pieces have one token more than the others (the split of
``torch.tensor_split``), so shards differ by at most one token (two for zigzag).

Queries, keys and values, and every mask or bias dimension that runs along the sequence, are
split the same way. The helpers below cut a whole tensor into a rank's shard, put shards back
together, and give the global positions of a shard (e.g. for rotary embeddings).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..masks import KeyIntervals

__all__ = ["LAYOUTS", "sequence_segments", "shard_segments", "shard_positions", "shard_sequence",
           "unshard_sequence"]

LAYOUTS = ("contiguous", "zigzag")

Segment = Tuple[int, int]  # (global start, length)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _pieces(layout: str, world_size: int) -> int:
    return world_size * (2 if layout == "zigzag" else 1)


def sequence_segments(layout: str, world_size: int, seq_len: int) -> Tuple[Tuple[Segment, ...], ...]:
    """Every rank's pieces of a sequence of ``seq_len`` tokens, ``(global start, length)`` in
    local order, indexed by rank. Every rank gets at least one token."""
    check_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if seq_len < world_size:
        raise ValueError(f"a sequence of {seq_len} tokens leaves some of the {world_size} ranks "
                         f"without a token")
    parts = _pieces(layout, world_size)
    base, extra = divmod(seq_len, parts)
    lengths = [base + (i < extra) for i in range(parts)]
    starts = [sum(lengths[:i]) for i in range(parts)]
    pieces = [(starts[i], lengths[i]) for i in range(parts)]
    if layout == "contiguous":
        return tuple((pieces[r],) for r in range(world_size))
    # Zigzag: a piece of no token (fewer tokens than pieces) is left out.
    return tuple(tuple(p for p in (pieces[r], pieces[parts - 1 - r]) if p[1] > 0)
                 for r in range(world_size))


def shard_segments(layout: str, rank: int, world_size: int, shard_len: Optional[int] = None, *,
                   seq_len: Optional[int] = None) -> Tuple[Segment, ...]:
    """The pieces of rank ``rank``'s shard as ``(global start, length)``, in local order.

    Give ``shard_len`` (every rank holds that many tokens: ``seq_len = shard_len · P``; zigzag
    needs it even) or ``seq_len`` (the whole sequence, any length)."""
    check_layout(layout)
    if (shard_len is None) == (seq_len is None):
        raise ValueError("give shard_len (equal shards) or seq_len (the whole sequence), not both")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if shard_len is not None:
        if layout == "zigzag" and shard_len % 2:
            raise ValueError(
                f"equal zigzag shards need an even number of tokens per rank (two pieces of equal "
                f"length); got {shard_len}. For any length pass seq_len instead"
            )
        seq_len = shard_len * world_size
    return sequence_segments(layout, world_size, seq_len)[rank]


def shard_positions(layout: str, rank: int, world_size: int, shard_len: Optional[int] = None,
                    device=None, *, seq_len: Optional[int] = None) -> torch.Tensor:
    """int64: the global position of each token of the rank's shard (arguments as
    :func:`shard_segments`)."""
    return segment_positions(shard_segments(layout, rank, world_size, shard_len, seq_len=seq_len),
                             device)


def segment_positions(segments: Sequence[Segment], device=None) -> torch.Tensor:
    """int64: the positions of ``segments``, in order."""
    pieces = [torch.arange(start, start + length, device=device) for start, length in segments]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def check_lengths(layout: str, lengths: Sequence[int]) -> Tuple[Tuple[Segment, ...], ...]:
    """Every rank's segments, from the number of tokens each rank holds (indexed by rank);
    ValueError unless they are the layout's split of their sum."""
    world = len(lengths)
    total = sum(lengths)
    if min(lengths) < 1:
        raise ValueError(f"every rank needs at least one token; the ranks hold {list(lengths)}")
    segments = sequence_segments(layout, world, total)
    expected = [sum(n for _, n in segs) for segs in segments]
    if list(lengths) != expected:
        raise ValueError(
            f"the ranks hold {list(lengths)} tokens, but the {layout} layout of {total} tokens "
            f"over {world} ranks gives them {expected} (the first {total % _pieces(layout, world)} "
            f"of its {_pieces(layout, world)} pieces one token longer); cut the shards with "
            f"flash_dmattn.distributed.shard_sequence, or pad the sequence to a multiple of "
            f"{_pieces(layout, world)} tokens"
        )
    return segments


def shard_sequence(x: Union[torch.Tensor, KeyIntervals], rank: int, world_size: int,
                   layout: str = "contiguous", dim: int = 1):
    """Rank ``rank``'s shard of ``x`` along its sequence dimension ``dim``.

    ``x`` may also be a :class:`~flash_dmattn.KeyIntervals` over the whole sequence: its keys
    (the last dim of start/end) are split, the bounds (query positions) are kept as they are,
    i.e. in global coordinates. Any length splits (:func:`sequence_segments`). Returns a new
    tensor (or ``KeyIntervals``).
    """
    check_layout(layout)
    if isinstance(x, KeyIntervals):
        return KeyIntervals.from_bounds(shard_sequence(x.bounds, rank, world_size, layout, -1))
    pieces = [x.narrow(dim, start, length)
              for start, length in shard_segments(layout, rank, world_size, seq_len=x.shape[dim])]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous",
                     dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` is rank ``r``'s), along ``dim``."""
    check_layout(layout)
    segments = check_lengths(layout, [shard.shape[dim] for shard in shards])
    pieces: List[Tuple[int, torch.Tensor]] = []
    for rank, shard in enumerate(shards):
        offset = 0
        for start, length in segments[rank]:
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim)
