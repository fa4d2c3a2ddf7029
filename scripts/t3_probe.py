"""Where the time of the block-sparse workload (T3) goes, one device call.

    python3 scripts/t3_probe.py

T3 is B1 H16 L32768 D128, causal, a per-key mask ``(B, 1, 1, L)`` with 10 % of its 128-key
blocks live. The Triton forward is timed as a full call (tile lists planned inside, as the
benchmark calls it), as the kernel alone on prebuilt lists, and the planning alone -- on the
GPU clock (``do_bench``) and on the host clock (a loop of calls without synchronising, so
the host time per call shows when it is longer than the GPU's). The dense causal kernel at
the same shape and cuDNN give the scale: at the dense kernel's rate 10 % of the tiles would
take ~0.1x of its time.
"""
import argparse
import sys
import time

import torch
import triton.testing

sys.path.insert(0, ".")
import flash_dmattn.backends.triton.forward as fwd_mod
from benchmarks.workloads import build_case, workloads_for
from flash_dmattn import flash_dmattn_func_auto
from flash_dmattn.backends.triton.forward import (
    _attn_fwd_tuned,
    attention_forward,
    fwd_blocks,
)
from flash_dmattn.planning.tiles import build_tile_lists
from scripts.cuda_probe import print_kernel_times


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def host_ms(fn, n=200):
    """Host time per call of ``fn`` issued back to back (the GPU queue absorbs short calls)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def forced(block_m, warps, stages):
    """Run the forward with one block height and launch config (the autotuner's cache cleared
    so the next call tunes among exactly this one)."""
    _attn_fwd_tuned.cache.clear()
    _attn_fwd_tuned.configs = [triton.Config({}, num_warps=warps, num_stages=stages)]
    fwd_mod.fwd_blocks = lambda d: (block_m, 64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    w = workloads_for("block_sparse", quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    q, k, v, mask = case.q, case.k, case.v, case.mask
    L, H, D = w.seqlen_q, w.heads, w.head_dim
    scale = D ** -0.5
    bm, bn = fwd_blocks(D)
    print(f"== T3 probe on {torch.cuda.get_device_name()}, fwd tiles {bm}x{bn}, mask "
          f"{tuple(mask.shape)} stride {mask.stride()}")

    def lists(m, with_bits=False):
        return build_tile_lists(m, L, L, H, True, bm, bn, q.device, with_bits=with_bits)

    tiles = lists(mask)
    tiles_bits = lists(mask, True)
    if args.ncu:
        # The T3 kernel alone after warm-up, in NVTX range "t3"; the same lists with the mask
        # not read (timing only) in "t3n".
        for name, m in (("t3", mask), ("t3n", None)):
            for _ in range(3):
                attention_forward(q, k, v, m, None, scale, True, 0.0, tiles=tiles_bits)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
            attention_forward(q, k, v, m, None, scale, True, 0.0, tiles=tiles_bits)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        return
    tiles_causal = lists(None)
    live = tiles.fwd_cnt[..., 0].sum().item()
    full = tiles.fwd_cnt[..., 1].sum().item()
    causal_live = tiles_causal.fwd_cnt[..., 0].sum().item()
    print(f"listed tiles per head: {live} live ({live - full} partial) of {causal_live} causal "
          f"({live / causal_live:.3f})")
    fwd = lambda m, t: attention_forward(q, k, v, m, None, scale, True, 0.0, tiles=t)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    attn = flash_dmattn_func_auto("triton")
    public = lambda: attn(q, k, v, attn_mask=mask, is_causal=True)
    rows = [
        ("cuDNN dense causal", cudnn),
        ("triton kernel: dense causal (prebuilt lists)", lambda: fwd(None, tiles_causal)),
        ("triton kernel: T3 mask, prebuilt lists", lambda: fwd(mask, tiles)),
        ("triton kernel: T3 lists, mask not read (timing only)", lambda: fwd(None, tiles)),
        ("triton planning: lists + bits", lambda: lists(mask, True)),
        ("triton planning: build_tile_lists", lambda: lists(mask)),
        ("triton attention_forward, lists built inside", lambda: fwd(mask, None)),
        ("public flash_dmattn_func (triton)", public),
    ]
    base = None
    for name, fn in rows:
        t = time_ms(fn)
        base = base or t
        print(f"  {name:52s} {t:7.3f} ms  {t / base:6.3f}x cuDNN")
    import os
    for mode in ("off", "on"):
        os.environ[fwd_mod.MASK_BITS_ENV] = mode
        t_k = time_ms(lambda: fwd(mask, tiles_bits))
        t_p = time_ms(public)
        print(f"  mask bits {mode:5s}: T3 kernel {t_k:.3f} ms ({t_k / base:.3f}x cuDNN), public call "
              f"{t_p:.3f} ms ({t_p / base:.3f}x cuDNN)")
    os.environ.pop(fwd_mod.MASK_BITS_ENV)
    # Uncut rows without the mask (plain_rows): the kernel alone on prebuilt lists (with
    # "always" that is the net + the uncut rows' kernel), and the public call.
    from flash_dmattn.planning.plain_rows import PLAIN_ROWS_ENV
    for mode in ("never", "always", "auto"):
        os.environ[PLAIN_ROWS_ENV] = mode
        t_k = time_ms(lambda: fwd(mask, tiles_bits))
        t_p = time_ms(public)
        print(f"  plain rows {mode:6s}: T3 kernel(s) {t_k:.3f} ms ({t_k / base:.3f}x cuDNN), public "
              f"call {t_p:.3f} ms ({t_p / base:.3f}x cuDNN)")
    os.environ.pop(PLAIN_ROWS_ENV)
    print(f"  cut rows of the T3 lists: {int((tiles_bits.fwd_cut[..., 0] > 0).sum())} of "
          f"{tiles_bits.fwd_cut[..., 0].numel()}")
    for name, fn in [("planning", lambda: lists(mask)),
                     ("public call", public)]:
        print(f"  host time per call, {name:32s} {host_ms(fn):7.3f} ms")
    from flash_dmattn.backends.triton.forward import _attn_fwd_tuned
    for key, cfg in getattr(_attn_fwd_tuned, "cache", {}).items():
        print(f"  tuned forward config {cfg} for {key}")
    print_kernel_times(public, "public fwd")
    sys.stdout.flush()

    # Launch shapes, forced one at a time (kernel alone on lists built for the block height).
    saved = list(_attn_fwd_tuned.configs)
    for block_m, warps, stages in ((128, 8, 3), (64, 4, 3)):
        forced(block_m, warps, stages)
        t_l = build_tile_lists(mask, L, L, H, True, block_m, 64, q.device, with_bits=True)
        t3 = time_ms(lambda t_l=t_l: fwd(mask, t_l))
        print(f"  BLOCK_M {block_m:3d} warps {warps} stages {stages}: T3 kernel (bits) {t3:.3f} ms "
              f"({t3 / base:.3f}x cuDNN)")
        sys.stdout.flush()
    _attn_fwd_tuned.configs = saved


if __name__ == "__main__":
    main()
