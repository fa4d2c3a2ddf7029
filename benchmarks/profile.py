"""Where the time of one flash_dmattn call goes: a per-op table from ``torch.profiler``.

The benchmark (``benchmarks.run``) says how long a call takes; this says which kernels and
host-side steps (tile-list and gather-list construction, the forward kernel, the backward's
preprocess / dK-dV / dQ kernels) make up that time, for the benchmark's own workloads::

    python -m benchmarks.profile [--suite dynamic,dense] [--backends triton,flex] [--quick]
                                 [--no-bwd] [--rows 25] [--iters 5] [--out DIR]

Each (workload, backend) pair is warmed up (compiles, autotuning), then ``--iters`` calls
(forward, or forward + backward) run under the profiler; the table lists the top ``--rows``
ops by self device time (self CPU time on CPU), per call. ``--out`` also writes the tables to
``<out>/profile-<suites>.txt``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

import torch
from torch.profiler import ProfilerActivity, profile

from flash_dmattn import flash_dmattn_func_auto, get_available_backends

from .workloads import CORE_SUITES, build_case, core_workloads


def _call(fn, case, backward: bool) -> None:
    leaves = [t.detach().requires_grad_(backward) for t in (case.q, case.k, case.v)]
    bias = case.bias
    if bias is not None:
        bias = bias.detach().requires_grad_(backward)
    extra = {} if case.cache_seqlens is None else {"cache_seqlens": case.cache_seqlens}
    out = fn(*leaves, attn_mask=case.mask, attn_bias=bias, is_causal=case.workload.causal, **extra)
    if backward:
        grads = leaves + ([bias] if bias is not None else [])
        torch.autograd.grad(out, grads, case.grad_out)


def profile_pair(case, backend: str, backward: bool, iters: int, rows: int) -> str:
    """The per-op table of ``iters`` calls of ``backend`` on ``case`` (after warm-up)."""
    fn = flash_dmattn_func_auto(backend)
    cuda = case.device.type == "cuda"
    for _ in range(3):  # compile, autotune, fill caches
        _call(fn, case, backward)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            _call(fn, case, backward)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    return f"(totals over {iters} calls)\n{table}"


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="dynamic,dense", help=f"comma list of {', '.join(CORE_SUITES)}")
    parser.add_argument("--backends", default="triton,flex", help="comma list of flash_dmattn backends")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--no-bwd", action="store_true", help="forward only")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the tables to <out>/profile-<suites>.txt")
    args = parser.parse_args(argv)
    suites = [s for s in args.suite.split(",") if s]
    unknown = [s for s in suites if s not in CORE_SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {CORE_SUITES}")
    available = get_available_backends()
    backends = [b for b in args.backends.split(",") if b in available]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chunks = [f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
              f"torch {torch.__version__}; backends {backends} (available: {available})"]
    for suite in suites:
        for w in core_workloads(suite, args.quick):
            case = build_case(w, device, dtype)
            backward = not (args.no_bwd or w.forward_only)
            for backend in backends:
                head = f"== {w.name} | {backend} | {'fwd+bwd' if backward else 'fwd'}"
                try:
                    body = profile_pair(case, backend, backward, args.iters, args.rows)
                except Exception as exc:  # a declined or failing pair must not end the run
                    body = f"   not run: {type(exc).__name__}: {str(exc).strip()[:300]}"
                chunks.append(f"{head}\n{body}")
                print(chunks[-1], flush=True)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        path = Path(args.out) / f"profile-{'-'.join(suites)}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(chunks) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
