"""Where the time of one context-parallel DMA forward + backward goes (issue 37).

Run under torchrun, one process per GPU (NCCL), or on CPU (gloo, tiny sizes)::

    torchrun --standalone --nproc-per-node 4 tools/cp_profile.py                 # 1M tokens
    torchrun --standalone --nproc-per-node 4 tools/cp_profile.py --per-gpu 65536
    torchrun --standalone --nproc-per-node 2 tools/cp_profile.py                 # CPU: 2 x 256 tokens

Every rank runs ``context_parallel_dma_attention`` (causal top-W of a per-key bias, zigzag, with
``seq_len``) on its shard; rank 0 prints:

1. the time of one forward + backward (median over ``--repeats``, slowest rank), the bytes
   moved, and the host synchronisations of one call counted by
   :class:`flash_dmattn.distributed.syncs.HostSyncs` (by line: what makes the host wait for
   the device, seen on any device);
2. a ``torch.profiler`` trace of one call: the top ops by device (CUDA) time and by CPU time,
   and the host waits the trace shows (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
   ``cudaEventSynchronize``, device-to-host copies, ``aten::item`` / ``nonzero``), and how many
   kernels were launched; then the step's phases (the ``cp.<name>`` ranges the call enters while
   a profiler records: bias gather, top-k, selection with its host wait, K/V exchange, local
   forward, ...: host time and, on GPUs, the device span of what each launched) and, on GPUs,
   the device timeline: the compute stream's idle stretches (where the host waits or the
   stream waits for a transfer) and every NCCL kernel with how much of it the compute stream
   was busy (overlapped) or idle (exposed); and one line of those totals per rank;
3. unless ``--no-single``: the same call on a group of one rank (rank 0 alone) at the per-GPU
   length, against one ``flash_dmattn_func`` call with ``topk_intervals`` at that length
   (the scaling baseline of the cp suite): both times, their ratio, both traces' top ops, and
   the ops whose time the context-parallel call adds (its time minus the plain call's, by op
   name), and the one-rank call's phases. On one rank the CP call moves nothing, so what it
   adds is its own machinery.

``--trace DIR`` also writes the Chrome traces (``rank0-cp.json`` etc.). The defaults follow the
cp suite: B1 H16/Hkv4 D128 bf16, W 2048, 256K tokens per GPU, the triton local kernels (auto
dispatch with ``--backend auto``); on CPU float32, H4/Hkv2 D16, W 16, 256 tokens per rank and
the torch-reference kernels.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from flash_dmattn import flash_dmattn_func_auto  # noqa: E402
from flash_dmattn.distributed import (  # noqa: E402
    context_parallel_dma_attention,
    record_communication,
    shard_segments,
)
from flash_dmattn.distributed.syncs import HostSyncs  # noqa: E402
from flash_dmattn.utils.mask import topk_intervals  # noqa: E402

# Trace events that are the host waiting for the device (CUDA runtime calls), or that make it
# wait (aten ops whose result the host reads), or copies to the host.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaStreamWaitEvent")
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::unique", "aten::_unique2", "aten::tolist")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
# Named ranges of a step: step_fn's, and the context-parallel call's own (cp.<phase>, entered
# while a profiler records: flash_dmattn.distributed.comm.phase).
STEP_RANGES = ("forward", "backward")
# Idle stretches of the compute stream shorter than this are launch gaps, not listed.
GAP_US = 50.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-gpu", type=int, default=None,
                   help="tokens per rank (default: 262144 on GPUs, 256 on CPU); L = ranks x this")
    p.add_argument("--window", type=int, default=None, help="keys kept per query (2048 / 16)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--backend", default=None,
                   help="local kernels (default: triton on GPUs, torch-reference on CPU; 'auto': "
                        "auto-dispatch)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 5 GPU, 2 CPU)")
    p.add_argument("--top", type=int, default=15, help="rows of each op table")
    p.add_argument("--no-single", action="store_true",
                   help="skip the one-rank comparison against the plain call")
    p.add_argument("--trace", type=Path, default=None, help="write Chrome traces to this folder")
    return p.parse_args(argv)


def setup(args):
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(minutes=10)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    gpu = dict(per_gpu=262144, window=2048, heads=16, kv_heads=4, head_dim=128, repeats=5,
               backend="triton")
    cpu = dict(per_gpu=256, window=16, heads=4, kv_heads=2, head_dim=16, repeats=2,
               backend="torch-reference")
    for name, value in (gpu if cuda else cpu).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.backend == "auto":
        args.backend = None
    args.dtype = torch.bfloat16 if cuda else torch.float32
    return device


def problem(args, L, rank, world, device, seed=0):
    """This rank's shards ``(q, k, v, bias, dout)`` of a random sequence of ``L`` tokens: its
    shard length from the layout, values from its own seed (timing needs no common sequence)."""
    n = sum(m for _, m in shard_segments(args.layout, rank, world, seq_len=L))
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
                * scale).to(args.dtype)

    q, k, v = randn(1, n, H, D), randn(1, n, Hkv, D), randn(1, n, Hkv, D)
    bias = randn(1, Hkv, 1, n, scale=2.0)
    dout = randn(1, n, H, D)
    return q, k, v, bias, dout


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(call, tensors):
    """One forward + backward of ``call(q, k, v, bias)`` on fresh leaves."""
    q, k, v, bias, dout = tensors

    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
        with torch.profiler.record_function("forward"):
            out = call(*leaves)
        with torch.profiler.record_function("backward"):
            out.backward(dout)
        return out

    return step


def timed(step, device, group, repeats):
    """Median over ``repeats`` of the slowest rank's time of ``step()`` in ms (one warm-up)."""
    step()
    sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        elapsed = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(elapsed.item() * 1e3)
    return statistics.median(times)


