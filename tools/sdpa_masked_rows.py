"""What PyTorch's SDPA kernels return for a query row that sees no key, on this machine: the
check a policy rule needs before it routes masked calls to one SDPA call (this library's
contract gives such a row 0, never NaN, and a zero gradient).

    python3 tools/sdpa_masked_rows.py [--dtype bfloat16] [--device cuda]

For each SDPA kernel (cuDNN, flash, memory-efficient, math; those this build and device take)
and each way of masking (a bool mask, an additive ``-inf`` mask, an additive mask of the
dtype's minimum), one call with two fully masked rows among visible ones: whether the kernel
ran, the masked rows' output and query gradient (``0``, ``nan`` or other values), and the
largest errors against float64 of the visible rows' output and of dQ, dK and dV (the masked
rows must add nothing to dK / dV).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def masks(lq, lk, dtype, device):
    """Bool ``(1, 1, Lq, Lk)`` visibility with rows 1 and ``Lq - 2`` seeing nothing, and its
    additive forms."""
    keep = torch.rand(1, 1, lq, lk, device=device) > 0.3
    keep[..., :, 0] = True
    keep[..., 1, :] = False
    keep[..., lq - 2, :] = False
    neg_inf = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    minimum = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(
        ~keep, torch.finfo(dtype).min)
    return keep, {"bool": keep, "-inf": neg_inf, "dtype min": minimum}


def describe(t):
    if torch.isnan(t).any():
        return "nan"
    return "0" if bool((t == 0).all()) else f"max |x| {t.abs().max().item():.3g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype, device = getattr(torch, args.dtype), args.device
    torch.manual_seed(0)
    B, H, Lq, Lk, D = 2, 4, 37, 61, 64
    q, k, v = (torch.randn(B, H, n, D, device=device, dtype=dtype) for n in (Lq, Lk, Lk))
    keep, forms = masks(Lq, Lk, dtype, device)
    dead = ~keep.any(-1)[0, 0]
    # Float64 reference: the visible rows alone (a row that sees nothing gives 0 and no
    # gradient), so dK / dV are what the visible rows contribute.
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_vis = F.scaled_dot_product_attention(ref[0][..., ~dead, :], ref[1], ref[2],
                                             attn_mask=keep[..., ~dead, :])
    want = torch.zeros(B, H, Lq, D, dtype=torch.float64, device=device)
    want[..., ~dead, :] = out_vis.detach()
    want_grads = torch.autograd.grad(out_vis, ref, torch.ones_like(out_vis))
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "") + f", {dtype}")
    for name, kernel in KERNELS.items():
        for form, mask in forms.items():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            try:
                with sdpa_kernel([kernel]):
                    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
            except RuntimeError as exc:
                print(f"{name:10s} {form:10s} not run: {str(exc).splitlines()[0][:90]}")
                continue
            err = (out.double() - want)[..., ~dead, :].abs().max().item()
            gerr = [(g.double() - w).abs().max().item() for g, w in zip(grads, want_grads)]
            print(f"{name:10s} {form:10s} masked rows: out {describe(out[..., dead, :])}, "
                  f"dq {describe(grads[0][..., dead, :])} | error: out {err:.1e}, "
                  f"dq {gerr[0]:.1e}, dk {gerr[1]:.1e}, dv {gerr[2]:.1e}")


if __name__ == "__main__":
    main()
