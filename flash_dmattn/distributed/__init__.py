"""Context parallelism: attention over a sequence split across the ranks of a process group.

* :func:`context_parallel_attention`: exact attention with masks, biases (and their gradients)
  and key intervals; K/V blocks go round a ring of point-to-point transfers while each rank
  computes on the block it holds.
* :func:`context_parallel_selected_attention`: attention restricted by key intervals that
  every rank knows in full; each rank receives only the keys its queries select.
* :func:`context_parallel_dma_attention`: Dynamic Mask Attention's top-W selection from a
  per-key bias: the bias is all-gathered, the selection made once, and only the selected
  keys' K/V (and their gradients) move.

Layout helpers (:mod:`.layout`) split sequences of any length and reassemble them; :func:`record_communication`
counts the bytes moved. See ``docs/context-parallel.md``.
"""
from .comm import CommunicationLog, record_communication
from .layout import (
    LAYOUTS,
    sequence_segments,
    shard_positions,
    shard_segments,
    shard_sequence,
    unshard_sequence,
)
from .ring import context_parallel_attention
from .selected import context_parallel_dma_attention, context_parallel_selected_attention

__all__ = [
    "context_parallel_attention",
    "context_parallel_selected_attention",
    "context_parallel_dma_attention",
    "record_communication",
    "CommunicationLog",
    "LAYOUTS",
    "sequence_segments",
    "shard_positions",
    "shard_segments",
    "shard_sequence",
    "unshard_sequence",
]
