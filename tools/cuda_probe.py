"""Which cuda forward kernel runs, and how fast, on the T1 / T2 shapes (one device call).

    python3 -m tools.cuda_probe [--t2-only]   (FLASH_DMATTN_CUDA_FLAGS selects a build variant)

Prints the forward and backward modules' block sizes, the kernel names a profiled forward launches with their GPU
times, the median forward time next to cuDNN SDPA on the same inputs, and the per-kernel GPU
times of one forward + backward.

Run from the repository root as ``python3 -m tools.cuda_probe`` (``--t2-only`` reaches the
benchmark workloads in ``benchmarks/``, which are not part of the package). Internal module:
``backends.cuda.kernels.kernel_module``, for the built modules' block sizes.
"""
import os
import sys

import torch
import triton.testing

from flash_dmattn import flash_dmattn_func_auto
from flash_dmattn.backends.cuda.kernels import kernel_module


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def print_kernel_times(fn, label: str) -> None:
    """GPU time per kernel of one call of ``fn`` (after a warm-up call), one line each."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    width = 78 - len(label)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            print(f"  {label} {evt.key[:width]:{width}s} {evt.device_time_total / 1e3:.3f} ms")


def main():
    torch.manual_seed(0)
    dev = "cuda"
    flags = os.environ.get("FLASH_DMATTN_CUDA_FLAGS", "")
    print(f"== variant flags={flags!r} gpu={torch.cuda.get_device_name()}")
    B, H, L, D = 1, 16, 16384, 128
    q = torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16)
    for op in ("fwd", "bwd"):
        print(f"{op} block_sizes", kernel_module(q, False, False, op=op).block_sizes())
    attn = flash_dmattn_func_auto("cuda")
    run = lambda: attn(q, k, v, is_causal=True)
    print_kernel_times(run, "kernel")
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    ref = cudnn().transpose(1, 2).float()
    out = run().float()
    err = ((out - ref).norm() / ref.norm()).item()
    t_c, t_d = time_ms(run), time_ms(cudnn)
    flops = 4 * B * H * L * L * D / 2
    print(f"T1 fwd cuda {t_c:.3f} ms ({flops / t_c / 1e9:.0f} TFLOP/s)  cudnn {t_d:.3f} ms "
          f"({flops / t_d / 1e9:.0f} TFLOP/s)  ratio {t_d / t_c:.2f}x throughput  rel err {err:.1e}")
    nc = lambda: attn(q, k, v, is_causal=False)
    t_n = time_ms(nc)
    print(f"T1 non-causal fwd cuda {t_n:.3f} ms ({2 * flops / t_n / 1e9:.0f} TFLOP/s)")
    # Where the backward's time goes: per-kernel GPU times of one causal fwd + bwd.
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    gout = torch.randn_like(q)
    step = lambda: torch.autograd.grad(attn(qg, kg, vg, is_causal=True), (qg, kg, vg), gout)
    print_kernel_times(step, "fwd+bwd kernel")
    sys.stdout.flush()



def t2_kernels():
    """Per-kernel GPU times of one T2 forward (the dynamic suite's workload), cuda and triton:
    the attention kernel apart from the mask summary and tile lists built per call."""
    from benchmarks.workloads import build_case, core_workloads

    (w,) = core_workloads("dynamic", quick=False)
    case = build_case(w, torch.device("cuda"), torch.bfloat16)
    for name in ("cuda", "triton"):
        attn = flash_dmattn_func_auto(name)
        run = lambda: attn(case.q, case.k, case.v, case.mask, case.bias, is_causal=True)
        print_kernel_times(run, f"T2 {name}")
        print(f"T2 fwd {name} {time_ms(run):.3f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    if "--t2-only" not in sys.argv:
        main()
    t2_kernels()
