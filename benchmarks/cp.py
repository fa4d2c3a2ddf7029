"""The ``cp`` suite: context-parallel attention on 1, 2 and 4 GPUs of one host.

Every workload is B1 H16/Hkv4 D128 bf16 (tiny shapes and float32 on CPU with ``--quick``),
causal, and runs once per *variant* (a number of ranks and a sequence layout). Each variant is
its own ``torchrun --standalone --nproc-per-node P -m benchmarks.cp --worker ...`` launch
(NCCL on GPUs, gloo on CPU), which times its rows and writes them to a JSON file that this
process turns into the suite's rows. A variant needing more GPUs than the machine has gives a
``skipped`` row.

Workloads (total tokens ``L`` over all ranks):

* ``dense``: plain causal attention, ``context_parallel_attention`` (the ring), at 128K and
  256K, zigzag on 1, 2 and 4 GPUs (and contiguous on 4 at 128K, for contrast);
* ``dense+bias``: the same with a per-key bias (a gradient leaf) and a per-key mask, 128K;
* ``dma``: causal top-2048 of a per-key bias, ``context_parallel_dma_attention`` (bias
  all-gather, selection, selected K/V only): 256K on 1, 2 and 4 GPUs, and the equal-work-per-GPU
  points 512K on 2 and 1M on 4.

Rows of a variant: ``context_parallel x<P> <layout>``; on one GPU also ``flash_dmattn_func``
(the whole sequence in one call, the DMA row with its ``topk_intervals`` in the timed region),
the scaling baseline. Times are the median over runs of the slowest rank's time (a barrier and a
device synchronisation around every call). Inputs are generated in blocks of tokens, each block
from its own seed, so every variant sees the same sequence; the ``rel err`` column compares the
norms of the output and of every gradient with those of the one-GPU call (a cross-check that no
block went missing; exactness is what tests/test_context_parallel.py checks).

The summary (``summary_markdown``) states the issue's targets: scaling efficiency of dense
causal fwd+bwd on 4 GPUs (1-GPU time / (4 x 4-GPU time)) >= 85 %; DMA at 1M on 4 GPUs <= 1.2x
the one-GPU time at 256K; DMA traffic <= 2x (selected K/V bytes + bias bytes) per rank and pass.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .report import ERROR, OK, SKIPPED, Row
from .workloads import Workload

SUITE = "cp"
REPO = Path(__file__).resolve().parents[1]
# Seconds a variant's launch may take (start-up, compilation, warm-up and timing included).
LAUNCH_TIMEOUT_S = {True: 600, False: 3600}
# Untimed and timed calls per row and phase. One warm-up call pays for compilation and
# connection set-up; at 128K+ tokens a call lasts 0.1-3 s, so three timed ones give a stable median.
WARMUP, RUNS = {True: 1, False: 1}, {True: 3, False: 3}
# Environment knobs that bound a run (e.g. a device call with a time limit):
#   FLASH_DMATTN_CP_REPEATS="W,R"     W warm-up and R timed calls per row and phase;
#   FLASH_DMATTN_CP_VARIANTS="1,4:zigzag"  only these variants (ranks, or ranks:layout); the
#                                      others give skipped rows;
#   FLASH_DMATTN_CP_LAUNCH_S=S        the time limit of one variant's launch;
#   FLASH_DMATTN_CP_DEADLINE=T        a Unix time: launches end by then, later variants give
#                                      skipped rows, and the report is still written.
# benchmarks.run's --match picks workloads by name (e.g. "L262144 D128 dense").
ENV_REPEATS, ENV_VARIANTS, ENV_LAUNCH_S, ENV_DEADLINE = (
    "FLASH_DMATTN_CP_REPEATS", "FLASH_DMATTN_CP_VARIANTS", "FLASH_DMATTN_CP_LAUNCH_S",
    "FLASH_DMATTN_CP_DEADLINE")
# A launch with less time than this left before the deadline is not started.
MIN_LAUNCH_S = 20
# A one-GPU run at the same L as this many-GPU one is the dense scaling baseline; the DMA
# anchor is one GPU at 256K (equal work per GPU: every query keeps W keys).
TARGET_EFFICIENCY = 0.85
TARGET_DMA_RATIO = 1.2
TARGET_TRAFFIC_RATIO = 2.0
DMA_ANCHOR_LEN = 262144


@dataclass(frozen=True)
class CpWorkload(Workload):
    """One ``cp`` problem: ``kind`` is ``"dense"``, ``"dense+bias"`` or ``"dma"``; ``variants``
    lists ``(ranks, layout)`` pairs, each run as one launch."""

    kind: str = "dense"
    variants: Tuple[Tuple[int, str], ...] = ()

    @property
    def name(self) -> str:
        heads = f"H{self.heads}/{self.kv_heads}"
        what = {"dense": "dense causal", "dense+bias": "causal, per-key mask + bias",
                "dma": f"causal top-{self.window}/query DMA"}[self.kind]
        return f"{SUITE} B{self.batch} {heads} L{self.seqlen_k} D{self.head_dim} {what}"

    @property
    def short(self) -> str:
        return f"L{self.seqlen_k // 1024}K {self.kind}" if self.seqlen_k >= 1024 else \
            f"L{self.seqlen_k} {self.kind}"

    def io_bytes(self, dtype: torch.dtype) -> int:  # not a bandwidth suite
        return 0


def _workload(kind: str, L: int, variants, heads: int, kv_heads: int, dim: int,
              window: Optional[int] = None) -> CpWorkload:
    return CpWorkload(SUITE, 1, heads, kv_heads, L, L, dim, True,
                      mask="per-key" if kind == "dense+bias" else "none",
                      bias=kind != "dense", window=window, kind=kind, variants=tuple(variants))


def cp_workloads(quick: bool) -> List[CpWorkload]:
    if quick:
        dims = dict(heads=4, kv_heads=2, dim=16)
        return [
            _workload("dense", 256, [(1, "zigzag"), (2, "zigzag")], **dims),
            _workload("dma", 256, [(1, "zigzag"), (2, "contiguous")], window=32, **dims),
        ]
    dims = dict(heads=16, kv_heads=4, dim=128)
    z124 = [(1, "zigzag"), (2, "zigzag"), (4, "zigzag")]
    # The targets first (a run cut short by a time limit still has them).
    return [
        _workload("dense", 131072, z124 + [(4, "contiguous")], **dims),
        _workload("dense", 262144, z124, **dims),
        _workload("dma", 262144, z124, window=2048, **dims),
        _workload("dma", 1048576, [(4, "zigzag")], window=2048, **dims),
        _workload("dma", 524288, [(2, "zigzag")], window=2048, **dims),
        _workload("dense+bias", 131072, [(1, "zigzag"), (4, "zigzag")], **dims),
    ]


def _repeats(quick: bool) -> Tuple[int, int]:
    """(warm-up calls, timed calls) per row and phase."""
    text = os.environ.get(ENV_REPEATS, "").strip()
    if not text:
        return WARMUP[quick], RUNS[quick]
    try:
        warmup, runs = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{ENV_REPEATS} must be 'W,R' (warm-up and timed calls), got {text!r}")
    if warmup < 0 or runs < 1:
        raise ValueError(f"{ENV_REPEATS}: need W >= 0 and R >= 1, got {text!r}")
    return warmup, runs


def _variant_wanted(ranks: int, layout: str) -> bool:
    text = os.environ.get(ENV_VARIANTS, "").strip()
    if not text:
        return True
    for item in text.split(","):
        want_ranks, _, want_layout = item.strip().partition(":")
        if want_ranks and int(want_ranks) == ranks and want_layout in ("", layout):
            return True
    return False


def _launch_timeout(quick: bool) -> float:
    """Seconds the next launch may take: its own limit, or less when the deadline is nearer."""
    text = os.environ.get(ENV_LAUNCH_S, "").strip()
    limit = float(text) if text else LAUNCH_TIMEOUT_S[quick]
    deadline = os.environ.get(ENV_DEADLINE, "").strip()
    if deadline:
        limit = min(limit, float(deadline) - time.time())
    return limit


# ---------------------------------------------------------------------------------------------
# The launcher (the benchmarks.run process)


def _variant_label(ranks: int, layout: str) -> str:
    return f"context_parallel x{ranks} {layout}"


def _gpus_available(ctx) -> int:
    return torch.cuda.device_count() if ctx.cuda else 0


def run_cp_workload(w: CpWorkload, ctx, backends: List[str]) -> List[Row]:
    """Every variant of ``w`` (one launch each); failures become rows."""
    print(f"== {w.name}", flush=True)
    rows: List[Row] = []
    backend = backends[0] if len(backends) == 1 else None
    for ranks, layout in w.variants:
        label = _variant_label(ranks, layout)
        if not _variant_wanted(ranks, layout):
            row = Row(w.suite, w.name, w.short, label, "flash_dmattn", w.to_dict(), status=SKIPPED)
            row.notes.append(f"left out by {ENV_VARIANTS}={os.environ[ENV_VARIANTS]}")
            rows.append(row)
            print(f"   {label:<44} skipped: {row.notes[-1]}", flush=True)
            continue
        if _launch_timeout(ctx.quick) < MIN_LAUNCH_S:
            row = Row(w.suite, w.name, w.short, label, "flash_dmattn", w.to_dict(), status=SKIPPED)
            row.notes.append(f"not run: {ENV_DEADLINE} reached")
            rows.append(row)
            print(f"   {label:<44} skipped: {row.notes[-1]}", flush=True)
            continue
        if ctx.cuda and ranks > _gpus_available(ctx):
            row = Row(w.suite, w.name, w.short, label, "flash_dmattn", w.to_dict(), status=SKIPPED)
            row.notes.append(f"needs {ranks} GPUs; this machine has {_gpus_available(ctx)}")
            rows.append(row)
            print(f"   {label:<44} skipped: {row.notes[-1]}", flush=True)
            continue
        rows.extend(_launch(w, ranks, layout, ctx, backend))
    finish_rows(rows)
    return rows


def _launch(w: CpWorkload, ranks: int, layout: str, ctx, backend: Optional[str]) -> List[Row]:
    spec = {"workload": {k: v for k, v in asdict(w).items()}, "ranks": ranks, "layout": layout,
            "backend": backend, "quick": ctx.quick, "backward": ctx.backward,
            "repeats": _repeats(ctx.quick)}
    timeout = _launch_timeout(ctx.quick)
    label = _variant_label(ranks, layout)
    with tempfile.TemporaryDirectory(prefix="flash_dmattn_cp_") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", "-m", "benchmarks.cp", "--worker", str(spec_path),
               str(result_path)]
        start = time.perf_counter()
        try:
            res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            failure = None if res.returncode == 0 else (res.stderr or res.stdout)[-600:]
        except subprocess.TimeoutExpired:
            failure = f"the launch took longer than {timeout:.0f} s"
        doc = json.loads(result_path.read_text()) if result_path.exists() else None
    if doc is None:
        row = Row(w.suite, w.name, w.short, label, "flash_dmattn", w.to_dict(), status=ERROR)
        row.notes.append(f"torchrun with {ranks} processes failed: {failure}")
        print(f"   {label:<44} error: {failure}", flush=True)
        return [row]
    rows = []
    for d in doc["rows"]:
        row = Row(w.suite, w.name, w.short, d["impl"], d["kind"], w.to_dict(),
                  status=d.get("status", OK), fwd_ms=d.get("fwd_ms"), fwd_bwd_ms=d.get("fwd_bwd_ms"),
                  peak_extra_mib=d.get("peak_mib"), peak_phase="fwd+bwd" if d.get("fwd_bwd_ms") else "fwd",
                  is_speedup_baseline=d["kind"] == "baseline")
        row.notes.extend(d.get("notes", []))
        row.ratios.update(d.get("values", {}))
        row.shape = dict(row.shape, ranks=ranks, layout=layout)
        _rates(row, w)
        rows.append(row)
        print(f"   {row.impl:<44} fwd {_fmt(row.fwd_ms):>9} ms  fwd+bwd {_fmt(row.fwd_bwd_ms):>9} ms"
              f"  {row.status}{'  ' + '; '.join(row.notes) if row.notes else ''}", flush=True)
    print(f"   (launch of {ranks} processes: {time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _rates(row: Row, w: CpWorkload) -> None:
    # Nominal FLOPs of the whole problem (dense causal; the DMA rows count W keys per query).
    if w.kind == "dma":
        fwd = 4.0 * w.batch * w.heads * w.seqlen_q * min(w.window, w.seqlen_k) * w.head_dim
    else:
        fwd = w.flops_fwd()
    if row.fwd_ms:
        row.tflops_fwd = fwd / (row.fwd_ms * 1e-3) / 1e12
    if row.fwd_bwd_ms:
        row.tflops_fwd_bwd = 3.5 * fwd / (row.fwd_bwd_ms * 1e-3) / 1e12


def finish_rows(rows: List[Row]) -> None:
    """Speedups and scaling efficiencies against the one-GPU call of the same workload, and
    the norm cross-check (rel err) against it."""
    base = next((r for r in rows if r.is_speedup_baseline and r.fwd_bwd_ms), None)
    if base is None:
        base = next((r for r in rows if r.is_speedup_baseline and r.fwd_ms), None)
    for r in rows:
        if base is None or r is base:
            continue
        ranks = r.shape.get("ranks", 1)
        for phase, attr in (("fwd", "fwd_ms"), ("fwd+bwd", "fwd_bwd_ms")):
            mine, theirs = getattr(r, attr), getattr(base, attr)
            if mine and theirs:
                setattr(r, "speedup_fwd" if phase == "fwd" else "speedup_fwd_bwd", theirs / mine)
                r.ratios[f"efficiency {phase}"] = theirs / (ranks * mine)
        errs = []
        for name, value in r.ratios.items():
            if name.startswith("norm ") and base.ratios.get(name):
                errs.append(abs(value - base.ratios[name]) / base.ratios[name])
        if errs:
            r.rel_err = max(errs)
            r.rel_err_detail = {"norms vs 1 GPU": r.rel_err}
        if "efficiency fwd+bwd" in r.ratios:
            r.notes.insert(0, f"scaling efficiency fwd+bwd {100 * r.ratios['efficiency fwd+bwd']:.0f} %")
    for r in rows:
        if r.rel_err is None:
            r.rel_err_note = "n/a" if r is base or base is None else "-"


def summary_markdown(rows: List[Row]) -> List[str]:
    """The issue's targets against what this run measured."""
    def find(kind, L, ranks, layout="zigzag", impl="context_parallel"):
        for r in rows:
            s = r.shape
            if (s.get("kind") == kind and s.get("seqlen_k") == L and s.get("ranks") == ranks
                    and s.get("layout", layout) == layout and r.impl.startswith(impl)):
                return r
        return None

    out = ["| target | measured | verdict |", "|---|---|---|"]

    def verdict(ok: Optional[bool]) -> str:
        return "not measured" if ok is None else ("met" if ok else "**not met**")

    for L in (131072, 262144):
        r = find("dense", L, 4)
        eff = r.ratios.get("efficiency fwd+bwd") if r is not None else None
        out.append(f"| dense causal fwd+bwd L{L // 1024}K zigzag, 4 GPUs: scaling efficiency "
                   f">= {TARGET_EFFICIENCY:.0%} | {'-' if eff is None else f'{eff:.1%}'} | "
                   f"{verdict(None if eff is None else eff >= TARGET_EFFICIENCY)} |")
    one = find("dma", DMA_ANCHOR_LEN, 1, impl="flash_dmattn_func")
    four = find("dma", 4 * DMA_ANCHOR_LEN, 4)
    ratio = None
    if one is not None and four is not None and one.fwd_bwd_ms and four.fwd_bwd_ms:
        ratio = four.fwd_bwd_ms / one.fwd_bwd_ms
    out.append(f"| DMA causal top-W fwd+bwd, L1M on 4 GPUs <= {TARGET_DMA_RATIO}x one GPU at "
               f"L256K | {'-' if ratio is None else f'{ratio:.2f}x'} | "
               f"{verdict(None if ratio is None else ratio <= TARGET_DMA_RATIO)} |")
    traffic = [r.ratios["traffic / (selected K/V + bias)"] for r in rows
               if "traffic / (selected K/V + bias)" in r.ratios and r.shape.get("ranks", 1) > 1]
    worst = max(traffic) if traffic else None
    out.append(f"| DMA traffic per rank and pass <= {TARGET_TRAFFIC_RATIO}x (selected K/V bytes "
               f"+ bias bytes) | {'-' if worst is None else f'{worst:.2f}x (worst row)'} | "
               f"{verdict(None if worst is None else worst <= TARGET_TRAFFIC_RATIO)} |")
    return out


