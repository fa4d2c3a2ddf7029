"""Cost of attention dropout on a GPU: forward + backward with ``dropout_p`` 0 and 0.1 on each
backend with dropout kernels (triton, cuda), bf16, B1 H16/Hkv4 D128.

    python3 tools/dropout_probe.py [--lengths 16384] [--dma-lengths 32768] [--p 0.1]
                                   [--backends triton,cuda] [--profile]

Rows: dense causal attention, and a causal top-2048 selection of a per-key bias (key-interval
mask, bias gradient included). Medians of do_bench of the forward and of forward + backward;
the fwd+bwd ratio is the issue's "at most 15 % more" target. ``--profile`` adds each kernel's
device time in one fwd+bwd with and without dropout (torch.profiler), so that the extra time
shows per kernel (forward, dQ, dK/dV, planning).
"""
import argparse

import torch
from triton.testing import do_bench

import flash_dmattn as fd
from flash_dmattn.utils.mask import topk_intervals


def fwd_bwd(call, q, k, v, g, **kw):
    leaves = [t for t in (q, k, v, kw.get("attn_bias")) if t is not None]

    def run(p):
        out = call(q, k, v, is_causal=True, dropout_p=p, **kw)
        return torch.autograd.grad(out, leaves, g)
    return run


def fwd_only(call, q, k, v, **kw):
    def run(p):
        with torch.no_grad():
            return call(q, k, v, is_causal=True, dropout_p=p, **kw)
    return run


def kernel_times(run, p):
    """Device microseconds per kernel name in one ``run(p)`` (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    run(p)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(p)
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.key] = times.get(e.key, 0.0) + e.self_device_time_total
    return times


def print_kernel_times(run, p):
    base, drop = kernel_times(run, 0.0), kernel_times(run, p)
    for name in sorted(set(base) | set(drop), key=lambda n: -drop.get(n, 0.0))[:12]:
        b, d = base.get(name, 0.0), drop.get(name, 0.0)
        print(f"    {b:9.1f} us -> {d:9.1f} us  {name[:90]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--dma-lengths", default="32768")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--backends", default="triton,cuda")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel device time of one fwd+bwd, p=0 against p")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    B, H, Hkv, D, W = 1, 16, 4, 128, 2048
    print(torch.cuda.get_device_name(), flush=True)
    rows = [("dense causal", int(x), False) for x in a.lengths.split(",") if x]
    rows += [("causal top-2048", int(x), True) for x in a.dma_lengths.split(",") if x]
    for name, L, dma in rows:
        q = torch.randn(B, L, H, D, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(B, L, H, D, device=dev, dtype=dt)
        kw = {}
        if dma:
            bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt, requires_grad=True)
            kw = dict(attn_mask=topk_intervals(bias.detach(), W), attn_bias=bias)
        for backend in a.backends.split(","):
            call = fd.flash_dmattn_func_auto(backend=backend)
            for what, run in (("fwd", fwd_only(call, q, k, v, **kw)),
                              ("fwd+bwd", fwd_bwd(call, q, k, v, g, **kw))):
                t0 = do_bench(lambda: run(0.0), warmup=10, rep=200, return_mode="median")
                t1 = do_bench(lambda: run(a.p), warmup=10, rep=200, return_mode="median")
                print(f"L{L} {name} {backend}: {what} p=0 {t0:.3f} ms, p={a.p} {t1:.3f} ms, "
                      f"{t1 / t0:.3f}x", flush=True)
                if a.profile and what == "fwd+bwd":
                    print_kernel_times(run, a.p)


if __name__ == "__main__":
    main()
