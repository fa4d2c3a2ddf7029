"""Time the mask summary kernel on the T2 mask at the forward and backward granularities,
with and without key bits (GPU).

    python3 scripts/summary_time.py        (from the root of the tree whose package to time)
"""
import itertools
import sys

import torch

sys.path.insert(0, ".")
from triton.testing import do_bench  # noqa: E402

import flash_dmattn  # noqa: E402
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn.backends.triton import mask_summary  # noqa: E402
from flash_dmattn.backends.triton.mask_summary import key_bits_reference, summarize_mask  # noqa: E402


def main():
    w = workloads_for("dynamic", quick=False)[0]
    c = build_case(w, torch.device("cuda"), torch.bfloat16)
    print("package:", flash_dmattn.__file__)
    # Both kernels, and the plain-PyTorch key bits, agree on the T2 mask (compiled code).
    want_bits = key_bits_reference(c.mask, True)
    for blocks in ((128, 64), (64, 64), (64, 128), (128, 128)):
        got = []
        for rows_kernel in (True, False):
            mask_summary._ROWS_KERNEL[0] = rows_kernel
            got.append(summarize_mask(c.mask, *blocks, True, key_bits=True))
        same = all(torch.equal(getattr(got[0], f), getattr(got[1], f))
                   for f in ("row_any", "tile_all", "key_bits"))
        print(f"check {blocks}: kernels agree {same}, key bits = reference "
              f"{torch.equal(got[0].key_bits, want_bits)}", flush=True)
    for rows_kernel, blocks in itertools.product((True, False), ((128, 64), (64, 64), (64, 128), (128, 128))):
        mask_summary._ROWS_KERNEL[0] = rows_kernel
        for bits in (False, True):
            def run(blocks=blocks, bits=bits):
                return summarize_mask(c.mask, *blocks, True, key_bits=bits)

            run()
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            kernel = "rows" if rows_kernel else "tiles"
            print(f"summary {kernel} {blocks[0]}x{blocks[1]} causal key_bits={int(bits)}: {ms:.4f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
