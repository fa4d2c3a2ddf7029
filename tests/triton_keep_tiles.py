"""A Triton kernel that writes the attention kernels' dropout keep tiles for one tile of rows
and keys (imported by tests/test_dropout.py only where the Triton kernels can run)."""
import triton
import triton.language as tl

from flash_dmattn.backends.triton.dropout_mask import (
    _dropout_keep,
    _dropout_keep_tile,
    _dropout_keep_tile_t,
    _dropout_seed,
    _dropout_word_bits,
)


@triton.jit
def keep_tiles_kernel(Rng, Cols, Out, OutT, OutE, start_m, bh, thresh,
                      BM: tl.constexpr, BN: tl.constexpr):
    """Rows ``start_m + [0, BM)`` and the BN keys ``Cols`` (any: a key tile or a gathered
    list). ``Out`` (BM, BN): the kernels' keep tile; ``OutT`` (BN, BM): its transposed twin
    (both from packed per-16-row bits); ``OutE`` (BM, BN): the per-entry definition's. int8
    0 / 1."""
    seed, offset = _dropout_seed(Rng, True)
    am = tl.arange(0, BM)
    an = tl.arange(0, BN)
    offs_m = start_m + am
    cols = tl.load(Cols + an)
    keep = _dropout_keep_tile(seed, offset, bh, offs_m, cols, thresh)
    tl.store(Out + am[:, None] * BN + an[None, :], keep.to(tl.int8))
    keep_t = _dropout_keep_tile_t(seed, offset, bh, offs_m, cols, thresh)
    tl.store(OutT + an[:, None] * BM + am[None, :], keep_t.to(tl.int8))
    keep_e = _dropout_keep(seed, offset, bh, offs_m[:, None], cols[None, :], thresh)
    tl.store(OutE + am[:, None] * BN + an[None, :], keep_e.to(tl.int8))


@triton.jit
def word_bits_kernel(Words, Out, thresh, N: tl.constexpr):
    """``Out[i]``: the kernels' 4 keep bits of the uint32 ``Words[i]`` (stored as int32) at
    threshold ``thresh``."""
    i = tl.arange(0, N)
    word = tl.load(Words + i).to(tl.uint32, bitcast=True)
    tl.store(Out + i, _dropout_word_bits(word, thresh))
