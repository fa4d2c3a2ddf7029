"""Why a part-filled KV cache decodes slower than the same keys without one (GPU only).

    python3 scripts/decode_cache_study.py

For caches half full: the Triton decode with ``cache_seqlens`` against the same call on K/V
(and mask / bias) sliced to the used length, at the default split count and at the split
count the cache call uses; dense cuDNN SDPA on the sliced K/V. CUDA-graph replay, ms.
"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "ms per call (graph replay)")
    for B, L in ((1, 131072), (1, 524288), (8, 131072)):
        for masked in (False, True):
            w = decode_workload(B, L, masked, 0.5)
            c = build_case(w, dev, torch.bfloat16)
            used = w.used_k
            scale = 128 ** -0.5
            ks, vs = c.k[:, :used], c.v[:, :used]
            ms = c.mask[..., :used] if c.mask is not None else None
            bs = c.bias[..., :used] if c.bias is not None else None
            cache_splits = td.choose_num_splits(B, 8, L, dev)
            fns = {
                "cache": lambda: td.decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale, False,
                                                   0.0, c.cache_seqlens),
                "sliced": lambda: td.decode_forward(c.q, ks, vs, ms, bs, scale, False, 0.0),
                f"sliced x{cache_splits}": lambda: td.decode_forward(
                    c.q, ks, vs, ms, bs, scale, False, 0.0, num_splits=cache_splits),
                "sliced+cache arg": lambda: td.decode_forward(
                    c.q, ks, vs, ms, bs, scale, False, 0.0,
                    torch.full_like(c.cache_seqlens, used)),
            }
            fixed = td.decode_config
            full = torch.full_like(c.cache_seqlens, used)
            for cfg in ((64, 4, 2, 128), (128, 4, 2, None)):
                def forced(fn, cfg=cfg):
                    def run():
                        td.decode_config = lambda *a: cfg
                        try:
                            return fn()
                        finally:
                            td.decode_config = fixed
                    return run
                tag = f"n{cfg[0]}"
                fns[f"cache {tag}"] = forced(lambda: td.decode_forward(
                    c.q, c.k, c.v, c.mask, c.bias, scale, False, 0.0, c.cache_seqlens))
                fns[f"sliced+cache arg {tag}"] = forced(lambda: td.decode_forward(
                    c.q, ks, vs, ms, bs, scale, False, 0.0, full))
                fns[f"sliced {tag}"] = forced(lambda: td.decode_forward(
                    c.q, ks, vs, ms, bs, scale, False, 0.0))
            qt, kt, vt = (x.transpose(1, 2) for x in (c.q, ks, vs))
            fns["cudnn sliced"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            line = f"B{B} cap {L} used {used}" + (" mask+bias" if masked else "")
            line = f"{line:38s}"
            for name, fn in fns.items():
                fn()
                t, _ = graph_time_ms(fn, dev)
                line += f"  {name} {t:.4f}" if t is not None else f"  {name} n/a"
            print(line, flush=True)


if __name__ == "__main__":
    main()
