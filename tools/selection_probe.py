"""Timings of the causal top-W selection alone (``topk_intervals``), beside tools/dma_probe.py.

    python3 tools/selection_probe.py [L ...] [--window W] [--heads H] [--batch B]
                                       [--dtype bf16|fp16|fp32] [--radix 3,4,5] [--shared]
                                       [--query 64x8,128x4] [--no-check] [--no-profile]
    python3 tools/selection_probe.py --host-stub [L ...]   # no GPU: host time, launches stubbed

On a GPU, per L (default 16K 32K 64K 128K; bf16 bias (B1, Hkv4, 1, L), W 2048): the median of
do_bench (device time, L2 flushed between calls), the host time of one call (the wall time of
enqueuing 50 calls back to back while the device runs behind, as dma_probe's ``host_ms``), the
Triton launches of one call, a bit-for-bit check against the plain-PyTorch path, and a
torch.profiler table of one call (its kernels and their device times). ``--radix`` times the
same call with other radices of the wavelet tree (bits per level; the library picks 4 or 5 by
L), to decide that rule on the device; ``--query BxW,...`` times it with other key blocks (B)
and warps (W) of the query kernel.

Without a GPU the same code runs on CPU tensors under TRITON_INTERPRET=1 (tiny lengths only:
the interpreter is slow; the times mean nothing, the script is exercised). ``--host-stub``
measures the host (Python) work of a call on a machine without GPU: Triton's launch path runs
up to its C launcher, which is replaced by a no-op, as is compilation; torch.sort is replaced by
its two output allocations. It prints launches and microseconds per call.

Internal modules: ``planning.selection`` (its plain-PyTorch reference) and
``planning.selection_kernels`` (the radix rule, and stubs for ``--host-stub``) are reached
directly; the timed call is the public ``topk_intervals``.
"""
import argparse
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _count_launches(selection_kernels):
    """Wrap the selection kernels so that every launch is listed; returns the list."""
    launches = []

    class Counting:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("_score_kernel", "_prep_kernel", "_partition_kernel", "_query_kernel"):
        kernel = getattr(selection_kernels, name)
        if isinstance(kernel, Counting):
            continue
        setattr(selection_kernels, name, Counting(kernel, name))
    return launches


def wall_ms(fn, calls=5):
    """Median wall time (CPU runs: the interpreter's time, not the kernels')."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def probe(a):
    from flash_dmattn.planning import selection, selection_kernels
    from flash_dmattn.utils.mask import topk_intervals

    # The sibling tool's host timing (tools/ is this script's path), imported here and not at
    # the top: it imports flash_dmattn, which --host-stub must import after setting up Triton.
    from dma_probe import host_ms

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if not cuda and not selection_kernels.available(torch.device("cpu")):
        sys.exit("no GPU: run with TRITON_INTERPRET=1 (tiny lengths) or --host-stub")
    print(torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)", flush=True)
    launches = _count_launches(selection_kernels)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        from triton.testing import do_bench

        def device_ms(fn):
            return do_bench(fn, warmup=25, rep=200, return_mode="median")
    else:
        device_ms = wall_ms
    radices = [int(r) for r in a.radix.split(",")] if a.radix else [None]
    queries = [tuple(int(v) for v in q.split("x")) for q in a.query.split(",")] if a.query \
        else [None]
    default_rule = selection_kernels.radix_bits
    default_query = selection_kernels.QUERY_BLOCK, selection_kernels.QUERY_WARPS
    dtype = DTYPES[a.dtype]
    is_causal = not a.shared
    for length in a.lengths:
        g = torch.Generator(device=dev).manual_seed(length)
        bias = torch.randn(a.batch, a.heads, 1, length, device=dev, generator=g).to(dtype)
        for rb, query in ((rb, q) for rb in radices for q in queries):
            selection_kernels.radix_bits = default_rule if rb is None else (lambda n, rb=rb: rb)
            selection_kernels.QUERY_BLOCK, selection_kernels.QUERY_WARPS = query or default_query
            try:
                def call():
                    return topk_intervals(bias, a.window, is_causal=is_causal)

                got = call()
                sync()
                launches.clear()
                call()
                n_launch = list(launches)
                t_dev = device_ms(call)
                t_host = host_ms(call, calls=50 if cuda else 3, sync=sync)
                check = ""
                if a.check:
                    want = selection._topk_intervals_torch(bias, a.window, is_causal=is_causal)
                    check = " same as plain path" if torch.equal(got.bounds, want.bounds) else \
                        " DIFFERS FROM THE PLAIN PATH"
                used = default_rule(length) if rb is None else rb
                print(f"L{length} W{a.window} B{a.batch} H{a.heads} {a.dtype} "
                      f"{'causal' if is_causal else 'shared'} radix bits {used}"
                      f"{'' if rb is None else ' (forced)'}"
                      f"{'' if query is None else ' query %dx%d' % query}: "
                      f"select {t_dev:.3f} ms "
                      f"(host {t_host:.3f} ms) | {len(n_launch)} Triton launches "
                      f"{','.join(n[1:-7] for n in n_launch)}{check}", flush=True)
                if a.profile:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                    with profile(activities=acts) as prof:
                        call()
                        sync()
                    print(prof.key_averages().table(
                        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=20,
                        max_name_column_width=70), flush=True)
            finally:
                selection_kernels.radix_bits = default_rule
                selection_kernels.QUERY_BLOCK, selection_kernels.QUERY_WARPS = default_query


def host_stub(a):
    """Host work of a causal call without a GPU (see the module docstring)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    class FakeKernel:
        packed_metadata = None
        function = None

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            pass

    def fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = FakeKernel()
        self.device_caches[device][0][key] = kernel
        return kernel

    driver.set_active(FakeDriver())
    jit.JITFunction._do_compile = fake_compile
    from flash_dmattn.planning import selection_kernels
    from flash_dmattn.utils.mask import topk_intervals

    selection_kernels.available = lambda device, rows=1, length=1: True
    launches = _count_launches(selection_kernels)
    real_sort = torch.sort

    def sort_outputs(x, dim=-1, descending=False, stable=False):
        return torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64)

    torch.sort = sort_outputs
    try:
        for length in a.lengths:
            bias = torch.randn(a.batch, a.heads, 1, length).to(DTYPES[a.dtype])
            window = min(a.window, length - 1)
            topk_intervals(bias, window)
            launches.clear()
            topk_intervals(bias, window)
            n_launch = list(launches)
            times = []
            for _ in range(2000):
                t0 = time.perf_counter()
                topk_intervals(bias, window)
                times.append(time.perf_counter() - t0)
            times.sort()
            print(f"L{length} W{window}: {len(n_launch)} Triton launches "
                  f"({','.join(n[1:-7] for n in n_launch)}), host {times[len(times) // 2] * 1e6:.1f}"
                  f" us a call (median of 2000; launcher, compile and sort stubbed)", flush=True)
    finally:
        torch.sort = real_sort


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lengths", nargs="*", type=int)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--radix", default="",
                    help="comma-separated radix bits to compare (e.g. 3,4,5; at most 5)")
    ap.add_argument("--query", default="",
                    help="comma-separated query kernel blocks x warps to compare (e.g. 64x8,128x4)")
    ap.add_argument("--shared", action="store_true", help="is_causal=False (a shared top-W)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--host-stub", action="store_true")
    a = ap.parse_args(argv)
    if not a.lengths:
        a.lengths = [16384, 32768, 65536, 131072]
    if a.host_stub:
        host_stub(a)
    else:
        probe(a)


if __name__ == "__main__":
    main()
