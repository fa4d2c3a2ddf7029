"""CPU: a user's call through auto-dispatch against PyTorch's own SDPA on the same call.

    python -m benchmarks.cpu_sdpa [--lengths 64,256,1024,4096] [--cases plain,masked]
                                  [--modes infer,fwd,fwd+bwd] [--budget-s 3] [--threads N]

B1 H8/Hkv2 D64, float32, causal. Cases:

* ``plain``: no mask, no bias. ``sdpa`` is one call with ``is_causal=True, enable_gqa=True``
  on the transposed (heads-first) views, as a user of SDPA would write it.
* ``masked``: a per-key top-W mask (``create_mask``, W = min(``--window``, L/4)) and a per-key
  bias. ``sdpa`` builds the mask out to ``(B, H, L, L)`` (causal and top-W folded into one
  additive float mask, repeated over the query heads) inside the timed region.

Modes: ``infer`` under ``torch.no_grad()``; ``fwd`` the forward of a training step (inputs and
bias need gradients); ``fwd+bwd`` that forward and ``torch.autograd.grad`` of every input.

The two functions alternate within each repetition (their order swapping every repetition), so
a change in the machine's load reaches both alike; each row repeats for ``--budget-s`` seconds
(at least ``--min-reps`` times; ``--budget-s`` counts wall-clock time). Printed: each function's median and its 10th-90th percentile
range in ms, and the median of the per-repetition ratios with their 10th-90th percentiles (the
noise). The load average before and after the run is printed too: on a 2-core machine whose
cores other processes hold, every parallel op waits for its second thread and the spread grows;
``--threads 1 --clock cpu`` then still compares the work each call does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import flash_dmattn as fd
from flash_dmattn.utils.mask import create_mask


def _pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def measure(ours, sdpa, budget_s: float, min_reps: int, clock=time.perf_counter) -> dict:
    """Alternating timings of ``ours`` and ``sdpa``: medians, 10th-90th percentiles (ms) and the
    per-repetition ratio ours / sdpa."""
    for fn in (ours, sdpa, ours, sdpa):
        fn()
    t_ours, t_sdpa = [], []
    start = time.perf_counter()
    rep = 0
    while rep < min_reps or time.perf_counter() - start < budget_s:
        pair = ((ours, t_ours), (sdpa, t_sdpa))
        for fn, ts in (pair if rep % 2 == 0 else pair[::-1]):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        rep += 1
    ratios = [a / b for a, b in zip(t_ours, t_sdpa)]
    row = {"reps": rep}
    for name, ts in (("ours", t_ours), ("sdpa", t_sdpa), ("ratio", ratios)):
        scale = 1.0 if name == "ratio" else 1e3
        row[name] = tuple(scale * x for x in (statistics.median(ts), _pct(ts, 0.1), _pct(ts, 0.9)))
    return row


def problem(case: str, length: int, window: int):
    """Inputs and the two functions (``ours``, ``sdpa``) of one case, by mode."""
    g = torch.Generator().manual_seed(0)
    B, L, H, Hkv, D = 1, length, 8, 2, 64
    q = torch.randn(B, L, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, L, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, L, Hkv, D, generator=g, requires_grad=True)
    leaves = [q, k, v]
    if case == "masked":
        bias = torch.randn(B, Hkv, 1, L, generator=g, requires_grad=True)
        mask = create_mask(bias.detach(), window_size=max(1, min(window, L // 4)))
        leaves.append(bias)

        def ours():
            return fd.flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

        def sdpa():
            j = torch.arange(L)
            keep = mask.expand(B, Hkv, L, L) & (j[None, :] <= j[:, None])
            add = bias.expand(B, Hkv, L, L).masked_fill(~keep, float("-inf"))
            add = add.repeat_interleave(H // Hkv, dim=1)
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                  attn_mask=add, enable_gqa=True).transpose(1, 2)
    else:
        def ours():
            return fd.flash_dmattn_func(q, k, v, is_causal=True)

        def sdpa():
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)

    def mode(fn, name: str):
        if name == "infer":
            def run():
                with torch.no_grad():
                    fn()
        elif name == "fwd":
            def run():
                fn()
        else:
            def run():
                torch.autograd.grad(fn().sum(), leaves)
        return run

    return lambda name: (mode(ours, name), mode(sdpa, name))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="64,256,1024,4096")
    ap.add_argument("--cases", default="plain,masked")
    ap.add_argument("--modes", default="infer,fwd,fwd+bwd")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=3.0, help="seconds of repetitions a row")
    ap.add_argument("--min-reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1 all of the work "
                         "runs there): time spent waiting for a core that another process holds "
                         "is not counted")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu counts one thread's time: use it with --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"{a.clock} clock; B1 H8/2 D64 fp32 causal; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("ms: median [p10-p90]; ratio = flash_dmattn / sdpa per repetition, median [p10-p90]")
    print(f"{'case':7s} {'L':>5s} {'mode':8s} {'reps':>5s} {'flash_dmattn (auto)':>26s} "
          f"{'sdpa':>26s} {'ratio':>19s}")
    for case in a.cases.split(","):
        for length in (int(x) for x in a.lengths.split(",")):
            fns = problem(case, length, a.window)
            for name in a.modes.split(","):
                row = measure(*fns(name), a.budget_s, a.min_reps, clock)
                cells = [f"{m:8.3f} [{lo:7.3f}-{hi:7.3f}]" for m, lo, hi in (row["ours"], row["sdpa"])]
                r, rlo, rhi = row["ratio"]
                print(f"{case:7s} {length:5d} {name:8s} {row['reps']:5d} {cells[0]:>26s} "
                      f"{cells[1]:>26s} {r:6.2f} [{rlo:4.2f}-{rhi:4.2f}]", flush=True)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
