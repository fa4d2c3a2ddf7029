"""How a sequence is split over the ranks of a context-parallel group.

A sequence of ``L`` tokens is split into equal shards of ``n = L / P`` tokens, one per rank:

* ``"contiguous"``: rank ``r`` holds positions ``r·n .. (r+1)·n - 1``;
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c = n / 2`` and rank ``r`` holds
  chunk ``r`` followed by chunk ``2P - 1 - r``. Under a causal mask every rank then has the
  same amount of work (an early chunk with few visible keys and a late one with many), where
  the contiguous split gives the last rank ``2P - 1`` times the work of the first.

Queries, keys and values, and every mask or bias dimension that runs along the sequence, are
split the same way. The helpers below cut a whole tensor into a rank's shard, put shards back
together, and give the global positions of a shard (e.g. for rotary embeddings).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from ..masks import KeyIntervals

__all__ = ["LAYOUTS", "shard_segments", "shard_positions", "shard_sequence", "unshard_sequence"]

LAYOUTS = ("contiguous", "zigzag")

Segment = Tuple[int, int]  # (global start, length)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_shard_length(layout: str, shard_len: int) -> None:
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(
            f"the zigzag layout needs an even number of tokens per rank (two chunks of equal "
            f"length); got {shard_len}"
        )


def shard_segments(layout: str, rank: int, world_size: int, shard_len: int) -> Tuple[Segment, ...]:
    """The pieces of rank ``rank``'s shard as ``(global start, length)``, in local order."""
    check_layout(layout)
    check_shard_length(layout, shard_len)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if layout == "contiguous":
        return ((rank * shard_len, shard_len),)
    chunk = shard_len // 2
    return ((rank * chunk, chunk), ((2 * world_size - 1 - rank) * chunk, chunk))


def shard_positions(layout: str, rank: int, world_size: int, shard_len: int,
                    device=None) -> torch.Tensor:
    """int64 ``(shard_len,)``: the global position of each token of the rank's shard."""
    pieces = [torch.arange(start, start + length, device=device)
              for start, length in shard_segments(layout, rank, world_size, shard_len)]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _shard_len(total: int, world_size: int, layout: str) -> int:
    parts = world_size * (2 if layout == "zigzag" else 1)
    if world_size < 1 or total % parts:
        raise ValueError(
            f"a sequence of {total} tokens does not split into {parts} equal pieces "
            f"({layout} layout over {world_size} ranks)"
        )
    return total // world_size


def shard_sequence(x: Union[torch.Tensor, KeyIntervals], rank: int, world_size: int,
                   layout: str = "contiguous", dim: int = 1):
    """Rank ``rank``'s shard of ``x`` along its sequence dimension ``dim``.

    ``x`` may also be a :class:`~flash_dmattn.KeyIntervals` over the whole sequence: its keys
    (the last dim of start/end) are split, the bounds (query positions) are kept as they are,
    i.e. in global coordinates. Returns a new tensor (or ``KeyIntervals``).
    """
    check_layout(layout)
    if isinstance(x, KeyIntervals):
        return KeyIntervals.from_bounds(shard_sequence(x.bounds, rank, world_size, layout, -1))
    shard_len = _shard_len(x.shape[dim], world_size, layout)
    pieces = [x.narrow(dim, start, length)
              for start, length in shard_segments(layout, rank, world_size, shard_len)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous",
                     dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` is rank ``r``'s), along ``dim``."""
    check_layout(layout)
    world_size = len(shards)
    shard_len = shards[0].shape[dim]
    pieces: List[Tuple[int, torch.Tensor]] = []
    for rank, shard in enumerate(shards):
        offset = 0
        for start, length in shard_segments(layout, rank, world_size, shard_len):
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim)
