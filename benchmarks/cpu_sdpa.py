"""CPU: a user's call through auto-dispatch against PyTorch's own SDPA on the same call.

    python -m benchmarks.cpu_sdpa [--length 1024] [--reps 9] [--threads N]

B1 H8/Hkv2 D64, float32, causal, a per-key top-256 mask (``create_mask``) and a per-key bias
that needs a gradient. ``sdpa`` builds the mask out to ``(B, H, L, L)`` (causal and top-k folded
into one additive float mask, as a user of SDPA would) inside the timed region. Medians of
``--reps`` wall-clock runs (the two alternating), forward and forward + backward.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import flash_dmattn as fd
from flash_dmattn.utils.mask import create_mask


def median_ms(fns, reps: int) -> list:
    """Median wall-clock ms of each function; the functions alternate within each repetition,
    so a change in the machine's load reaches all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, L, H, Hkv, D = 1, a.length, 8, 2, 64
    q = torch.randn(B, L, H, D, requires_grad=True)
    k = torch.randn(B, L, Hkv, D, requires_grad=True)
    v = torch.randn(B, L, Hkv, D, requires_grad=True)
    bias = torch.randn(B, Hkv, 1, L, requires_grad=True)
    mask = create_mask(bias.detach(), window_size=a.window)

    def ours(grad: bool):
        out = fd.flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
        if grad:
            torch.autograd.grad(out.sum(), (q, k, v, bias))

    def sdpa(grad: bool):
        j = torch.arange(L)
        keep = mask.expand(B, Hkv, L, L) & (j[None, :] <= j[:, None])
        add = bias.expand(B, Hkv, L, L).masked_fill(~keep, float("-inf"))
        add = add.repeat_interleave(H // Hkv, dim=1)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             attn_mask=add, enable_gqa=True)
        if grad:
            torch.autograd.grad(out.sum(), (q, k, v, bias))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B{B} L{L} H{H}/{Hkv} "
          f"D{D} fp32 causal top-{a.window} + per-key bias; medians of {a.reps} (ms)")
    for grad in (False, True):
        label = "fwd+bwd" if grad else "fwd"
        t_ours, t_sdpa = median_ms((lambda: ours(grad), lambda: sdpa(grad)), a.reps)
        print(f"{label:8s} flash_dmattn (auto) {t_ours:8.1f}   sdpa (mask built) {t_sdpa:8.1f}"
              f"   ratio {t_ours / t_sdpa:.2f}", flush=True)


if __name__ == "__main__":
    main()
