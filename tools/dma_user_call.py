"""The user's causal top-W call (selection + attention forward) against dense causal cuDNN, in
a process that runs nothing else first.

    python3 tools/dma_user_call.py [L ...] [--rounds N]

Per L (default 32K and 64K; bf16, B1 H16/Hkv4 D128, per-key bias, W 2048, inputs requiring
grad as in training): do_bench medians of dense causal cuDNN SDPA's forward and of
``topk_intervals`` followed by ``flash_dmattn_func_auto(backend="cuda")`` with the intervals,
``--rounds`` times. ``tools/dma_probe.py`` times the same call after its other rows (dense
and gathered fwd+bwd, the plan, fwd+bwd); at 64K its median of this call has come out about
0.4 ms above the back-to-back device time (its ``--spans``), which this clean process does not
show.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_dmattn as fd
from flash_dmattn.utils.mask import topk_intervals


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lengths", nargs="*", type=int, default=[32768, 65536])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    B, H, Hkv, D, W = 1, 16, 4, 128, 2048
    print(torch.cuda.get_device_name(), flush=True)
    for L in a.lengths:
        q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(B, Hkv, 1, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        call = fd.flash_dmattn_func_auto(backend="cuda")

        def sf():
            sel = topk_intervals(bias.detach(), W, is_causal=True)
            return call(q, k, v, attn_mask=sel, attn_bias=bias, is_causal=True)

        qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = do_bench(lambda: F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, enable_gqa=True), warmup=25, rep=200,
                return_mode="median")
        for _ in range(a.rounds):
            t = do_bench(sf, warmup=25, rep=200, return_mode="median")
            print(f"L{L} dense causal cuDNN fwd {dense:.3f} ms, select+fwd {t:.3f} ms = "
                  f"{t / dense:.3f}x", flush=True)


if __name__ == "__main__":
    main()
