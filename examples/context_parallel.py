"""Context-parallel attention with a trainable bias, and Dynamic Mask Attention across ranks.

Run with one process per GPU (NCCL), or on CPU (gloo)::

    torchrun --nproc-per-node 2 examples/context_parallel.py
    torchrun --nproc-per-node 4 examples/context_parallel.py --seq-len 65536 --layout zigzag
    torchrun --nproc-per-node 4 examples/context_parallel.py --seq-len 8190   # shards of 2047/2048
    python examples/context_parallel.py --nproc 2          # CPU, without torchrun

Every rank builds the same random problem, keeps its shard of the sequence (``--layout``) and
runs, forward and backward:

1. ``context_parallel_attention``: causal attention with a per-key bias (a gradient leaf) and
   a per-key padding mask; K/V go round a ring while each rank computes.
2. ``context_parallel_dma_attention``: each query keeps the ``--window`` keys of largest bias
   among its causal prefix; the bias is all-gathered, the selection made once, and only the
   selected keys' K/V move.

With ``--check`` (default for sequences up to 8192 tokens) every rank also runs the same two
calls on the whole sequence in one process, in float32 (float64 for ``--dtype fp64``) on the
torch reference (it materialises the L x L scores of every head), and
compares its shards of the output and of every gradient with them; in bf16/fp16 the error must
stay within twice that of the one call in the same dtype (or 1e-2). The exit status is 1
otherwise.
Each rank prints the bytes it received.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_dmattn import flash_dmattn_func, reference_dmattn_func  # noqa: E402
from flash_dmattn.distributed import (  # noqa: E402
    context_parallel_attention,
    context_parallel_dma_attention,
    record_communication,
    shard_positions,
    shard_segments,
    shard_sequence,
)
from flash_dmattn.utils.mask import topk_intervals  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# Largest relative error (norm of the difference / norm of the reference) accepted against one
# call in float32 (float64): rounding of the blocks' outputs before the merge, and of the merge.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
# In half precision every block's output and gradients are rounded to the input dtype before
# they are summed in float32, one rounding more than the one call's: the error may reach twice
# the one call's own, or HALF_FLOOR (a missing or doubled block costs far more: ~1e-1).
HALF_FLOOR = 1e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048, help="total tokens over all ranks")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=256, help="keys kept per query (DMA)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--backend", default=None, help="local kernels' backend (default: auto)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare with one process on the whole sequence (default: L <= 8192)")
    p.add_argument("--nproc", type=int, default=None,
                   help="without torchrun: spawn this many CPU processes (gloo)")
    return p.parse_args(argv)


def make_problem(args, device, dtype):
    """The whole-sequence tensors, the same on every rank (one seed)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, L, H, Hkv, D = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)

    q, k, v = randn(B, L, H, D), randn(B, L, Hkv, D), randn(B, L, Hkv, D)
    dout = randn(B, L, H, D)
    bias = randn(B, Hkv, 1, L, scale=2.0)  # a trainable per-key bias, like DMA's
    padding = torch.ones(B, 1, 1, L, dtype=torch.bool, device=device)
    padding[..., -L // 16:] = False  # the last tokens are padding
    return dict(q=q, k=k, v=v, dout=dout, bias=bias, mask=padding)


def run_step(fn, leaves, dout, warmup: int = 1):
    """Forward and backward of ``fn`` on fresh leaves, after ``warmup`` untimed ones (the first
    call pays for kernel compilation and connection set-up); output, gradients, bytes, seconds."""
    sync = torch.cuda.synchronize if leaves[0].is_cuda else (lambda: None)
    for _ in range(warmup + 1):
        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        sync()
        start = time.perf_counter()
        with record_communication() as log:
            out = fn(*fresh)
            out.backward(dout)
            sync()
        seconds = time.perf_counter() - start
    return out.detach(), [t.grad for t in fresh], log, seconds


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_against_one_process(args, full, ring, dma, shard, dtype, lines) -> bool:
    """Compare this rank's shards with one call on the whole sequence in float32 (float64 for
    float64 inputs) on the torch reference (plain matrix products: no kernel under test, nothing
    to compile). In half precision the same one call in the input dtype (``flash_dmattn_func``,
    auto-dispatch) is compared too, and context parallelism must stay within twice its error;
    otherwise within ``TOLERANCE``."""
    names = ("out", "dq", "dk", "dv", "dbias")
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    selection = topk_intervals(full["bias"], args.window, is_causal=True)

    def one_process(mask, in_dtype):
        whole = [full[n].to(in_dtype) for n in ("q", "k", "v", "bias")]
        func = reference_dmattn_func if in_dtype == exact else flash_dmattn_func
        fn = (lambda q_, k_, v_, b_: func(q_, k_, v_, attn_mask=mask, attn_bias=b_, is_causal=True))
        out, grads, _, _ = run_step(fn, whole, full["dout"].to(in_dtype), warmup=0)
        return [out] + grads

    failed = False
    for name, mine, mask in (("ring", ring, full["mask"]), ("DMA", dma, selection)):
        want = one_process(mask, exact)
        half = dtype in (torch.float16, torch.bfloat16)
        same_dtype = one_process(mask, dtype) if half else None
        cells = []
        for i, label in enumerate(names):
            dim = -1 if label == "dbias" else 1
            target = shard(want[i], dim)
            err = rel_err(([mine[0]] + mine[1])[i], target)
            if half:
                base = rel_err(shard(same_dtype[i], dim), target)
                failed |= err > max(2 * base, HALF_FLOOR)
                cells.append(f"{label} {err:.1e} (one call {base:.1e})")
            else:
                failed |= err > TOLERANCE[dtype]
                cells.append(f"{label} {err:.1e}")
        lines.append(f"  {name} vs one process in {str(exact)[6:]}: " + ", ".join(cells))
    return failed


def main(args, device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    check = args.check if args.check is not None else args.seq_len <= 8192
    layout, L = args.layout, args.seq_len  # any length: shards then differ by a token or two
    full = make_problem(args, device, dtype)

    def shard(t, dim=1):
        return shard_sequence(t, rank, world, layout, dim)

    q, k, v, dout = (shard(full[n]) for n in ("q", "k", "v", "dout"))
    bias, mask = shard(full["bias"], -1), shard(full["mask"], -1)
    # Rotary embeddings take these positions: a zigzag shard is two ranges.
    pos = shard_positions(layout, rank, world, seq_len=L)
    ranges = " and ".join(f"[{a}, {a + n})" for a, n in shard_segments(layout, rank, world, seq_len=L))
    assert pos.numel() == q.shape[1]
    common = dict(layout=layout, backend=args.backend, seq_len=L)  # seq_len: no length exchange

    ring = run_step(lambda q_, k_, v_, b_: context_parallel_attention(
        q_, k_, v_, attn_mask=mask, attn_bias=b_, is_causal=True, **common), (q, k, v, bias), dout)
    dma = run_step(lambda q_, k_, v_, b_: context_parallel_dma_attention(
        q_, k_, v_, b_, args.window, is_causal=True, **common), (q, k, v, bias), dout)

    lines = [f"rank {rank}/{world}: {L} tokens, {layout} layout, this rank holds positions "
             f"{ranges}; B{args.batch} H{args.heads}/{args.kv_heads} D{args.head_dim} {dtype}, {device}"]
    for name, (_, _, log, seconds) in (("ring, mask + bias", ring), (f"DMA top-{args.window}", dma)):
        got = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(log.received.items()))
        lines.append(f"  {name:<18} fwd+bwd {seconds * 1e3:8.1f} ms   received: {got}")

    failed = False
    if check:
        failed = check_against_one_process(args, full, ring, dma, shard, dtype, lines)
    for r in range(world):  # one rank at a time, in order
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    return 1 if failed else 0


def _spawned(rank, world, store, args, codes):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        codes[rank] = main(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            # One GPU per process, current before NCCL starts; device_id makes the
            # communicator now rather than at the first collective.
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        try:
            code = main(args, device)
        finally:
            dist.destroy_process_group()
        sys.exit(code)
    import torch.multiprocessing as mp

    nproc = args.nproc or 2
    store = tempfile.mktemp(prefix="context_parallel_")
    codes = mp.get_context("spawn").Manager().list([0] * nproc)
    mp.spawn(_spawned, args=(nproc, store, args, codes), nprocs=nproc)
    sys.exit(max(codes))
