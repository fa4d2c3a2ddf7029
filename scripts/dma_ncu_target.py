"""A causal top-W key-interval forward+backward to run under Nsight Compute.

    ncu --clock-control none -k regex:_ki_ --launch-skip 3 --launch-count 3 \
        python3 scripts/dma_ncu_target.py [L] [--shared]

The first call compiles and runs every kernel once (skipped above); the second is profiled.
"""
import sys

import torch

import flash_dmattn as fd
from flash_dmattn.utils.mask import topk_intervals

L = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 32768
shared = "--shared" in sys.argv
B, H, Hkv, D, W = 1, 16, 4, 128, 2048
dev, dt = "cuda", torch.bfloat16
q = torch.randn(B, L, H, D, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt, requires_grad=True)
mask = topk_intervals(bias.detach(), W, is_causal=not shared)
for _ in range(2):
    out = fd.triton_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    torch.autograd.grad(out.sum(), (q, k, v, bias))
torch.cuda.synchronize()
