"""Which random calls the cuda backend declines, and why, without a GPU.

Describes random calls (the distribution of issue 33: bf16, head dims 64 / 128, every mask
and bias broadcast shape, GQA, causal, softcap, gradients of q, k, v and the bias) on meta
tensors that report a CUDA device of compute capability 9.0, and asks the cuda backend's
capability checks (``not_supported_reasons``) about each: no kernel runs. Prints the share
declined and each reason's count.

    python scripts/cuda_coverage.py [--calls 60] [--seed 0] [--dtype bf16] [--head-dims 64,128]
                                    [--fp32-bias 0.0]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flash_dmattn import policy  # noqa: E402
from flash_dmattn.__main__ import described_call  # noqa: E402
from flash_dmattn.backends.cuda.backend import CudaBackend  # noqa: E402


def aux_spec(rng: random.Random) -> str:
    """A mask / bias broadcast shape over (B, H, Lq, Lk): each dim full or 1, heads H or Hkv."""
    return ",".join((rng.choice(["B", "1"]), rng.choice(["H", "Hkv", "1"]),
                     rng.choice(["Lq", "1"]), rng.choice(["Lk", "1"])))


def random_call(rng: random.Random, dtype: str, head_dims, fp32_bias: float = 0.0) -> dict:
    hkv = rng.choice([1, 2, 4])
    heads = hkv * rng.choice([1, 2, 4])
    lq = rng.choice([1, 64, 100, 128, 257, 512, 1000, 2048])
    lk = rng.choice([lq, lq, 128, 333, 1024, 4096])
    mask = rng.choice(["none", aux_spec(rng)])
    bias = rng.choice(["none", aux_spec(rng)])
    return dict(shape=f"B={rng.choice([1, 2])},H={heads},Hkv={hkv},Lq={lq},Lk={lk},"
                      f"D={rng.choice(head_dims)}",
                dtype=dtype, mask=mask, bias=bias,
                bias_dtype="fp32" if bias != "none" and rng.random() < fp32_bias else None,
                causal=rng.random() < 0.5,
                softcap=rng.choice([0.0, 0.0, 30.0]), train=True, bias_grad=bias != "none",
                capability=(9, 0))


def general(reason: str) -> str:
    """A reason with its call's numbers replaced, so that reasons of one kind count together."""
    return re.sub(r"\(\d+(, \d+)*\)", "(...)", reason)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--fp32-bias", type=float, default=0.0,
                        help="share of biases given in float32 (0 to 1)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    head_dims = [int(d) for d in args.head_dims.split(",")]
    backend = CudaBackend()
    declined = 0
    counts = collections.Counter()
    examples = {}
    with policy.simulated_capability((9, 0)):
        for _ in range(args.calls):
            call = random_call(rng, args.dtype, head_dims, args.fp32_bias)
            inputs = described_call(**call)
            reasons = backend.not_supported_reasons(inputs)
            if reasons:
                declined += 1
                for reason in reasons:
                    key = general(reason)
                    counts[key] += 1
                    examples.setdefault(key, inputs.describe().replace("meta", "cuda"))
    print(f"cuda declines {declined} of {args.calls} random {args.dtype} calls "
          f"({100.0 * declined / max(args.calls, 1):.0f} %), sm_90, with gradients")
    for reason, n in counts.most_common():
        print(f"{n:4d}  {reason}\n      e.g. {examples[reason]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