READING = (
    "cp: times are medians over runs of the slowest rank (barrier and device synchronisation "
    "around each call). speedup = the one-GPU call's time / this row's; scaling efficiency = "
    "one-GPU time / (ranks x this row's time). TFLOP/s count the whole problem (all ranks), W "
    "keys per query on DMA rows. rel err = the largest relative difference of the norms of the "
    "output and every gradient from the one-GPU call's (a cross-check only). Notes give the "
    "traffic per rank and pass (the larger of bytes sent and received, largest rank); on DMA "
    "rows also that traffic over the selected K/V bytes (the remote keys a rank's queries "
    "select, or the rank's keys the others select, whichever is more) plus the bias bytes "
    "(the per-key bias of the whole sequence)."
)


# ---------------------------------------------------------------------------------------------
# The worker (one process per rank, under torchrun)


def _block_len(L: int) -> int:
    # Segments of every variant are multiples of L / 8 (zigzag on 4 ranks).
    return max(1, min(4096, L // 8))


def _blocks(shape_tail, L, rank, ranks, layout, seed, device, dtype, scale=1.0):
    """This rank's shard ``(1, n, *shape_tail)`` of a random sequence whose every block of
    tokens comes from its own seed (the same sequence whatever the ranks and layout)."""
    from flash_dmattn.distributed import shard_segments

    blk = _block_len(L)
    pieces = []
    for start, length in shard_segments(layout, rank, ranks, L // ranks):
        for b0 in range(start, start + length, blk):
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + b0 // blk)
            pieces.append(scale * torch.randn(1, blk, *shape_tail, generator=g, device=device,
                                              dtype=torch.float32))
    return torch.cat(pieces, 1).to(dtype)


def _timed(fn, device, warmup: int, runs: int) -> float:
    """Median over ``runs`` of the slowest rank's time of ``fn()``, in ms."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(runs):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item() * 1e3)
    return statistics.median(times)


def _max_over_ranks(values: List[float], device) -> List[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum_over_ranks(values: List[float], device) -> List[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _selected_bytes(intervals, rank, ranks, layout, n, kv_row_bytes, device) -> Tuple[float, float]:
    """K/V bytes of the remote keys this rank's queries select, and of this rank's keys the
    other ranks' queries select (causal): key ``j`` of head ``h`` is selected by a rank iff
    ``[max(start, j), end)`` meets one of that rank's query ranges."""
    from flash_dmattn.distributed import shard_positions, shard_segments

    start, end = intervals.start.to(torch.int64), intervals.end.to(torch.int64)
    L = start.shape[-1]
    lo = torch.maximum(start, torch.arange(L, device=device))

    def seen_by(r: int) -> torch.Tensor:
        seen = torch.zeros(start.shape, dtype=torch.bool, device=device)
        for a, m in shard_segments(layout, r, ranks, n):
            seen |= (lo < a + m) & (end > a) & (lo < end)
        return seen

    mine = torch.zeros(L, dtype=torch.bool, device=device)
    mine[shard_positions(layout, rank, ranks, n, device)] = True
    by_me = float((seen_by(rank) & ~mine).sum().item())
    from_me = sum(float((seen_by(r) & mine).sum().item()) for r in range(ranks) if r != rank)
    return by_me * kv_row_bytes, from_me * kv_row_bytes


def worker_main(spec_path: str, result_path: str) -> int:
    import torch.distributed as dist

    from flash_dmattn import flash_dmattn_func_auto
    from flash_dmattn.distributed import (
        context_parallel_attention,
        context_parallel_dma_attention,
        record_communication,
    )
    from flash_dmattn.utils.mask import topk_intervals

    spec = json.loads(Path(spec_path).read_text())
    wd = dict(spec["workload"])
    wd["variants"] = tuple(tuple(v) for v in wd["variants"])
    w = CpWorkload(**wd)
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(minutes=20)
    if cuda:
        # The rank's GPU is current before NCCL starts, and the communicator is made at once
        # (device_id) rather than by whichever operation comes first.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    layout, backend = spec["layout"], spec["backend"]
    L, n = w.seqlen_k, w.seqlen_k // ranks
    H, Hkv, D = w.heads, w.kv_heads, w.head_dim

    def shard(tail, seed, scale=1.0):
        return _blocks(tail, L, rank, ranks, layout, seed, device, dtype, scale)

    q, k, v, dout = shard((H, D), 1), shard((Hkv, D), 2), shard((Hkv, D), 3), shard((H, D), 4)
    bias = mask = None
    if w.kind != "dense":
        bias = shard((Hkv,), 5, scale=2.0).permute(0, 2, 1).unsqueeze(2).contiguous()  # (1, Hkv, 1, n)
    if w.kind == "dense+bias":
        mask = (shard((1,), 6).permute(0, 2, 1).unsqueeze(2) > -1.0)  # about 84 % of keys live

    single = flash_dmattn_func_auto(backend)  # flash_dmattn_func when backend is None

    def cp_call(q_, k_, v_, b_):
        # seq_len: the lengths are known, no exchange before the call (as a training loop would)
        if w.kind == "dma":
            return context_parallel_dma_attention(q_, k_, v_, b_, w.window, is_causal=True,
                                                  layout=layout, backend=backend, seq_len=L)
        return context_parallel_attention(q_, k_, v_, attn_mask=mask, attn_bias=b_, is_causal=True,
                                          layout=layout, backend=backend, seq_len=L)

    def one_call(q_, k_, v_, b_):
        attn_mask = mask
        if w.kind == "dma":
            attn_mask = topk_intervals(b_.detach(), w.window, is_causal=True)
        return single(q_, k_, v_, attn_mask=attn_mask, attn_bias=b_, is_causal=True)

    impls = [(_variant_label(ranks, layout), "flash_dmattn", cp_call)]
    if ranks == 1:
        impls.insert(0, ("flash_dmattn_func (one call, 1 GPU)", "baseline", one_call))
    warmup, runs = spec["repeats"]
    rows = []
    for name, kind, fn in impls:
        row: Dict[str, object] = {"impl": name, "kind": kind, "notes": [], "values": {}}
        try:
            leaves = [t for t in (q, k, v, bias) if t is not None]
            with torch.no_grad():
                row["fwd_ms"] = _timed(lambda: fn(q, k, v, bias), device, warmup, runs)
            if spec["backward"]:
                grads = {}

                def step():
                    fresh = [t.detach().requires_grad_() for t in leaves]
                    out = fn(*fresh, *([None] * (4 - len(fresh))))
                    out.backward(dout)
                    grads.update(out=out.detach(), **dict(zip(("dq", "dk", "dv", "dbias"),
                                                               (t.grad for t in fresh))))

                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                row["fwd_bwd_ms"] = _timed(step, device, warmup, runs)
                if cuda:
                    peak = torch.cuda.max_memory_allocated(device) - before
                    row["peak_mib"] = _max_over_ranks([peak / 2**20], device)[0]
                names = sorted(grads)
                norms = _sum_over_ranks([grads[x].double().pow(2).sum().item() for x in names], device)
                row["values"].update({f"norm {x}": v ** 0.5 for x, v in zip(names, norms)})
                if kind == "flash_dmattn":
                    _traffic(row, fn, leaves, dout, w, rank, ranks, layout, backend, n, dtype,
                             device, record_communication)
        except Exception as exc:  # noqa: BLE001  (one failing row must not end the variant)
            row["status"] = ERROR
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            row["notes"].append(f"error: {type(exc).__name__}: {text[:240]}")
            if rank == 0:
                traceback.print_exc()
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        Path(result_path).write_text(json.dumps({"rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0


def _traffic(row, fn, leaves, dout, w, rank, ranks, layout, backend, n, dtype, device,
             record_communication) -> None:
    """Bytes a rank moves in one forward and one backward (largest rank), and on DMA rows that
    traffic over the selected remote keys' K/V bytes plus the bias bytes."""
    fresh = [t.detach().requires_grad_() for t in leaves]
    with record_communication() as fwd_log:
        out = fn(*fresh, *([None] * (4 - len(fresh))))
    with record_communication() as bwd_log:
        out.backward(dout)
    # A pass's traffic on a rank: the larger of what it sends and what it receives.
    fwd_bytes = float(max(fwd_log.total_sent, fwd_log.total_received))
    bwd_bytes = float(max(bwd_log.total_sent, bwd_log.total_received))
    values = [fwd_bytes, bwd_bytes]
    if w.kind == "dma":
        elem = torch.finfo(dtype).bits // 8
        # The selection every rank made: the same topk_intervals on the gathered bias.
        from flash_dmattn.distributed import context_parallel_dma_attention

        with torch.no_grad():
            _, intervals = context_parallel_dma_attention(
                *[t.detach() for t in leaves], w.window, is_causal=True, layout=layout,
                backend=backend, return_intervals=True)
        by_me, from_me = _selected_bytes(intervals, rank, ranks, layout, n,
                                         2 * w.head_dim * elem, device)
        # Selected K/V moving through this rank: those its queries select (received in the
        # forward, their gradients sent in the backward) or those of its keys the others
        # select (sent, then their gradients received), whichever is more.
        selected = max(by_me, from_me)
        bias_bytes = float(w.batch * w.kv_heads * w.seqlen_k * elem)
        values += [selected, bias_bytes, max(fwd_bytes, bwd_bytes) / (selected + bias_bytes)]
    got = _max_over_ranks(values, device)
    mib = 2 ** 20
    row["notes"].append(f"traffic per rank (sent or received, the larger): fwd {got[0] / mib:.1f} "
                        f"MiB, bwd {got[1] / mib:.1f} MiB")
    if w.kind == "dma":
        row["values"]["traffic / (selected K/V + bias)"] = got[4]
        row["notes"].append(f"selected remote K/V {got[2] / mib:.1f} MiB + bias {got[3] / mib:.1f} "
                            f"MiB; traffic {got[4]:.2f}x that")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp",
                                     description="one variant of the cp suite (run by benchmarks.run)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), required=True)
    args = parser.parse_args(argv)
    return worker_main(*args.worker)


if __name__ == "__main__":
    sys.exit(main())
