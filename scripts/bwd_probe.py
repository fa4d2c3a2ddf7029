"""Where the forward + backward time of T1-T3 goes, cuda next to triton (one device call).

    python3 scripts/bwd_probe.py [--only T1,T2,T3] [--backends cuda,triton] [--ncu] [--fwd]

For each workload and backend: the per-kernel GPU times of one forward + backward (profiler,
after a warm-up call) and the median time of the whole step (``do_bench``), so the kernel
that separates the backends shows by name. ``--ncu``: instead, run each workload's step
(first backend) three times, then once more inside an NVTX range named after the workload
(the backward's kernels run on autograd's thread, outside the range: ``ncu -k regex:dkdv -s 3
-c 1`` picks the last). T1 is the dense suite's L16384 D128 causal row,
T2 the dynamic suite's workload, T3 the block-sparse one.
"""
import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn import flash_dmattn_func_auto  # noqa: E402
from scripts.cuda_probe import print_kernel_times  # noqa: E402


def workloads():
    dense = [w for w in workloads_for("dense", quick=False)
             if w.seqlen_q == 16384 and w.head_dim == 128 and w.causal]
    return {"T1": dense[0], "T2": workloads_for("dynamic", quick=False)[0],
            "T3": workloads_for("block_sparse", quick=False)[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="T1,T2,T3")
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--fwd", action="store_true", help="also the inference forward's kernels")
    args = ap.parse_args()
    print(f"== backward probe on {torch.cuda.get_device_name()}")
    for tag, w in workloads().items():
        if tag not in args.only.split(","):
            continue
        case = build_case(w, torch.device("cuda"), torch.bfloat16)
        q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
        bias = case.bias.detach().requires_grad_() if case.bias is not None else None
        inputs = (q, k, v) + ((bias,) if bias is not None else ())
        for name in args.backends.split(","):
            attn = flash_dmattn_func_auto(name)

            def step(attn=attn, q=q, k=k, v=v, mask=case.mask, bias=bias, inputs=inputs,
                     gout=case.grad_out, causal=w.causal):
                out = attn(q, k, v, mask, bias, is_causal=causal)
                return torch.autograd.grad(out, inputs, gout)

            if args.ncu:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(tag)
                step()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                break
            print(f"-- {tag} {name}: {w.name}")
            if args.fwd:
                def infer(attn=attn, q=q, k=k, v=v, mask=case.mask, bias=bias, causal=w.causal):
                    with torch.no_grad():
                        return attn(q, k, v, mask, bias, is_causal=causal)

                print_kernel_times(infer, f"{tag} {name} fwd")
                ms = triton.testing.do_bench(infer, warmup=10, rep=100, return_mode="median")
                print(f"{tag} fwd {name} {ms:.3f} ms")
            print_kernel_times(step, f"{tag} {name}")
            ms = triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median")
            print(f"{tag} fwd+bwd {name} {ms:.3f} ms")
            sys.stdout.flush()
        del case, q, k, v, bias, inputs, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
