"""Every benchmark suite by name and its workloads.

The core suites (``workloads.CORE_SUITES``) share one workload type and runner; varlen,
dma_long and cp bring their own (packed inputs, KeyIntervals and layer steps, torchrun
launches), each in its module. This module sits above all of them, so none of them imports it.
"""
from __future__ import annotations

from typing import List

from .workloads import CORE_SUITES, Workload, core_workloads

SUITES = CORE_SUITES + ("varlen", "dma_long", "cp")


def workloads_for(suite: str, quick: bool) -> List[Workload]:
    """The workloads of ``suite`` (one of :data:`SUITES`); tiny shapes when ``quick``."""
    if suite == "varlen":  # packed sequences vs padded / one by one (varlen.py)
        from .varlen import varlen_workloads

        return varlen_workloads(quick)
    if suite == "dma_long":  # long-sequence DMA with a KeyIntervals mask (dma_long.py)
        from .dma_long import dma_long_workloads

        return dma_long_workloads(quick)
    if suite == "cp":  # context parallelism over 1/2/4 processes: one torchrun a variant (cp.py)
        from .cp import cp_workloads

        return cp_workloads(quick)
    if suite in CORE_SUITES:
        return core_workloads(suite, quick)
    raise ValueError(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
