"""Sweep the key-interval kernels' block configs on a GPU (kernel time only, plan prebuilt).

    python3 tools/dma_tune.py [L] [--window W] [--kinds shared,causal] [--which fwd,dq,dkv]
                                [--segments ...] [--buckets ...] [--backend triton|cuda]

For each selection kind, each config of the forward (and of the dQ / dK-dV kernels) is timed
with do_bench (median) on bf16, B1 H16/Hkv4 D128, per-key bias; the planner's lists are built
once per config outside the timed region.

Internal modules: the key-interval kernels (``backends.triton.intervals``,
``backends.cuda.intervals``) and ``planning.key_lists`` are called directly, with their block
configs overridden and the plan prebuilt, to time the kernels alone.
"""
import argparse

import torch
from triton.testing import do_bench

from flash_dmattn.backends.triton import intervals as iv
from flash_dmattn.utils.mask import topk_intervals

FWD = [(128, 32, 4, 3), (128, 32, 4, 4), (128, 32, 8, 3), (128, 16, 4, 3), (64, 32, 4, 3),
       (128, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)]
DKV = [(64, 32, 4, 2), (64, 32, 4, 3), (32, 32, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3),
       (16, 64, 4, 3), (64, 64, 4, 2), (128, 32, 8, 2), (32, 128, 8, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("length", nargs="?", type=int, default=32768)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--kinds", default="shared,causal")
    ap.add_argument("--which", default="fwd,dq,dkv")
    ap.add_argument("--segments", default="", help="dK/dV: comma list of SEGMENT_ROWS to try")
    ap.add_argument("--buckets", default="", help="dK/dV: comma list of end buckets to try")
    ap.add_argument("--backend", default="triton",
                    help="cuda: sweep only the cuda backward's segments and buckets")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    B, H, Hkv, D, L, W = 1, 16, 4, 128, a.length, a.window
    print(torch.cuda.get_device_name(), f"L{L} W{W}", flush=True)
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt)
    do = torch.randn_like(q)
    if a.backend == "cuda":
        return sweep_cuda(a, q, k, v, bias, do, W, L)
    base_fwd, base_bwd = iv._fwd_config, iv._bwd_config
    for kind in a.kinds.split(","):
        ki = topk_intervals(bias, W, is_causal=kind == "causal")
        for which in a.which.split(","):
            if which not in ("fwd", "dq", "dkv"):
                continue
            for cfg in (FWD if which in ("fwd", "dq") else DKV):
                if which in ("fwd", "dq"):
                    iv._fwd_config = lambda d, interp, c=cfg: c
                    iv._bwd_config = base_bwd
                else:
                    iv._fwd_config = base_fwd
                    iv._bwd_config = lambda d, interp, c=cfg: c
                try:
                    plan = iv.plan_for(q, k, ki.bounds, True, backward=True)
                    out, lse, _ = iv.interval_forward(q, k, v, bias, ki.bounds, 0.088, True, 0.0,
                                                      plan=plan)
                    if which == "fwd":
                        fn = lambda: iv.interval_forward(q, k, v, bias, ki.bounds, 0.088, True,
                                                         0.0, plan=plan)
                    else:
                        needs = (True, False, False, False) if which == "dq" else (False, True, True, True)
                        fn = lambda: iv.interval_backward(do, q, k, v, bias, ki.bounds, out, lse,
                                                          0.088, True, 0.0, False, needs,
                                                          plan=plan)
                    t = do_bench(fn, warmup=10, rep=100, return_mode="median")
                    print(f"{kind:6s} {which:3s} {cfg}: {t:.3f} ms", flush=True)
                except Exception as exc:  # a config that does not compile or fit
                    print(f"{kind:6s} {which:3s} {cfg}: failed {type(exc).__name__}: "
                          f"{str(exc)[:120]}", flush=True)
    iv._fwd_config, iv._bwd_config = base_fwd, base_bwd
    from flash_dmattn.planning import key_lists
    for kind in a.kinds.split(","):
        ki = topk_intervals(bias, W, is_causal=kind == "causal")
        base_bucket = key_lists.end_bucket_for
        for bucket in [int(x) for x in a.buckets.split(",") if x] or [base_bucket(L)]:
            key_lists.end_bucket_for = lambda n, b=bucket: b
            for seg in [int(x) for x in a.segments.split(",") if x]:
                iv.SEGMENT_ROWS = seg
                plan = iv.plan_for(q, k, ki.bounds, True, backward=True)
                out, lse, _ = iv.interval_forward(q, k, v, bias, ki.bounds, 0.088, True, 0.0,
                                                  plan=plan)
                fn = lambda: iv.interval_backward(do, q, k, v, bias, ki.bounds, out, lse, 0.088,
                                                  True, 0.0, False, (False, True, True, True),
                                                  plan=plan)
                t = do_bench(fn, warmup=10, rep=100, return_mode="median")
                print(f"{kind:6s} dkv bucket {bucket} segment {seg}: {t:.3f} ms", flush=True)


def sweep_cuda(a, q, k, v, bias, do, W, L):
    """The cuda key-interval backward (dK/dV with fused dQ), the plan prebuilt: segment items
    (the window promise's plan) per segment length, beside key blocks (the plan without the
    promise) per end bucket and segment length."""
    from flash_dmattn.backends.cuda import intervals as civ
    from flash_dmattn.planning import key_lists

    base_bucket = key_lists.end_bucket_for
    base_seg, base_item = civ.SEGMENT_ROWS, civ.ITEM_SEGMENT_ROWS
    segments = [int(x) for x in a.segments.split(",") if x] or [base_item]

    def time_bwd(plan, ki, label):
        out, lse, _ = civ.interval_forward(q, k, v, bias, ki.bounds, 0.088, True, 0.0, plan)
        fn = lambda: civ.interval_backward(do, q, k, v, bias, ki.bounds, out, lse, 0.088,
                                           True, 0.0, (True, True, True, True), plan=plan)
        t = do_bench(fn, warmup=10, rep=100, return_mode="median")
        print(f"cuda {label}: {t:.3f} ms", flush=True)

    for kind in a.kinds.split(","):
        ki = topk_intervals(bias, W, is_causal=kind == "causal")
        for seg in segments:
            civ.SEGMENT_ROWS = civ.ITEM_SEGMENT_ROWS = seg
            plan = civ.plan_for(q, k, bias, ki.bounds, True, backward=True, window=ki.window)
            time_bwd(plan, ki, f"{kind:6s} bwd segment items {seg}")
            for bucket in [int(x) for x in a.buckets.split(",") if x] or [base_bucket(L)]:
                key_lists.end_bucket_for = lambda n, b=bucket: b
                plan = civ.plan_for(q, k, bias, ki.bounds, True, backward=True)
                time_bwd(plan, ki, f"{kind:6s} bwd key blocks bucket {bucket} segment {seg}")
            key_lists.end_bucket_for = base_bucket
        civ.SEGMENT_ROWS, civ.ITEM_SEGMENT_ROWS = base_seg, base_item
        fwd = lambda: civ.interval_forward(q, k, v, bias, ki.bounds, 0.088, True, 0.0, plan)
        print(f"cuda {kind:6s} fwd kernel (plan prebuilt): "
              f"{do_bench(fwd, warmup=10, rep=100, return_mode='median'):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
