"""Host side of one call: where it waits for the GPU, and how long it takes to issue.

    python3 scripts/host_sync_probe.py [--suite dynamic] [--backend triton]

For the suite's first full-size workload, for a forward and for a forward + backward:

* every synchronising CUDA call it makes (``torch.cuda.set_sync_debug_mode("warn")``), with
  the library frames of the Python stack that made it;
* host time to issue one call (until it returns, GPU work still queued) and wall time to its
  end, medians over 30 calls each started on an idle GPU;
* the GPU kernel time of one call (profiler) against ``do_bench``'s back-to-back time: when
  the two differ the GPU waited for the host between kernels.
"""
import argparse
import statistics
import sys
import time
import traceback
import warnings

import torch
import triton.testing

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402


def sync_sites(fn):
    """Library stack frames (file:line function) of each synchronising call ``fn`` makes."""
    sites = []
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack
                      if "flash_dmattn" in f.filename or "benchmarks" in f.filename]
            frames = frames or stack[-3:]  # outside the library: say where
            sites.append(" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                                     for f in reversed(frames[-4:])))

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old_show
    torch.cuda.synchronize()
    return sites


def host_times(fn, n=30):
    issue, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return statistics.median(issue), statistics.median(wall)


def gpu_kernel_ms(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def print_host_profile(fn, top):
    """cProfile of 20 calls: the ``top`` functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
        print(f"   cProfile by {key} (20 calls):")
        for ln in lines[start:start + top + 1]:
            print("     " + ln[:150])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="dynamic")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also print the N functions with the most host time (cProfile)")
    args = ap.parse_args()
    w = workloads_for(args.suite, quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    attn = flash_dmattn_func_auto(args.backend)
    q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
    bias = case.bias.detach().requires_grad_() if case.bias is not None else None
    grads = tuple(t for t in (q, k, v, bias) if t is not None)
    call = lambda: attn(case.q, case.k, case.v, attn_mask=case.mask, attn_bias=case.bias,
                        is_causal=w.causal)
    step = lambda: torch.autograd.grad(
        attn(q, k, v, attn_mask=case.mask, attn_bias=bias, is_causal=w.causal), grads,
        case.grad_out)
    print(f"== host probe on {torch.cuda.get_device_name()}: {args.suite} {w.label if hasattr(w, 'label') else w}"
          f", backend {args.backend}")
    for name, fn in (("fwd", call), ("fwd+bwd", step)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        sites = sync_sites(fn)
        print(f"== {name}: {len(sites)} synchronising call(s)")
        for s in sites:
            print(f"   sync at {s}")
        issue, wall = host_times(fn)
        kernels = gpu_kernel_ms(fn)
        bench = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"   host issue {issue:.3f} ms, wall from idle {wall:.3f} ms, GPU kernels "
              f"{kernels:.3f} ms, do_bench back-to-back {bench:.3f} ms "
              f"(GPU idle {max(0.0, bench - kernels):.3f} ms per call)")
        if args.cprofile:
            print_host_profile(fn, args.cprofile)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
