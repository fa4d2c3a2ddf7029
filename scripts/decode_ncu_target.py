"""One decode step for Nsight Compute to profile (GPU only): the benchmark's B64 Hq32/Hkv8 Lk 32K
D128 row with a per-key mask + bias (half the keys live).

    ncu --kernel-name regex:decode_kernel|_decode_split_kernel --launch-skip 1 --launch-count 1 \\
        python3 scripts/decode_ncu_target.py cuda|triton

Runs the chosen backend's decode kernel twice (the first launch compiles / warms up).
"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, decode_workload  # noqa: E402


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    w = decode_workload(64, 32768, True)
    c = build_case(w, torch.device("cuda"), torch.bfloat16)
    if which == "cuda":
        from flash_dmattn.backends.cuda.kernels import cuda_decode_forward as run
    else:
        from flash_dmattn.backends.triton.decode import decode_forward as run
    for _ in range(2):
        run(c.q, c.k, c.v, c.mask, c.bias, 128 ** -0.5, False, 0.0, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
