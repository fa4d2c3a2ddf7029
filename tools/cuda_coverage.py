"""Which random calls the cuda backend declines, and why, without a GPU.

Describes random calls (the distribution of issue 33: bf16, head dims 64 / 128, every mask
and bias broadcast shape, GQA, causal, softcap, gradients of q, k, v and the bias) on meta
tensors that report a CUDA device of compute capability 9.0, and asks the cuda backend's
capability checks (``not_supported_reasons``) about each: no kernel runs, so it runs on a CPU
machine (what it measures is the reasons, not the kernels). Prints the share declined and
each reason's count.

    python tools/cuda_coverage.py [--calls 60] [--seed 0] [--dtype bf16[,fp16]]
                                    [--head-dims 64,128[,x8]] [--fp32-bias 0.0] [--grads 1.0]
    python tools/cuda_coverage.py --preset issue33 [--calls 1000]

``--head-dims`` entries are drawn with equal weight; ``x8`` stands for a random multiple of 8
up to 256, ``x1`` for any head dim from 1 to 256. ``--preset issue33`` is issue 33 item 3's
whole distribution: bf16 and fp16, head dims 64, 128 or any multiple of 8 up to 256, half the
biases float32, half the calls with gradients (of q, k, v and the bias), the rest forward only;
the command line's options override its values.

Internal modules: the cuda backend's capability checks (``backends.cuda.backend.CudaBackend``)
and the call description of ``python -m flash_dmattn`` (``flash_dmattn.__main__.described_call``),
asked directly because without a GPU the public entry points decline before any check runs.
"""
from __future__ import annotations

import argparse
import collections
import random
import re

from flash_dmattn import policy  # noqa: E402
from flash_dmattn.__main__ import described_call  # noqa: E402
from flash_dmattn.backends.cuda.backend import CudaBackend  # noqa: E402


def aux_spec(rng: random.Random) -> str:
    """A mask / bias broadcast shape over (B, H, Lq, Lk): each dim full or 1, heads H or Hkv."""
    return ",".join((rng.choice(["B", "1"]), rng.choice(["H", "Hkv", "1"]),
                     rng.choice(["Lq", "1"]), rng.choice(["Lk", "1"])))


PRESETS = {
    "issue33": dict(dtype="bf16,fp16", head_dims="64,128,x8", fp32_bias=0.5, grads=0.5),
}


def head_dim(rng: random.Random, head_dims) -> int:
    d = rng.choice(head_dims)
    if d == "x8":
        return rng.randrange(8, 257, 8)
    return rng.randrange(1, 257) if d == "x1" else int(d)


def random_call(rng: random.Random, dtype: str, head_dims, fp32_bias: float = 0.0,
                grads: float = 1.0) -> dict:
    """One random call of the distribution; ``dtype`` and ``head_dims`` may list several
    choices (``dtype`` comma-separated), ``grads`` is the share of calls with gradients."""
    dtypes = dtype.split(",")
    hkv = rng.choice([1, 2, 4])
    heads = hkv * rng.choice([1, 2, 4])
    lq = rng.choice([1, 64, 100, 128, 257, 512, 1000, 2048])
    lk = rng.choice([lq, lq, 128, 333, 1024, 4096])
    mask = rng.choice(["none", aux_spec(rng)])
    bias = rng.choice(["none", aux_spec(rng)])
    shape = (f"B={rng.choice([1, 2])},H={heads},Hkv={hkv},Lq={lq},Lk={lk},"
             f"D={head_dim(rng, head_dims)}")
    call_dtype = dtypes[0] if len(dtypes) == 1 else rng.choice(dtypes)
    bias_dtype = "fp32" if bias != "none" and rng.random() < fp32_bias else None
    causal = rng.random() < 0.5
    softcap = rng.choice([0.0, 0.0, 30.0])
    train = grads >= 1.0 or rng.random() < grads
    return dict(shape=shape, dtype=call_dtype, mask=mask, bias=bias, bias_dtype=bias_dtype,
                causal=causal, softcap=softcap, train=train,
                bias_grad=train and bias != "none", capability=(9, 0))


def general(reason: str) -> str:
    """A reason with its call's numbers replaced, so that reasons of one kind count together."""
    reason = re.sub(r"head_dim \d+", "head_dim N", reason)
    return re.sub(r"\(\d+(, \d+)*\)", "(...)", reason)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16", help="bf16, fp16 or both: bf16,fp16")
    parser.add_argument("--head-dims", default="64,128",
                        help="choices; x8: a random multiple of 8 up to 256, x1: any of 1..256")
    parser.add_argument("--fp32-bias", type=float, default=0.0,
                        help="share of biases given in float32 (0 to 1)")
    parser.add_argument("--grads", type=float, default=1.0,
                        help="share of calls with gradients of q, k, v and the bias (0 to 1)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named distribution (defaults of --dtype, --head-dims, "
                             "--fp32-bias, --grads)")
    args = parser.parse_args(argv)
    if args.preset:  # the preset's values, where the command line gives none
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    head_dims = args.head_dims.split(",")
    backend = CudaBackend()
    declined = 0
    counts = collections.Counter()
    examples = {}
    with policy.simulated_capability((9, 0)):
        for _ in range(args.calls):
            call = random_call(rng, args.dtype, head_dims, args.fp32_bias, args.grads)
            inputs = described_call(**call)
            reasons = backend.not_supported_reasons(inputs)
            if reasons:
                declined += 1
                for reason in reasons:
                    key = general(reason)
                    counts[key] += 1
                    examples.setdefault(key, inputs.describe().replace("meta", "cuda"))
    what = (f"{args.dtype} calls, D {args.head_dims}, {100 * args.fp32_bias:.0f} % of biases "
            f"float32, {100 * min(args.grads, 1.0):.0f} % with gradients")
    print(f"cuda declines {declined} of {args.calls} random {what} "
          f"({100.0 * declined / max(args.calls, 1):.0f} %), sm_90 (reasons evaluated on CPU, "
          f"no kernel run)")
    for reason, n in counts.most_common():
        print(f"{n:4d}  {reason}\n      e.g. {examples[reason]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
