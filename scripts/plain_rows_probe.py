"""T3's forward with and without the uncut-rows split (plain_rows), interleaved, one device call.

    python3 scripts/plain_rows_probe.py [--rounds 7]

Differences of a few percent are below the spread of single ``do_bench`` rows taken minutes
apart, so every variant is timed once per round, rounds interleave the variants, and the
median over rounds is reported beside the min and max. Variants: the one-kernel forward
(``never``) and the split (``always``: net + uncut rows without the mask), each on the
prebuilt lists of 128- and 64-row query tiles (``--block-m``; 64 with 4 warps, 3 stages), the
public call under ``never`` / ``auto``; cuDNN dense causal in every round gives the ratio.
Each variant is replayed from a CUDA graph of a few calls, so host time does not hide the
small launches; the per-round ratio to the one-kernel 128-row forward is robust to drift.
"""
import argparse
import os
import random
import statistics
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".")
import flash_dmattn.backends.triton.forward as fwd_mod  # noqa: E402
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402
from flash_dmattn.planning.plain_rows import PLAIN_ROWS_ENV  # noqa: E402
from flash_dmattn.planning.tiles import build_tile_lists  # noqa: E402


REPLAY_CALLS = 4  # calls per graph replay


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block-m", type=int, nargs="+", default=[128, 64])
    args = ap.parse_args()
    w = workloads_for("block_sparse", quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    q, k, v, mask = case.q, case.k, case.v, case.mask
    L, H, D = w.seqlen_q, w.heads, w.head_dim
    scale = D ** -0.5
    print(f"== plain rows probe on {torch.cuda.get_device_name()}: T3 B1 H{H} L{L} D{D}, "
          f"mask {tuple(mask.shape)}, {args.rounds} interleaved rounds")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    tuned = fwd_mod._attn_fwd_tuned
    saved_configs, saved_blocks = list(tuned.configs), fwd_mod.fwd_blocks
    lists = {bm: build_tile_lists(mask, L, L, H, True, bm, 64, q.device, with_bits=True)
             for bm in args.block_m}
    print(f"  cut rows: {[int((t.fwd_cut[..., 0] > 0).sum()) for t in lists.values()]}")

    def kernel(bm, mode, mask=mask, skip=None):
        # Fixed launch configs, not the autotuner (its cache does not key on BLOCK_M): the
        # tuned one for 128-row tiles, 4 warps for 64.
        warps = 8 if bm == 128 else 4

        def run():
            os.environ[PLAIN_ROWS_ENV] = mode
            os.environ[fwd_mod.AUTOTUNE_ENV] = "0"
            tuned.configs = [triton.Config({}, num_warps=warps, num_stages=3)]
            fwd_mod.fwd_blocks = lambda d: (bm, 64)
            real = getattr(fwd_mod, skip) if skip else None
            if skip:
                setattr(fwd_mod, skip, lambda *a: None)
            try:
                fwd_mod.attention_forward(q, k, v, mask, None, scale, True, 0.0, tiles=lists[bm])
            finally:
                tuned.configs, fwd_mod.fwd_blocks = saved_configs, saved_blocks
                os.environ.pop(fwd_mod.AUTOTUNE_ENV)
                if skip:
                    setattr(fwd_mod, skip, real)
        return run

    attn = flash_dmattn_func_auto("triton")

    def public(mode):
        def run():
            os.environ[PLAIN_ROWS_ENV] = mode
            attn(q, k, v, attn_mask=mask, is_causal=True)
        return run

    variants = [("cuDNN dense causal", cudnn)]
    for bm in args.block_m:
        for mode in ("never", "always"):
            variants.append((f"kernel BLOCK_M {bm:3d}, plain rows {mode}", kernel(bm, mode)))
    # The split's parts (timing only): the uncut rows' kernel alone (no net), the net alone,
    # and the same lists with no mask at all (one kernel, no guard).
    variants += [("  first kernel alone (128)", kernel(128, "always", skip="_launch_fwd_untuned")),
                 ("  net alone (128)", kernel(128, "always", skip="_launch_fwd")),
                 ("  lists, mask not read (128)", kernel(128, "never", mask=None))]
    for mode in ("never", "auto"):
        variants.append((f"public call, plain rows {mode}", public(mode)))
    graphs = []
    for name, fn in variants:  # compile, tune, let the lagged verdicts settle; then a graph
        fn()
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(REPLAY_CALLS):
                fn()
        graphs.append((name, g))
    times = {name: [] for name, _ in variants}
    ref = "kernel BLOCK_M 128, plain rows never"
    order = random.Random(0)
    for _ in range(args.rounds):
        # A new order each round: a variant timed right after a light one (the net alone)
        # meets a cooler GPU and higher clocks, a bias of a few percent in a fixed order.
        order.shuffle(graphs)
        for name, g in graphs:
            times[name].append(time_ms(g.replay) / REPLAY_CALLS)
    base = statistics.median(times["cuDNN dense causal"])
    for name, _ in variants:
        t = times[name]
        med = statistics.median(t)
        ratio = statistics.median(a / b for a, b in zip(t, times[ref]))
        print(f"  {name:40s} median {med:.4f} ms (min {min(t):.4f}, max {max(t):.4f})  "
              f"{med / base:.4f}x cuDNN  per-round ratio to the first kernel row {ratio:.4f}")
    os.environ.pop(PLAIN_ROWS_ENV, None)


if __name__ == "__main__":
    main()
