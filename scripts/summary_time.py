"""Time the mask summary kernel on the T2 mask at the forward and backward granularities,
with and without key bits (GPU).

    python3 scripts/summary_time.py        (from the root of the tree whose package to time)
"""
import sys

import torch

sys.path.insert(0, ".")
from triton.testing import do_bench  # noqa: E402

import flash_dmattn  # noqa: E402
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn.backends.triton.mask_summary import summarize_mask  # noqa: E402


def main():
    w = workloads_for("dynamic", quick=False)[0]
    c = build_case(w, torch.device("cuda"), torch.bfloat16)
    print("package:", flash_dmattn.__file__)
    for blocks in ((128, 64), (64, 64), (64, 128), (128, 128)):
        for bits in (False, True):
            def run(blocks=blocks, bits=bits):
                return summarize_mask(c.mask, *blocks, True, key_bits=bits)

            run()
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            print(f"summary {blocks[0]}x{blocks[1]} causal key_bits={int(bits)}: {ms:.4f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
