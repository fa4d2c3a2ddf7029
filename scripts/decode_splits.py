"""Sweep the split count of the Triton decode kernel on the decode rows it misses (GPU only).

    python3 scripts/decode_splits.py

For each workload: the CUDA-graph replay time of ``decode_forward`` at the default split count
(choose_num_splits) and at 1/2, 2 and 4 times it, next to cuDNN SDPA on the same K/V (sliced
to the used length for a part-filled cache). Decides whether the split heuristic or the kernel
is what loses to dense SDPA on those rows.
"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton.decode import choose_num_splits, decode_forward  # noqa: E402


def main():
    dev = torch.device("cuda")
    for B, L, fill in ((1, 131072, 0.5), (8, 32768, None), (8, 131072, None), (1, 32768, None),
                       (64, 32768, None)):
        for masked in (False, True):
            w = decode_workload(B, L, masked, fill)
            case = build_case(w, dev, torch.bfloat16)
            base = choose_num_splits(B, 8, L, dev)
            scale = 128 ** -0.5
            used = case.used_prefix()
            qs = used.q.transpose(1, 2)
            ks, vs = used.k.transpose(1, 2), used.v.transpose(1, 2)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, enable_gqa=True)

            sdpa()
            t_ref, _ = graph_time_ms(sdpa, dev)
            label = ("mask+bias" if masked else "no mask") + (" cache50%" if fill else "")
            line = f"B{B} Lk{L} {label}: cuDNN {t_ref:.3f} ms |"
            for mult in (0.5, 1, 2, 4):
                n = max(1, int(base * mult))
                fn = lambda n=n, c=case: decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale,
                                                        False, 0.0, cache_seqlens=c.cache_seqlens,
                                                        num_splits=n)
                fn()
                t, why = graph_time_ms(fn, dev)
                line += f" splits {n}: {t:.3f}" if t is not None else f" splits {n}: {why}"
            print(line, flush=True)
            del case, used


if __name__ == "__main__":
    main()
