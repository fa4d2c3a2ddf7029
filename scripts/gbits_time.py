"""Time the gathered-mask-bits kernel (gather._gather_mask_bits) on T2 under launch shapes.

    python3 scripts/gbits_time.py [--ncu]

``--ncu``: run the default launch once inside an NVTX range "gbits" and exit (for
``ncu --nvtx --nvtx-include gbits/``; scripts/device_common.sh ncu_ranges).

T2's mask (B1 Hkv4 L8192, top-2048 per query, causal) and its forward gather plan; each
launch shape is checked against the default one's output before it is timed.
"""
import sys

import torch
import triton.testing

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn.planning import gather  # noqa: E402
from flash_dmattn.backends.triton.forward import fwd_blocks  # noqa: E402


def main():
    w = workloads_for("dynamic", quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    L, H, D = w.seqlen_q, w.heads, w.head_dim
    bm, bn = fwd_blocks(D)
    g = gather.plan_key_gather(case.mask, case.bias, L, L, H, True, bm, bn, policy="always")
    mask_u8 = case.mask.view(torch.uint8)
    union_u8, rows_per_tile = gather._tile_union(case.mask, None, bm)
    words = -(-g.cnt.long() // 64)  # the written words of each tile

    def same(got):
        return all(torch.equal(got[0, h, m * bm:(m + 1) * bm, :words[0, h, m]],
                               g.gbits[0, h, m * bm:(m + 1) * bm, :words[0, h, m]])
                   for h in range(got.size(1)) for m in range(g.cnt.size(2)))
    if "--ncu" in sys.argv:
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("gbits")
        gather._gather_mask_bits(mask_u8, union_u8, rows_per_tile, L, bm, True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return
    print(f"== gbits kernel on {torch.cuda.get_device_name()}: largest union {int(g.cnt.max())}")
    for launch in [(32, 4, 3), (32, 4, 1), (64, 4, 3), (128, 8, 3), (128, 4, 3), (16, 4, 3),
                   (64, 8, 2)]:
        run = lambda: gather._gather_mask_bits(mask_u8, union_u8, rows_per_tile, L, bm, True,
                                               None, launch)
        ok = same(run())
        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        print(f"  rows {launch[0]:4d} warps {launch[1]} stages {launch[2]}: {ms:.3f} ms  "
              f"{'ok' if ok else 'MISMATCH'}")


if __name__ == "__main__":
    main()
