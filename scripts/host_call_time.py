"""Host time per public forward call of a suite's first workload, for A/B of host overhead.

    python3 scripts/host_call_time.py [--suite upstream] [--calls 2000]

Issues ``--calls`` forward calls back to back without synchronising (the GPU queue absorbs
them while the host is slower than the GPU) and prints the host time per call, five times.
Run it from two trees (``cd exp_base && python3 ../scripts/host_call_time.py``: the working
directory's package comes first) alternately to compare them.
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="upstream")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    w = workloads_for(args.suite, quick=False)[0]
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    attn = flash_dmattn_func_auto("triton")
    call = lambda: attn(case.q, case.k, case.v, attn_mask=case.mask, attn_bias=case.bias,
                        is_causal=w.causal)
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        per_call.append((time.perf_counter() - t0) * 1e3 / args.calls)
        torch.cuda.synchronize()
    import flash_dmattn
    print(f"{flash_dmattn.__file__}: host ms per call {statistics.median(per_call):.4f} "
          f"(runs {' '.join(f'{t:.4f}' for t in per_call)})")


if __name__ == "__main__":
    main()
