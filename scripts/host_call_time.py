"""Host time per public forward call of a suite's first workload, for A/B of host overhead.

    python3 scripts/host_call_time.py [--suite upstream] [--calls 2000] [--backends triton]
                                      [--isolated] [--profile]

Issues ``--calls`` forward calls back to back without synchronising (the GPU queue absorbs
them while the host is slower than the GPU) and prints the host time per call, five times.
``--isolated``: instead, the host time of single calls that start on an idle GPU (a call
that waits for the device shows its GPU time here); ``--profile``: also the cProfile top
of 50 calls of the first backend. Run it from two trees (``cd exp_base && python3 ../scripts/host_call_time.py``: the working
directory's package comes first) alternately to compare them.
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="upstream")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--isolated", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    w = workloads_for(args.suite, quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    for i, backend in enumerate(args.backends.split(",")):
        attn = flash_dmattn_func_auto(backend)
        call = lambda: attn(case.q, case.k, case.v, attn_mask=case.mask, attn_bias=case.bias,
                            is_causal=w.causal)
        if args.isolated:
            _isolated(call, backend)
        else:
            _queued(call, args.calls, backend)
        if args.profile and i == 0:
            _profile(call)


def _isolated(call, backend):
    with torch.no_grad():
        for _ in range(20):
            call()
        times = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    q = statistics.quantiles(times, n=10)
    print(f"{backend}: host ms per isolated call: median {statistics.median(times):.4f}, "
          f"p10 {q[0]:.4f}, p90 {q[-1]:.4f}")


def _profile(call):
    import cProfile
    import pstats

    with torch.no_grad():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            call()
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _queued(call, calls, backend):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - t0) * 1e3 / calls)
        torch.cuda.synchronize()
    import flash_dmattn
    print(f"{flash_dmattn.__file__} {backend}: host ms per call {statistics.median(per_call):.4f} "
          f"(runs {' '.join(f'{t:.4f}' for t in per_call)})")


if __name__ == "__main__":
    main()
