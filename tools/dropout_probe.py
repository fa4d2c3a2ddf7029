"""Cost of attention dropout on a GPU: forward + backward with ``dropout_p`` 0 and 0.1 on each
backend with dropout kernels (triton, cuda), bf16, B1 H16/Hkv4 D128.

    python3 tools/dropout_probe.py [--lengths 16384] [--dma-lengths 32768] [--p 0.1]
                                   [--backends triton,cuda]

Rows: dense causal attention, and a causal top-2048 selection of a per-key bias (key-interval
mask, bias gradient included). Medians of do_bench; the ratio is the issue's "at most 15 %
more" target.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--dma-lengths", default="32768")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--backends", default="triton,cuda")
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
            run = fwd_bwd(fd.flash_dmattn_func_auto(backend=backend), q, k, v, g, **kw)
            t0 = do_bench(lambda: run(0.0), warmup=10, rep=200, return_mode="median")
            t1 = do_bench(lambda: run(a.p), warmup=10, rep=200, return_mode="median")
            print(f"L{L} {name} {backend}: fwd+bwd p=0 {t0:.3f} ms, p={a.p} {t1:.3f} ms, "
                  f"{t1 / t0:.3f}x", flush=True)


if __name__ == "__main__":
    main()
