"""The process group of a context-parallel call, its point-to-point transfers, and a byte log.

Transfers are ``torch.distributed`` point-to-point operations issued together with
``batch_isend_irecv``, so they run while the caller computes; :meth:`Transfer.wait` joins them.
Both sides of a transfer issue their operations for one peer in the same order, which is how
``gloo`` (by tag and order) and NCCL (by order) pair sends with receives.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["CommunicationLog", "record_communication"]


def phase(name: str):
    """A named range ``cp.<name>`` in a ``torch.profiler`` trace (its host time, and the span of
    the kernels it launched on the device). Entered only while a profiler records:
    ``record_function`` costs tens of microseconds of host time even when none does."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function("cp." + name)
    return contextlib.nullcontext()


@dataclass
class CommunicationLog:
    """Bytes this rank sent and received, by purpose (``"kv"``, ``"grad"``, ``"bias"``, ...)."""

    sent: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: Dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())


_LOGS: List[CommunicationLog] = []


@contextlib.contextmanager
def record_communication() -> Iterator[CommunicationLog]:
    """Count the bytes the context-parallel functions move on this rank inside the block::

        with record_communication() as log:
            out = context_parallel_attention(q, k, v, is_causal=True)
            out.backward(dout)
        log.sent["kv"], log.received["grad"], log.total_sent
    """
    log = CommunicationLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _note(purpose: str, sent: Sequence[torch.Tensor], received: Sequence[torch.Tensor]) -> None:
    for log in _LOGS:
        log.sent[purpose] += sum(t.numel() * t.element_size() for t in sent)
        log.received[purpose] += sum(t.numel() * t.element_size() for t in received)


def resolve_group(group, mesh_dim) -> "dist.ProcessGroup":
    """A process group from ``group`` (None: the default group; a ``ProcessGroup``; or a
    ``DeviceMesh``, with ``mesh_dim`` naming its dimension when it has several)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context-parallel attention needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh"):
        if mesh_dim is None and group.ndim > 1:
            raise ValueError(
                f"a DeviceMesh of {group.ndim} dims needs mesh_dim (the context-parallel dim)"
            )
        return group.get_group(mesh_dim if mesh_dim is not None else 0)
    if mesh_dim is not None:
        raise ValueError("mesh_dim is only meaningful with a DeviceMesh as group")
    return group if group is not None else dist.group.WORLD


def _wire(t: torch.Tensor) -> torch.Tensor:
    # bool travels as bytes (not every backend has a bool type); the view shares memory.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class Transfer:
    """Point-to-point operations in flight."""

    def __init__(self, works) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


# Process groups on which every rank has taken part in a collective of this module.
_OPENED: "weakref.WeakSet" = weakref.WeakSet()


class Group:
    """A process group seen from this rank: its size, rank, ring neighbours and P2P ops."""

    def __init__(self, group, mesh_dim=None) -> None:
        self.group = resolve_group(group, mesh_dim)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the context-parallel group")
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def opened(self) -> bool:
        """Whether every rank of the group has already been through :meth:`agree` on it."""
        return self.group in _OPENED

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def exchange(self, purpose: str,
                 ops: Sequence[Tuple[str, int, torch.Tensor]]) -> Transfer:
        """Start ``ops``: ``("send" | "recv", group rank of the peer, contiguous tensor)``.
        Received tensors are filled in place once the returned transfer is waited on."""
        p2p, sent, received = [], [], []
        for kind, peer, tensor in ops:
            if tensor.numel() == 0:
                continue
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, _wire(tensor), self.global_rank(peer), self.group))
            (sent if kind == "send" else received).append(tensor)
        _note(purpose, sent, received)
        return Transfer(dist.batch_isend_irecv(p2p) if p2p else [])

    def ring_shift(self, purpose: str, send: Sequence[torch.Tensor],
                   recv: Sequence[torch.Tensor]) -> Transfer:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one."""
        ops = [("send", self.next, t) for t in send] + [("recv", self.prev, t) for t in recv]
        return self.exchange(purpose, ops)

    def all_gather(self, purpose: str, tensor: torch.Tensor,
                   lengths: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
        """Every rank's ``tensor``, indexed by group rank. Its shape is the same on every rank,
        except the last dim when ``lengths`` gives each rank's (the tensors travel padded to
        the longest)."""
        tensor = tensor.contiguous()
        if self.size == 1:  # nothing to move: no collective (and no NCCL launch) for one rank
            return [tensor]
        if lengths is not None and max(lengths) != tensor.shape[-1]:
            padded = tensor.new_zeros(*tensor.shape[:-1], max(lengths))
            padded[..., : tensor.shape[-1]] = tensor
            tensor = padded
        out = [torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
               for _ in range(self.size)]
        dist.all_gather([_wire(t) for t in out], _wire(tensor), group=self.group)
        _note(purpose, [tensor] * (self.size - 1), out[: self.size - 1])
        if lengths is not None:
            out = [t[..., :n] for t, n in zip(out, lengths)]
        return out

    def all_gather_ints(self, purpose: str, values: Sequence[int], device) -> List[List[int]]:
        """Every rank's ``values`` (as many on every rank), indexed by group rank: one
        collective and one host synchronisation. ``device``: where the collective runs (the
        GPU of the rank with NCCL). A group of one rank has nothing to ask: no collective, no
        wait."""
        if self.size == 1:
            return [[int(x) for x in values]]
        # (to the device without a wait: the list is staged at once, copied in stream order)
        mine = torch.tensor([int(x) for x in values], dtype=torch.int64).to(device, non_blocking=True)
        return torch.stack(self.all_gather(purpose, mine)).tolist()

    def agree(self, device, values: Optional[Sequence[int]], width: int,
              error: Optional[Exception] = None) -> List[List[int]]:
        """Every rank's ``values`` (``width`` ints: its shard length and the like), indexed by
        group rank, after each rank has checked its own arguments. A rank whose checks failed
        (``error``) raises it, and every other rank raises too, rather than waiting for it in a
        transfer that never comes."""
        row = [-1] * width + [1] if error is not None else [int(x) for x in values] + [0]
        rows = self.all_gather_ints("setup", row, device)
        _OPENED.add(self.group)
        if error is not None:
            raise error
        failed = [r for r, x in enumerate(rows) if x[-1]]
        if failed:
            raise ValueError(f"rank(s) {failed} of the context-parallel group rejected their "
                             f"arguments (the error raised there says why)")
        return [x[:-1] for x in rows]
