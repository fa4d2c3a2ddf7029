"""Time the mask summary kernel on the T2 mask at the forward and backward granularities,
with and without key bits (GPU).

    python3 scripts/summary_time.py        (from the root of the tree whose package to time)
"""
import sys

import torch

sys.path.insert(0, ".")
from triton.testing import do_bench  # noqa: E402

import flash_dmattn  # noqa: E402
from benchmarks.workloads import build_case, workloads_for  # noqa: E402
from flash_dmattn.block_map import block_reduce  # noqa: E402
from flash_dmattn.planning.mask_summary import key_bits_reference, summarize_mask  # noqa: E402


def main():
    w = workloads_for("dynamic", quick=False)[0]
    c = build_case(w, torch.device("cuda"), torch.bfloat16)
    print("package:", flash_dmattn.__file__)
    # The compiled kernel against the plain-PyTorch summary and key bits.
    want_bits = key_bits_reference(c.mask, True)
    L = c.mask.size(-1)
    for blocks in ((128, 64), (64, 64), (64, 128), (128, 128)):
        got = summarize_mask(c.mask, *blocks, True, key_bits=True)
        live, _ = got.tiles(*blocks)
        want_live = block_reduce(block_reduce(c.mask, 2, blocks[0], "any"), 3, blocks[1], "any")
        want_full = block_reduce(block_reduce(c.mask, 2, blocks[0], "all"), 3, blocks[1], "all")
        print(f"check {blocks}: key bits = reference {torch.equal(got.key_bits, want_bits)}, "
              f"maps = reference (seen tiles) "
              f"{_seen_equal(blocks, L, L, live, got.tile_all, want_live, want_full)}",
              flush=True)
    for blocks in ((128, 64), (64, 64), (64, 128), (128, 128)):
        for bits in (False, True):
            def run(blocks=blocks, bits=bits):
                return summarize_mask(c.mask, *blocks, True, key_bits=bits)

            run()
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            print(f"summary {blocks[0]}x{blocks[1]} causal key_bits={int(bits)}: {ms:.4f} ms",
                  flush=True)


def _seen_equal(blocks, lq, lk, live, full, want_live, want_full):
    """A causal summary leaves tiles that no row of theirs can see dead (unread): the maps
    must equal the reference on every other tile."""
    bq, bk = blocks
    n_q, n_k = live.shape[-2:]
    last_row = torch.clamp(torch.arange(1, n_q + 1, device=live.device) * bq, max=lq) - 1
    first_key = torch.arange(n_k, device=live.device) * bk
    seen = first_key[None, :] <= last_row[:, None] + (lk - lq)
    return bool(torch.equal(live[..., seen], want_live[..., seen])
                and torch.equal(full[..., seen], want_full[..., seen]))


if __name__ == "__main__":
    main()
