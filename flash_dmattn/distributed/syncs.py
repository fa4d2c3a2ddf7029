"""Counting the host synchronisations of a call, on any device (a debugging aid).

On a GPU, an operation whose result the host needs (``.item()``, ``.tolist()``, ``nonzero``,
boolean indexing, ``torch.unique``, ``if tensor:``, a copy to the CPU) makes the host wait for
every kernel queued before it; the host then queues nothing while it waits, and the GPU idles
for the launch latency of what comes next. ``torch.cuda.set_sync_debug_mode`` reports them on
a GPU only. :class:`HostSyncs` counts them on any device (CPU included, where they cost
nothing but mark the same places): a dispatch mode sees every aten operation whose output
size or value the host must read, and ``Tensor.tolist`` (which bypasses the dispatcher on CPU
tensors) is wrapped while the mode is active::

    with HostSyncs() as syncs:
        out = context_parallel_dma_attention(q, k, v, bias, 2048, seq_len=L)
        out.backward(dout)
    syncs.count, syncs.by_site()   # {"flash_dmattn/distributed/selected.py:123 aten.nonzero": 2, ...}

Each event is attributed to the innermost frame of this package (file and line), so a count
names the lines that wait. ``exclude`` skips events whose innermost package frame lies in
one of the given path fragments (e.g. the local kernels, to count the context-parallel
machinery alone).
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs"]

_aten = torch.ops.aten


def _sync_ops():
    names = [
        "_local_scalar_dense",  # .item(), int(t), float(t), bool(t), `if t:`
        "nonzero",  # also what boolean indexing and masked assignment run
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "equal",  # a bool on the host
        "allclose",
        "is_nonzero",
    ]
    out = set()
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            out.add(packet)
    return out


_SYNC_OPS = _sync_ops()
_PACKAGE = "flash_dmattn"


def _is_bool_index(args) -> bool:
    """aten.index / index_put with a bool (mask) index: its output size is data-dependent."""
    indices = args[1] if len(args) > 1 else None
    if not isinstance(indices, (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _site(skip: int = 2) -> str:
    """The innermost frame of this package (``path:line``), else the innermost frame."""
    frame = sys._getframe(skip)
    first = None
    while frame is not None:
        fname = frame.f_code.co_filename.replace("\\", "/")
        if first is None and "torch/" not in fname and "/syncs.py" not in fname:
            first = f"{fname}:{frame.f_lineno}"
        if f"/{_PACKAGE}/" in fname and not fname.endswith("/distributed/syncs.py"):
            return f"{fname[fname.rindex('/' + _PACKAGE + '/') + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return first or "?"


class HostSyncs(TorchDispatchMode):
    """Counts the operations inside the ``with`` block that make the host wait for the device
    (see the module docstring). ``events``: ``(site, what)`` in order; ``exclude``: path
    fragments whose events are not counted (they go to ``excluded``)."""

    def __init__(self, exclude: Iterable[str] = ()) -> None:
        super().__init__()
        self.exclude: Tuple[str, ...] = tuple(exclude)
        self.events: List[Tuple[str, str]] = []
        self.excluded: List[Tuple[str, str]] = []
        self._tolist = None
        self._quiet = 0  # inside a counted tolist: its own copy to the host is not a second wait

    @property
    def count(self) -> int:
        return len(self.events)

    def by_site(self) -> Counter:
        return Counter(f"{site} {what}" for site, what in self.events)

    def report(self, limit: Optional[int] = None) -> str:
        rows = self.by_site().most_common(limit)
        return "\n".join(f"{n:5d}  {key}" for key, n in rows) or "(none)"

    def _note(self, what: str, skip: int = 3) -> None:
        if self._quiet:
            return
        site = _site(skip)
        target = self.excluded if any(x in site for x in self.exclude) else self.events
        target.append((site, what))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            self._note(str(packet))
        elif packet in (_aten.index, _aten.index_put, _aten.index_put_) and _is_bool_index(args):
            self._note(f"{packet} (bool index)")
        elif packet is _aten.repeat_interleave and kwargs.get("output_size") is None \
                and len(args) >= 1 and isinstance(args[0], torch.Tensor) and \
                (len(args) == 1 or isinstance(args[1], torch.Tensor)):
            self._note("aten.repeat_interleave (no output_size)")
        elif packet in (_aten._to_copy, _aten.copy_):
            src = args[1] if packet is _aten.copy_ else args[0]
            dst_dev = (args[0].device if packet is _aten.copy_
                       else kwargs.get("device") or getattr(src, "device", None))
            blocking = not (kwargs.get("non_blocking") or (packet is _aten.copy_ and len(args) > 2
                                                            and args[2]))
            if isinstance(src, torch.Tensor) and dst_dev is not None and blocking:
                src_type, dst_type = src.device.type, torch.device(dst_dev).type
                if src_type != "cpu" and dst_type == "cpu":
                    self._note(f"{packet} (device to host)")
                elif src_type == "cpu" and dst_type != "cpu":
                    # from pageable memory without non_blocking: PyTorch waits for the stream
                    self._note(f"{packet} (host to device, blocking)")
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        original = torch.Tensor.tolist

        def tolist(t, *a, **k):
            counter._note("Tensor.tolist", skip=3)
            counter._quiet += 1
            try:
                return original(t, *a, **k)
            finally:
                counter._quiet -= 1

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
