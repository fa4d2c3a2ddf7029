"""Where the host time of one Triton decode step goes (GPU only): cProfile over many calls.

Usage: python3 scripts/decode_overhead.py [Lk]  -- prints per-call wall time (eager, and a
CUDA-graph replay for comparison) and the top functions by cumulative time.
"""
import cProfile
import pstats
import sys
import time

import torch

from flash_dmattn import flash_dmattn_func_auto


def main() -> None:
    lk = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    dev, dt = "cuda", torch.bfloat16
    attn = flash_dmattn_func_auto("triton")
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    k = torch.randn(1, lk, 8, 128, device=dev, dtype=dt)
    v = torch.randn(1, lk, 8, 128, device=dev, dtype=dt)
    bias = torch.randn(1, 8, 1, lk, device=dev, dtype=dt)
    mask = bias > 0
    for label, kw in (("no mask", {}), ("mask+bias", dict(attn_mask=mask, attn_bias=bias))):
        def call():
            return attn(q, k, v, **kw)
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / n * 1e6
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
        graph = (time.perf_counter() - t0) / n * 1e6
        print(f"Lk {lk} {label}: eager {eager:.1f} us/call, graph replay {graph:.1f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(28)


if __name__ == "__main__":
    main()
