"""Time the cuda decode kernel next to the triton one and cuDNN, on the decode rows (GPU only).

    python3 scripts/cuda_decode_time.py [--splits]

CUDA-graph replay (the benchmark's decode timing) of ``cuda_decode_forward``,
``triton ... decode_forward`` and dense cuDNN SDPA (K/V sliced to the used length of a
part-filled cache) in one process; ``--splits`` also times the cuda kernel at half and twice
its default split count.
"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.cuda import kernels as ck  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402


def main():
    dev = torch.device("cuda")
    sweep = "--splits" in sys.argv[1:]
    rows = ((1, 4096, None), (1, 32768, None), (1, 131072, None), (1, 524288, None),
            (1, 32768, 0.5), (1, 131072, 0.5), (1, 524288, 0.5), (8, 32768, None),
            (8, 131072, None), (64, 32768, None), (8, 32768, 0.5))
    print(torch.cuda.get_device_name(), "ms per call (graph replay)")
    for B, L, fill in rows:
        for masked in (False, True):
            if fill is not None and not masked:
                continue
            w = decode_workload(B, L, masked, fill)
            c = build_case(w, dev, torch.bfloat16)
            scale = 128 ** -0.5
            splits = ck.cuda_decode_splits(B, 8, L, 128, dev)
            fns = {
                "cuda": lambda: ck.cuda_decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale,
                                                       False, 0.0, c.cache_seqlens),
                "triton": lambda: td.decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale, False,
                                                    0.0, c.cache_seqlens),
            }
            if sweep:
                for n in (max(1, splits // 2), 2 * splits):
                    fns[f"cuda x{n}"] = lambda n=n: ck.cuda_decode_forward(
                        c.q, c.k, c.v, c.mask, c.bias, scale, False, 0.0, c.cache_seqlens,
                        num_splits=n)
            used = w.used_k
            qt, kt, vt = (x.transpose(1, 2) for x in (c.q, c.k[:, :used], c.v[:, :used]))
            fns["cudnn dense"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            label = f"B{B} Lk{L}" + (" mask+bias" if masked else "") + (f" cache{fill}" if fill else "")
            line = f"{label:34s} (cuda splits {splits}):"
            for name, fn in fns.items():
                try:
                    fn()
                    t, why = graph_time_ms(fn, dev)
                except Exception as exc:
                    t, why = None, f"{type(exc).__name__}: {exc}"[:80]
                line += f"  {name} {t:.4f}" if t is not None else f"  {name} {why}"
            print(line, flush=True)
            fns.clear()
            c = None  # free this row's tensors before the next row's are built


if __name__ == "__main__":
    main()
