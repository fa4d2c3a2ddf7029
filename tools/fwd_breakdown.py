"""Where the cuda key-interval forward spends its time beyond the "selected keys only" limit.

    python3 tools/fwd_breakdown.py [L] [--window W] [--ncu]

bf16, B1 H16/Hkv4 D128, W keys gathered from L by a per-key top-W. Each row adds one thing to
the row before it, all over the same W keys and L queries (medians of do_bench, ms):

  cudnn        cuDNN SDPA over the W gathered keys, not causal (the limit)
  dense        the cuda backend's dense forward over the gathered keys (contiguous K/V rows)
  dense+bias   the same with the per-key bias (1, Hkv, 1, W)
  walk-nobias  the key-interval forward over the gathered keys without the bias
  walk         the key-interval forward over the gathered keys, every key (but one) seen by
               every query: K/V rows copied by index, ranges and bias staged (plan prebuilt)
  shared       the key-interval forward over L keys, shared top-W selection (plan prebuilt)
  causal       the same, causal top-W per query (plan prebuilt)

--ncu runs each kernel a few times inside NVTX ranges named after the rows, for
`ncu --nvtx --nvtx-include <row>/` (tools/device_common.sh: ncu_ranges).

Internal module: ``backends.cuda.intervals`` (``plan_for`` / ``interval_forward``) is called
directly, with the plan prebuilt, to time the kernel apart from planning.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_dmattn as fd
from flash_dmattn.backends.cuda import intervals as civ
from flash_dmattn.masks import KeyIntervals
from flash_dmattn.utils.mask import topk_intervals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("length", nargs="?", type=int, default=32768)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--ncu", action="store_true")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    B, H, Hkv, D, L, W = 1, 16, 4, 128, a.length, a.window
    scale = D ** -0.5
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt)
    idx = bias[0, :, 0].topk(W, dim=-1).indices.sort(-1).values  # (Hkv, W)
    kg = torch.stack([k[0, :, h][idx[h]] for h in range(Hkv)], dim=1)[None].contiguous()
    vg = torch.stack([v[0, :, h][idx[h]] for h in range(Hkv)], dim=1)[None].contiguous()
    bg = torch.gather(bias, 3, idx[None, :, None, :]).contiguous()
    qh, kgh, vgh = (t.transpose(1, 2).contiguous() for t in (q, kg, vg))
    cuda = fd.flash_dmattn_func_auto(backend="cuda")

    # Bounds are key positions (query i sits at i + W - L): every query sees every key but the
    # first (a mask that hides nothing would be planned as the dense call it equals).
    end = torch.full((1, Hkv, W), 2 * W, dtype=torch.int32, device=dev)
    end[..., 0] = -L
    everyone = KeyIntervals(torch.full((1, Hkv, W), -L, dtype=torch.int32, device=dev), end)
    walk_plan = civ.plan_for(q, kg, bg, everyone.bounds, False, backward=False)
    walk_plan_nobias = civ.plan_for(q, kg, None, everyone.bounds, False, backward=False)
    sel = {kind: topk_intervals(bias, W, is_causal=kind == "causal") for kind in ("shared", "causal")}
    plans = {kind: civ.plan_for(q, k, bias, ki.bounds, True, backward=False, window=ki.window)
             for kind, ki in sel.items()}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kgh, vgh, enable_gqa=True)

    rows = {
        "cudnn": cudnn,
        "dense": lambda: cuda(q, kg, vg),
        "dense+bias": lambda: cuda(q, kg, vg, attn_bias=bg),
        "walk-nobias": lambda: civ.interval_forward(q, kg, vg, None, everyone.bounds, scale,
                                                    False, 0.0, walk_plan_nobias),
        "walk": lambda: civ.interval_forward(q, kg, vg, bg, everyone.bounds, scale, False, 0.0,
                                             walk_plan),
        "shared": lambda: civ.interval_forward(q, k, v, bias, sel["shared"].bounds, scale, True,
                                               0.0, plans["shared"]),
        "causal": lambda: civ.interval_forward(q, k, v, bias, sel["causal"].bounds, scale, True,
                                               0.0, plans["causal"]),
    }
    print(torch.cuda.get_device_name(), f"L{L} W{W}", flush=True)
    check(rows, q, kg, vg, bg, scale)
    if a.ncu:
        for name, fn in rows.items():
            fn()
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range(name):
                for _ in range(2):
                    fn()
            torch.cuda.synchronize()
        return
    base = None
    for name, fn in rows.items():
        t = do_bench(fn, warmup=25, rep=200, return_mode="median")
        base = base or t
        print(f"  {name:11s} {t:7.3f} ms  {t / base:5.2f}x cudnn", flush=True)


def check(rows, q, kg, vg, bg, scale):
    """The rows over the gathered keys against fp32 SDPA on the same keys (the walks hide key 0):
    the largest absolute error of each output, which a wrong kernel makes O(0.1) or NaN."""
    H, Hkv = q.shape[2], kg.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, kg, vg))
    kf, vf = (t.repeat_interleave(H // Hkv, dim=1) for t in (kf, vf))
    hide0 = torch.zeros(kg.shape[1], device=q.device)
    hide0[0] = float("-inf")
    bias_h = bg.float().repeat_interleave(H // Hkv, dim=1)  # (1, H, 1, W)
    want = {
        "dense": None,
        "dense+bias": bias_h,
        "walk-nobias": hide0.expand(1, H, 1, -1),
        "walk": bias_h + hide0,
    }
    for name, mask in want.items():
        ref = torch.cat([F.scaled_dot_product_attention(
            qf[:, :, i:i + 4096], kf, vf, attn_mask=mask, scale=scale)
            for i in range(0, qf.shape[2], 4096)], dim=2).transpose(1, 2)
        out = rows[name]()
        out = out[0] if isinstance(out, tuple) else out
        err = (out.float() - ref).abs().max().item()
        print(f"  check {name:11s} max |out - fp32 ref| {err:.2e} "
              f"{'ok' if err < 2e-2 else 'FAILED'}", flush=True)


if __name__ == "__main__":
    main()
