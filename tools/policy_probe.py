"""Every backend and auto-dispatch on each class of call the dispatch policy tells apart (GPU).

    python -m tools.policy_probe [--quick] [--only NAME,...] [--dtype bf16|fp16]

For each call class (dense, per-key / per-query masks, per-key / per-query / shared biases,
forward only and forward + backward) it times every available backend and the call through
``flash_dmattn_func`` (auto), names the backend auto took and the policy rule that chose it, and
marks where auto is not within 5 % of the fastest explicit backend. A declined backend shows
its reason. The table is what ``benchmarks/results/POLICY.md`` and the rules of
``flash_dmattn/policy.py`` are checked against, on each GPU generation.

Run from the repository root as ``python -m tools.policy_probe`` (it times with
``benchmarks.timing``, which is not part of the package). It asks ``flash_dmattn.registry`` and
``flash_dmattn.inputs.AttentionInputs`` which backend auto takes and why.
"""
from __future__ import annotations

import argparse
import sys

import torch  # noqa: E402

from benchmarks.timing import time_ms  # noqa: E402
from flash_dmattn import flash_dmattn_func, get_available_backends, policy, registry  # noqa: E402
from flash_dmattn.inputs import AttentionInputs  # noqa: E402

BACKENDS = ("cuda", "triton", "flex")


def _mask(kind, B, Hkv, L, g):
    if kind == "none":
        return None
    if kind == "per-key":  # 10 % of 128-key blocks live, shared by every query
        live = torch.rand(B, Hkv, 1, -(-L // 128), device="cuda", generator=g) < 0.1
        live[..., 0] = True
        return live.repeat_interleave(128, dim=-1)[..., :L]
    # per-query: each query's top L/4 keys of a random score
    scores = torch.rand(B, Hkv, L, L, device="cuda", generator=g)
    idx = scores.topk(max(1, L // 4), dim=-1).indices
    return torch.zeros(B, Hkv, L, L, device="cuda", dtype=torch.bool).scatter_(-1, idx, True)


def _bias(kind, B, H, Hkv, L, dtype, g):
    shapes = {"none": None, "per-key": (B, Hkv, 1, L), "full": (B, H, L, L),
              "shared": (1, 1, L, L)}
    shape = shapes[kind]
    return None if shape is None else torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


# (name, B, H, Hkv, L, D, mask, bias, causal)
CLASSES = [
    ("dense causal", 1, 16, 16, 4096, 128, "none", "none", True),
    ("dense causal D64", 1, 16, 16, 16384, 64, "none", "none", True),
    ("per-key mask", 1, 16, 4, 16384, 128, "per-key", "none", True),
    ("per-key mask + per-key bias", 1, 16, 4, 16384, 128, "per-key", "per-key", True),
    ("per-key bias", 1, 16, 4, 8192, 128, "none", "per-key", True),
    ("per-query mask + per-key bias", 1, 16, 4, 4096, 128, "per-query", "per-key", True),
    ("full (B,H,L,L) bias", 1, 16, 4, 2048, 128, "none", "full", True),
    ("shared (1,1,L,L) bias", 2, 16, 4, 2048, 64, "none", "shared", True),
    ("per-query mask + full bias", 1, 8, 2, 2048, 64, "per-query", "full", False),
]


def run_class(cls, dtype, train: bool):
    name, B, H, Hkv, L, D, mask_kind, bias_kind, causal = cls
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, L, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g)
    mask = _mask(mask_kind, B, Hkv, L, g)
    bias = _bias(bias_kind, B, H, Hkv, L, dtype, g)
    leaves = [t.requires_grad_(train) for t in (q, k, v)]
    if bias is not None:
        bias.requires_grad_(train)
    grads = leaves + ([bias] if bias is not None else [])
    inputs = AttentionInputs.from_args(*leaves, mask, bias, None, causal)
    ranking = policy.rank(inputs)
    taken = registry.auto_backend_name(inputs)
    row = {"auto": None}
    notes = {}

    def step(fn):
        def call():
            out = fn()
            if train:
                torch.autograd.grad(out, grads, torch.ones_like(out))
        return call

    available = get_available_backends()
    for backend in BACKENDS:
        if backend not in available:
            notes[backend] = "unavailable"
            continue
        reasons = registry.get_backend(backend).not_supported_reasons(inputs)
        if reasons:
            notes[backend] = "declined: " + "; ".join(reasons)
            continue
        impl = registry.get_backend(backend)
        fn = step(lambda impl=impl: impl.attention(
            AttentionInputs.from_args(*leaves, mask, bias, None, causal)))
        fn()
        row[backend] = time_ms(fn, torch.device("cuda"))
    fn = step(lambda: flash_dmattn_func(*leaves, mask, bias, None, causal))
    fn()
    row["auto"] = time_ms(fn, torch.device("cuda"))
    best = min((t, b) for b, t in row.items() if b != "auto" and t is not None)
    flag = "" if row["auto"] <= 1.05 * best[0] else f" (best: {best[1]})"
    cells = [f"{row[b]:.3f}" if row.get(b) is not None else "-" for b in BACKENDS]
    print(f"| {name}, {'fwd+bwd' if train else 'fwd'}, B{B} H{H}/{Hkv} L{L} D{D} | "
          + " | ".join(cells) + f" | {row['auto']:.3f} | {taken} ({ranking.rule.key}){flag} |",
          flush=True)
    for backend, note in notes.items():
        if note != "unavailable":
            print(f"|   {backend} {note[:160]} | | | | | |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence lengths / 4")
    parser.add_argument("--only", default="", help="class names, comma separated")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("policy_probe: needs a CUDA device", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cap = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, "
          f"{args.dtype}; ms, medians; available: {', '.join(get_available_backends())}")
    print("| call | " + " | ".join(BACKENDS) + " | auto | auto took (rule) |")
    print("|---" * (len(BACKENDS) + 3) + "|")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for cls in CLASSES:
        if only and cls[0] not in only:
            continue
        if args.quick:
            cls = cls[:4] + (max(256, cls[4] // 4),) + cls[5:]
        for train in (False, True):
            try:
                run_class(cls, dtype, train)
            except torch.cuda.OutOfMemoryError:
                print(f"| {cls[0]}: out of memory | | | | | |")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
