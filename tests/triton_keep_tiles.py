"""A Triton kernel that writes the attention kernels' dropout keep tiles for one tile of rows
and keys (imported by tests/test_dropout.py only where the Triton kernels can run)."""
import triton
import triton.language as tl

from flash_dmattn.backends.triton.dropout_mask import (
    _dropout_keep,
    _dropout_keep_tile,
    _dropout_keep_tile_t,
    _dropout_seed,
)


@triton.jit
def keep_tiles_kernel(Rng, Out, OutT, OutE, start_m, start_n, bh, thresh,
                      BM: tl.constexpr, BN: tl.constexpr):
    """``Out`` (BM, BN): the key-tile keep tile; ``OutT`` (BN, BM): its transposed twin (both
    from packed per-16-key bits); ``OutE`` (BM, BN): the per-key helper's. int8 0 / 1."""
    seed, offset = _dropout_seed(Rng, True)
    am = tl.arange(0, BM)
    an = tl.arange(0, BN)
    offs_m = start_m + am
    offs_n = start_n + an
    keep = _dropout_keep_tile(seed, offset, bh, offs_m, offs_n, thresh)
    tl.store(Out + am[:, None] * BN + an[None, :], keep.to(tl.int8))
    keep_t = _dropout_keep_tile_t(seed, offset, bh, offs_m, offs_n, thresh)
    tl.store(OutT + an[:, None] * BM + am[None, :], keep_t.to(tl.int8))
    keep_e = _dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], thresh)
    tl.store(OutE + am[:, None] * BN + an[None, :], keep_e.to(tl.int8))
