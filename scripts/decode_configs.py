"""Time every launch config of the Triton decode kernel on the decode rows (GPU only).

    python3 scripts/decode_configs.py            # every config at the default split count
    python3 scripts/decode_configs.py --splits   # a few configs x half / default / double splits
    python3 scripts/decode_configs.py --cache    # only part-filled caches (cache_seqlens rows)

The decode kernel used to be autotuned over these configs; some lie within a few percent of
each other and which one won (and the row's time) changed from one process to the next. This
sweep pins each config in turn (CUDA-graph replay, the benchmark's timing); its tables chose
the fixed :func:`flash_dmattn.backends.triton.decode.decode_config`.
"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton import decode as dec  # noqa: E402


# (BLOCK_N, num_warps, num_stages, maxnreg): what the autotuner used to choose from, and the
# register cap of decode_config.
CONFIGS = ((64, 4, 2, 128), (64, 4, 2, None), (64, 4, 3, 128), (64, 4, 4, None),
           (128, 4, 2, None), (128, 8, 3, None), (32, 4, 4, 128), (64, 8, 3, None))


def main():
    dev = torch.device("cuda")
    fixed = dec.decode_config
    sweep_splits = "--splits" in sys.argv[1:]
    configs = CONFIGS
    if sweep_splits:
        configs = [c for c in CONFIGS if c in {(64, 4, 2, 128), (128, 4, 2, None), (64, 4, 4, None)}]
    rows = ((1, 32768, None), (1, 131072, None), (1, 131072, 0.5), (1, 524288, None),
            (8, 32768, None), (8, 131072, None), (64, 32768, None), (1, 4096, None))
    if "--cache" in sys.argv[1:]:
        rows = ((1, 4096, 0.5), (1, 32768, 0.5), (1, 131072, 0.5), (1, 524288, 0.5),
                (8, 32768, 0.5), (8, 131072, 0.5))
    for B, L, fill in rows:
        for masked in (False, True):
            if fill is not None and not masked:
                continue
            w = decode_workload(B, L, masked, fill)
            case = build_case(w, dev, torch.bfloat16)
            label = ("mask+bias" if masked else "no mask") + (" cache50%" if fill else "")
            splits = dec.choose_num_splits(B, 8, L, dev)
            line = f"B{B} Lk{L} {label} (splits {splits}):"
            for n_splits in ((max(1, splits // 2), splits, 2 * splits) if sweep_splits
                             else (splits,)):
                for cfg in configs:
                    dec.decode_config = lambda *a, cfg=cfg: cfg
                    fn = lambda c=case, n=n_splits: dec.decode_forward(
                        c.q, c.k, c.v, c.mask, c.bias, 128 ** -0.5, False, 0.0,
                        cache_seqlens=c.cache_seqlens, num_splits=n)
                    try:
                        fn()
                        t, why = graph_time_ms(fn, dev)
                    except Exception as exc:  # a config this shape cannot fit
                        t, why = None, type(exc).__name__
                    name = "n{}w{}s{}".format(*cfg) + (f"r{cfg[3]}" if cfg[3] else "")
                    if sweep_splits:
                        name = f"x{n_splits}:{name}"
                    line += f" {name} {t:.4f}" if t is not None else f" {name} {why}"
            print(line, flush=True)
            del case
    dec.decode_config = fixed


if __name__ == "__main__":
    main()
