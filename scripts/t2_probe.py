"""Where the time of the dynamic-mask workload (T2) goes, one device call.

    python3 scripts/t2_probe.py [--backends triton,cuda] [--ncu]

T2 is B1 H16 Hkv4 L8192 D128, causal, per-key bias (B,Hkv,1,L) and a per-query top-2048 mask
(B,Hkv,L,L). The Triton forward kernel is timed on the same inputs with parts left out (no
mask, no bias, an all-True mask, prebuilt tile lists), so the differences place the cost:
mask classification, per-element mask loads, bias loads, the kernel's dense work. For each
backend the per-kernel GPU times of one full forward and one forward + backward follow.

``--ncu``: run only the T2 forward kernel once inside an NVTX range "t2" (tile lists) and
once in "t2g" (gathered keys), each after warm-up calls, and exit (for
``ncu --nvtx --nvtx-include t2/``).
"""
import argparse
import sys

import torch
import triton.testing

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402
from flash_dmattn.backends.triton.forward import attention_forward, fwd_blocks  # noqa: E402
from flash_dmattn.planning.gather import plan_key_gather  # noqa: E402
from flash_dmattn.planning.mask_summary import summarize_mask  # noqa: E402
from flash_dmattn.planning.tiles import build_tile_lists  # noqa: E402
from scripts.cuda_probe import print_kernel_times  # noqa: E402


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton,cuda")
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    w = workloads_for("dynamic", quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    q, k, v, mask, bias = case.q, case.k, case.v, case.mask, case.bias
    L, H, D = w.seqlen_q, w.heads, w.head_dim
    scale = D ** -0.5
    bm, bn = fwd_blocks(D)

    def lists(m):
        summ = summarize_mask(m, bm, bn, causal=True) if m is not None else None
        return build_tile_lists(m, L, L, H, True, bm, bn, q.device, summary=summ)

    tiles_mask = lists(mask)
    fwd = lambda m, b, t: attention_forward(q, k, v, m, b, scale, True, 0.0, tiles=t)
    if args.ncu:
        summ = summarize_mask(mask, bm, bn, causal=True)
        plans = {"t2": tiles_mask, "t2g": plan_key_gather(mask, bias, L, L, H, True, bm, bn,
                                                          policy="always", summary=summ)}
        for name, plan in plans.items():
            for _ in range(3):
                fwd(mask, bias, plan)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
            fwd(mask, bias, plan)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        return

    print(f"== T2 probe on {torch.cuda.get_device_name()}, fwd tiles {bm}x{bn}")
    live = tiles_mask.fwd_cnt[..., 0].sum().item()
    partial = live - tiles_mask.fwd_cnt[..., 1].sum().item()
    n_q, n_k = tiles_mask.num_q_tiles, tiles_mask.num_k_tiles
    print(f"listed tiles per kv head: {live / w.kv_heads:.0f} live ({partial / w.kv_heads:.0f} "
          f"partial) of {n_q * n_k} ({n_q * (n_q + 1) // 2 * bm // bn} causal)")
    all_true = torch.ones_like(mask)
    tiles_true = lists(all_true)
    tiles_causal = lists(None)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True)

    def plan(m=mask):
        summ = summarize_mask(m, bm, bn, causal=True)
        return plan_key_gather(m, bias, L, L, H, True, bm, bn, policy="always", summary=summ)

    gathered = plan()
    print(f"gathered keys per query tile: mean {gathered.cnt.float().mean().item():.0f}, "
          f"max {gathered.cnt.max().item()}")
    rows = [
        ("cuDNN dense causal", cudnn),
        ("triton kernel: causal, no mask, no bias", lambda: fwd(None, None, tiles_causal)),
        ("triton kernel: causal + bias", lambda: fwd(None, bias, tiles_causal)),
        ("triton kernel: all-True mask (full tiles) + bias",
         lambda: fwd(all_true, bias, tiles_true)),
        ("triton kernel: top-2048 mask, no bias", lambda: fwd(mask, None, tiles_mask)),
        ("triton kernel: top-2048 mask + bias (T2)", lambda: fwd(mask, bias, tiles_mask)),
        ("triton gathered kernel: top-2048 mask + bias", lambda: fwd(mask, bias, gathered)),
        ("triton gathered kernel: top-2048 mask, no bias", lambda: fwd(mask, None, gathered)),
        ("triton gather plan (summary + lists + gathered mask)", plan),
        ("triton summary kernel only (causal)", lambda: summarize_mask(mask, bm, bn, causal=True)),
        ("triton summary + lists", lambda: lists(mask)),
        ("triton full call (plan built inside, auto)", lambda: fwd(mask, bias, None)),
    ]
    base = None
    for name, fn in rows:
        t = time_ms(fn)
        base = base or t
        print(f"  {name:52s} {t:7.3f} ms  {t / base:5.2f}x cuDNN")
    from flash_dmattn.backends.triton.forward import _attn_fwd_tuned
    for key, cfg in getattr(_attn_fwd_tuned, "cache", {}).items():
        print(f"  tuned forward config {cfg} for {key}")
    sys.stdout.flush()

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    bg = bias.detach().requires_grad_()
    for backend in args.backends.split(","):
        try:
            attn = flash_dmattn_func_auto(backend)
            call = lambda: attn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
            t = time_ms(call)
            print(f"== {backend}: T2 fwd {t:.3f} ms")
            print_kernel_times(call, f"{backend} fwd")
            step = lambda: torch.autograd.grad(
                attn(qg, kg, vg, attn_mask=mask, attn_bias=bg, is_causal=True),
                (qg, kg, vg, bg), case.grad_out)
            t = time_ms(step)
            print(f"== {backend}: T2 fwd+bwd {t:.3f} ms")
            print_kernel_times(step, f"{backend} f+b")
        except Exception as exc:  # a probe: report and go on with the next backend
            print(f"== {backend}: failed: {type(exc).__name__}: {str(exc)[:300]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
