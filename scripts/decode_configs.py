"""Time every launch config of the Triton decode kernel on the decode rows (GPU only).

    python3 scripts/decode_configs.py

The decode kernel is autotuned over a few configs whose times lie within a few percent of
each other, so which one wins (and the row's time) changed from one process to the next. This
sweep pins each config in turn (CUDA-graph replay, the benchmark's timing) so a fixed choice
can be made from the whole table instead of from one noisy autotuning pass.
"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import Workload, build_case  # noqa: E402
from flash_dmattn.backends.triton import decode as dec  # noqa: E402


def main():
    dev = torch.device("cuda")
    tuned = dec._decode_split_tuned
    all_configs = list(tuned.configs)
    rows = ((1, 32768, None), (1, 131072, None), (1, 131072, 0.5), (1, 524288, None),
            (8, 32768, None), (8, 131072, None), (64, 32768, None), (1, 4096, None))
    for B, L, fill in rows:
        for masked in (False, True):
            if fill is not None and not masked:
                continue
            w = Workload("decode", B, 32, 8, 1, L, 128, False,
                         "relu-per-key" if masked else "none", masked, forward_only=True,
                         cache_fill=fill)
            case = build_case(w, dev, torch.bfloat16)
            label = ("mask+bias" if masked else "no mask") + (" cache50%" if fill else "")
            splits = dec.choose_num_splits(B, 8, L, dev, case.cache_seqlens is not None,
                                           case.mask is not None)
            line = f"B{B} Lk{L} {label} (splits {splits}):"
            for cfg in all_configs:
                tuned.configs = [cfg]
                tuned.cache = {}
                fn = lambda c=case: dec.decode_forward(c.q, c.k, c.v, c.mask, c.bias,
                                                       128 ** -0.5, False, 0.0,
                                                       cache_seqlens=c.cache_seqlens)
                try:
                    fn()
                    t, why = graph_time_ms(fn, dev)
                except Exception as exc:  # a config this shape cannot fit
                    t, why = None, type(exc).__name__
                name = f"n{cfg.kwargs['BLOCK_N']}w{cfg.num_warps}s{cfg.num_stages}"
                line += f" {name} {t:.4f}" if t is not None else f" {name} {why}"
            print(line, flush=True)
            del case
    tuned.configs = all_configs
    tuned.cache = {}


if __name__ == "__main__":
    main()
