"""Median timing and peak-memory measurement, on CUDA or CPU."""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional, Tuple

import torch

try:  # triton's do_bench flushes L2 between runs and picks the repeat count itself
    from triton.testing import do_bench as _do_bench
except Exception:  # noqa: BLE001  (a broken triton install must not stop CPU runs)
    _do_bench = None


def timing_method(device: torch.device, cpu_repeats: int) -> str:
    """How :func:`time_ms` measures on ``device`` (recorded in the results)."""
    if device.type == "cuda":
        if _do_bench is not None:
            return "triton.testing.do_bench(warmup=25, rep=100, return_mode='median')"
        return "CUDA events, median (~25 ms warm-up, ~100 ms of runs)"
    return f"time.perf_counter, median of {cpu_repeats} runs after 1 warm-up"


def time_ms(fn: Callable[[], object], device: torch.device, cpu_repeats: int = 3,
            min_runs: Optional[int] = None) -> float:
    """Median milliseconds of one call of ``fn`` (which has already been warmed up once).

    ``min_runs`` (CUDA): time with CUDA events and at least that many timed calls (after at
    least 2 warm-up calls) whatever the time budget; ``do_bench`` times a call of more than
    100 ms only once or twice.
    """
    if device.type == "cuda":
        if min_runs is not None:
            return _cuda_event_median(fn, min_reps=min_runs, min_warmup=2)
        if _do_bench is not None:
            try:
                return float(_do_bench(fn, warmup=25, rep=100, return_mode="median"))
            except TypeError:  # triton < 2.2 has no return_mode
                return float(_do_bench(fn, warmup=25, rep=100, quantiles=[0.5]))
        return _cuda_event_median(fn)
    samples = []
    for _ in range(cpu_repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def capture_graph(fn: Callable[[], object]):
    """``(graph, out)``: ``fn`` warmed up twice on a side stream (as ``torch.cuda.graphs``
    asks), then captured once in a CUDA graph; ``out`` is what the captured call returned
    (its memory is the graph's: each replay rewrites it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def graph_time_ms(fn: Callable[[], object], device: torch.device) -> Tuple[Optional[float], str]:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph, or (None, why).

    A decode step is a few microseconds of GPU work behind tens of microseconds of Python and
    launch overhead, so an eager timing measures the host; servers replay captured graphs, and
    the replay time is what the kernels cost (the bandwidth the decode target is about).
    ``fn`` must have run once already (autotuning and compiles happen outside the capture).
    """
    if device.type != "cuda":
        return None, "no CUDA graphs off CUDA"
    try:
        graph, _ = capture_graph(fn)
    except Exception as exc:  # noqa: BLE001  (an implementation that cannot be captured)
        torch.cuda.synchronize()
        return None, f"CUDA graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:
        return time_ms(graph.replay, device), ""
    finally:
        del graph


def _cuda_event_median(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0,
                       min_reps: int = 5, min_warmup: int = 1) -> float:
    # Same budget as do_bench: estimate one call, then warm up and repeat for fixed times
    # (at least min_warmup / min_reps calls).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(min_warmup, int(warmup_ms / estimate))):
        fn()
    samples = []
    for _ in range(min(1000, max(min_reps, int(rep_ms / estimate)))):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        samples.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in samples)


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Peak CUDA memory one call of ``fn`` allocates beyond what was already allocated (MiB).

    Everything alive before the call (the inputs, the mask, other implementations' state)
    is the baseline, so the figure is the call's own footprint: its outputs, gradients,
    saved activations and workspaces. ``None`` off CUDA.
    """
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - base) / 2**20