def profiled(step, device, trace_path=None):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return prof


def _device_time(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0


def summary(prof) -> dict:
    """Op name -> (calls, self CPU us, self device us), and the counts of host waits."""
    ops = {}
    for e in prof.key_averages():
        ops[e.key] = (e.count, e.self_cpu_time_total, _device_time(e))
    counts = Counter()
    for name, (n, _, _) in ops.items():
        if name in WAITS or name in HOST_READS:
            counts[name] += n
        if name.startswith("Memcpy DtoH") or name.startswith("Memcpy D2H"):
            counts["Memcpy DtoH (device)"] += n
        if name in ("cudaMemcpy", "cudaMemcpyAsync"):
            counts[name] += n
        if name in LAUNCHES:
            counts["kernel launches"] += n
    return {"ops": ops, "counts": counts}


def table(prof, device, top: int) -> str:
    ka = prof.key_averages()
    parts = []
    if device.type == "cuda":
        key = "self_device_time_total"
        try:
            parts.append("-- top ops by device time\n" + ka.table(sort_by=key, row_limit=top))
        except (AttributeError, KeyError, ValueError):
            parts.append("-- top ops by device time\n" + ka.table(sort_by="self_cuda_time_total",
                                                                  row_limit=top))
    parts.append("-- top ops by CPU time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=top))
    return "\n".join(parts)


def waits_line(s: dict) -> str:
    c = s["counts"]
    keys = ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "Memcpy DtoH (device)", "cudaMemcpyAsync", "cudaMemcpy", "aten::item",
            "aten::_local_scalar_dense", "aten::nonzero", "kernel launches"]
    return ", ".join(f"{k} {c.get(k, 0)}" for k in keys)


def host_syncs(step):
    with HostSyncs() as syncs:
        step()
    return syncs


def _is_range(name: str) -> bool:
    return name in STEP_RANGES or name.startswith("cp.")


def _merged(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: float, b: float, busy: List[Tuple[float, float]]) -> float:
    """How long ``[a, b)`` meets the (merged) ``busy`` intervals."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def _innermost(ranges, t: float) -> str:
    """The named range that began last among those whose span holds time ``t`` (the one whose
    work runs then: device spans overlap, e.g. a transfer's with the kernels queued after it);
    "-": none."""
    inside = [(-a, b - a, name) for name, a, b in ranges if a <= t < b]
    return min(inside)[2] if inside else "-"


def timeline(prof, top: int) -> Tuple[str, Optional[dict]]:
    """When things ran in one profiled step: the named ranges (host time; on a GPU also the
    span of the device work each launched), and on a GPU the compute stream's idle stretches
    (the host waiting, or the stream waiting for a transfer) and each NCCL kernel with the
    time the compute stream was busy during it (overlapped) or idle (exposed). Returns the
    text and, on a GPU, this rank's totals (see :func:`rank_line`)."""
    events = list(prof.events())
    host = [e for e in events if e.device_type == DeviceType.CPU and _is_range(e.name)]
    dev = [e for e in events if e.device_type == DeviceType.CUDA]
    work = [e for e in dev if not _is_range(e.name)]
    dev_ranges = [(e.name, e.time_range.start, e.time_range.end) for e in dev if _is_range(e.name)]
    h0 = min((e.time_range.start for e in host), default=0.0)
    t0 = min((e.time_range.start for e in work), default=0.0)
    lines = ["-- phases: host time (from the step's start)" +
             ("; device span of what each launched (from its first kernel)" if work else "")]
    spans = {}
    for name, a, b in dev_ranges:
        spans.setdefault(name, []).append((a, b))
    for e in sorted(host, key=lambda e: e.time_range.start):
        a, b = e.time_range.start - h0, e.time_range.end - h0
        line = f"  {e.name:<18} host {a / 1e3:8.2f} +{(b - a) / 1e3:7.2f} ms"
        if spans.get(e.name):
            da, db = spans[e.name].pop(0)
            line += f"   device {(da - t0) / 1e3:8.2f} +{(db - da) / 1e3:7.2f} ms"
        lines.append(line)
    if not work:
        return "\n".join(lines), None
    streams = {}
    for e in work:
        streams.setdefault(e.device_resource_id, []).append(e)

    def is_nccl(e) -> bool:
        return e.name.startswith("nccl")

    compute = max(streams, key=lambda s: sum(e.time_range.end - e.time_range.start
                                             for e in streams[s] if not is_nccl(e)))
    kernels = sorted(streams[compute], key=lambda e: e.time_range.start)
    busy = _merged([(e.time_range.start, e.time_range.end) for e in kernels])
    t1 = max(e.time_range.end for e in work)
    busy_us = sum(b - a for a, b in busy)
    gaps = []
    for (a, b), (c, _) in zip(busy, busy[1:]):
        if c - b >= GAP_US:
            before = max((e for e in kernels if e.time_range.end <= b + 1e-3),
                         key=lambda e: e.time_range.end)
            after = min((e for e in kernels if e.time_range.start >= c - 1e-3),
                        key=lambda e: e.time_range.start)
            gaps.append((c - b, b, before.name, after.name, _innermost(dev_ranges, c)))
    nccl = sorted((e for e in work if is_nccl(e)), key=lambda e: e.time_range.start)
    stats = dict(span=t1 - t0, busy=busy_us, gaps=sum(g[0] for g in gaps), n_gaps=len(gaps),
                 nccl=sum(e.time_range.end - e.time_range.start for e in nccl), exposed=0.0)
    lines.append(f"-- device timeline: {(t1 - t0) / 1e3:.2f} ms from the first kernel to the last; "
                 f"compute stream busy {busy_us / 1e3:.2f} ms, idle {(t1 - t0 - busy_us) / 1e3:.2f}"
                 f" ms ({len(gaps)} stretches >= {GAP_US:.0f} us: {stats['gaps'] / 1e3:.2f} ms)")
    for e in nccl:
        a, b = e.time_range.start, e.time_range.end
        over = _overlap(a, b, busy)
        stats["exposed"] += (b - a) - over
        lines.append(f"  NCCL {(a - t0) / 1e3:8.2f} +{(b - a) / 1e3:7.2f} ms, compute busy "
                     f"{over / 1e3:6.2f} / idle {(b - a - over) / 1e3:6.2f} ms  in "
                     f"{_innermost(dev_ranges, a):<16} {e.name[:40]}")
    if gaps:
        lines.append(f"  compute stream idle >= {GAP_US:.0f} us, longest {min(top, len(gaps))} "
                     f"(in: the range of the kernel after it):")
    for length, at, before, after, where in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  idle {(at - t0) / 1e3:8.2f} +{length / 1e3:7.2f} ms  in {where:<16} "
                     f"after {before[:34]:<34} before {after[:34]}")
    return "\n".join(lines), stats


def rank_line(rank: int, stats: dict) -> str:
    """One rank's device totals of a profiled step (:func:`timeline`)."""
    return (f"  rank {rank}: {stats['span'] / 1e3:7.2f} ms, compute busy {stats['busy'] / 1e3:7.2f}"
            f" ms, idle stretches {stats['gaps'] / 1e3:6.2f} ms ({stats['n_gaps']}), NCCL "
            f"{stats['nccl'] / 1e3:6.2f} ms of which {stats['exposed'] / 1e3:6.2f} ms with the "
            f"compute stream idle")


def added_ops(cp: dict, plain: dict, device, top: int) -> str:
    """The ops whose self time the CP call adds over the plain one (by name), largest first."""
    col = 2 if device.type == "cuda" else 1
    rows = []
    for name in set(cp["ops"]) | set(plain["ops"]):
        a = cp["ops"].get(name, (0, 0, 0))
        b = plain["ops"].get(name, (0, 0, 0))
        rows.append((a[col] - b[col], name, a[0], b[0], a[col], b[col]))
    rows.sort(reverse=True)
    unit = "device" if device.type == "cuda" else "CPU"
    lines = [f"-- ops the CP call adds (self {unit} time, CP - plain; calls CP / plain)"]
    for diff, name, na, nb, ta, tb in rows[:top]:
        if diff <= 0:
            break
        lines.append(f"  {diff / 1e3:9.3f} ms  {name[:70]:<70} {na:>6} / {nb:<6}"
                     f"  ({ta / 1e3:.3f} / {tb / 1e3:.3f} ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.per_gpu
    L = n * world
    W = args.window
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"cp_profile: {world} rank(s), {device.type}, L={L} ({n} per rank), B1 H{args.heads}/"
        f"Hkv{args.kv_heads} D{args.head_dim} {str(args.dtype).replace('torch.', '')}, "
        f"top-{W} DMA, {args.layout}, local kernels: {args.backend or 'auto'}", flush=True)
    tensors = problem(args, L, rank, world, device)

    def cp_call(q, k, v, b, group=None, seq_len=L):
        return context_parallel_dma_attention(q, k, v, b, W, is_causal=True, layout=args.layout,
                                              backend=args.backend, seq_len=seq_len, group=group)

    step = step_fn(cp_call, tensors)
    ms = timed(step, device, None, args.repeats)
    with record_communication() as log:
        step()
    syncs = host_syncs(step)
    counts = [syncs.count]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, counts)
        counts = [c[0] for c in everyone]
    prof = profiled(step, device, args.trace / f"rank{rank}-cp.json" if args.trace else None)
    s = summary(prof)
    say(f"\n== context_parallel_dma_attention on {world} rank(s), L={L}: fwd+bwd {ms:.2f} ms "
        f"(median of {args.repeats}, slowest rank)")
    say(f"bytes (rank 0) sent {dict(log.sent)}, received {dict(log.received)}")
    say(f"host synchronisations of one fwd+bwd (HostSyncs), by rank: {counts}; rank 0's:")
    say(syncs.report())
    say(f"trace (rank 0): {waits_line(s)}")
    say(table(prof, device, args.top))
    text, stats = timeline(prof, args.top)
    say(text)
    if stats is not None and world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, stats)
        say("-- every rank's device timeline of the step")
        for r, st in enumerate(everyone):
            say(rank_line(r, st))
    sys.stdout.flush()

    if not args.no_single:
        solo = dist.new_group([0])
        if rank == 0:
            one = problem(args, n, 0, 1, device, seed=1)

            def plain(q, k, v, b):
                mask = topk_intervals(b.detach(), W, is_causal=True)
                return flash_dmattn_func_auto(args.backend)(q, k, v, attn_mask=mask, attn_bias=b,
                                                           is_causal=True)

            cp_step = step_fn(lambda q, k, v, b: cp_call(q, k, v, b, group=solo, seq_len=n), one)
            plain_step = step_fn(plain, one)
            cp_ms = timed(cp_step, device, solo, args.repeats)
            plain_ms = timed(plain_step, device, solo, args.repeats)
            cp_syncs, plain_syncs = host_syncs(cp_step), host_syncs(plain_step)
            trace = args.trace
            cp_prof = profiled(cp_step, device, trace / "rank0-cp-single.json" if trace else None)
            plain_prof = profiled(plain_step, device, trace / "rank0-plain.json" if trace else None)
            cs, ps = summary(cp_prof), summary(plain_prof)
            say(f"\n== one rank at L={n}: context_parallel_dma_attention {cp_ms:.2f} ms, "
                f"flash_dmattn_func + topk_intervals {plain_ms:.2f} ms: "
                f"{cp_ms / plain_ms:.2f}x (fwd+bwd, median of {args.repeats})")
            say(f"host synchronisations (HostSyncs): CP {cp_syncs.count}, plain {plain_syncs.count}")
            if device.type == "cpu":
                say("(on CPU the plain call may take the reference's fused SDPA path and the CP "
                    "call the reference op: compare on a GPU)")
            if cp_syncs.count:
                say(cp_syncs.report())
            say(f"trace CP:    {waits_line(cs)}")
            say(f"trace plain: {waits_line(ps)}")
            say(added_ops(cs, ps, device, args.top))
            say("-- CP on one rank\n" + table(cp_prof, device, args.top))
            say(timeline(cp_prof, args.top)[0])
            say("-- plain call\n" + table(plain_prof, device, args.top), flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
