"""T2 forward (no grad, as the benchmark times it) with each forward-kernel config pinned, then
autotuned, in one process (GPU only). Run it twice to see how much the autotuned row moves.

    python3 scripts/t2_fwd_configs.py
"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.timing import time_ms  # noqa: E402
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn.backends.triton import forward as fwd_mod  # noqa: E402


def main():
    dev = torch.device("cuda")
    w = workloads_for("dynamic", quick=False)[0]
    c = build_case(w, dev, torch.bfloat16)
    scale = w.head_dim ** -0.5
    tuned = fwd_mod._attn_fwd_tuned
    configs = list(tuned.configs)

    def fwd():
        with torch.no_grad():
            return fwd_mod.attention_forward(c.q, c.k, c.v, c.mask, c.bias, scale, True, 0.0)

    line = "pinned:"
    for cfg in configs:
        tuned.configs, tuned.cache = [cfg], {}
        try:
            fwd()
            line += f" w{cfg.num_warps}s{cfg.num_stages} {time_ms(fwd, dev):.3f}"
        except Exception as exc:
            line += f" w{cfg.num_warps}s{cfg.num_stages} {type(exc).__name__}"
    print(line, flush=True)
    tuned.configs, tuned.cache = configs, {}
    fwd()
    best = {k: f"w{v.num_warps}s{v.num_stages}" for k, v in tuned.cache.items()}
    print(f"autotuned: {time_ms(fwd, dev):.3f} ms, chose {list(best.values())}", flush=True)


if __name__ == "__main__":
    main()
