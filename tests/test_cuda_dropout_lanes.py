"""The cuda kernels' sharing of dropout evaluations between lanes, checked on CPU.

``csrc/flash_dmattn/dropout.cuh`` gives each lane the keep bits of its wgmma accumulator
values by evaluating a few Philox counters per lane and moving bits between lanes with
shuffles (a transpose of lane bits with bit positions). No GPU runs here: this is a bit-exact
model of those helpers over the 32 lanes of a warp -- the evaluations each lane makes, the
packing, every transpose step with the masks, shifts and partner lanes read from the header
-- compared with the reference keep-mask (:func:`flash_dmattn.dropout.keep_mask`) at the
(row, column) each lane holds in the accumulator layout:

lane ``l`` holds rows ``l // 4`` and ``l // 4 + 8`` of the warp's 16 and columns
``8 g + 2 (l % 4) + e`` (``e`` in 0, 1) of every 8-column block ``g``.
"""
import re
from pathlib import Path

import pytest
import torch

from flash_dmattn.dropout import ROUNDS, keep_mask, keep_threshold, philox4x32

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "flash_dmattn" / "dropout.cuh"
LANES = torch.arange(32, dtype=torch.int64)
M32 = 0xFFFFFFFF
RNG = torch.tensor([0x5DEECE66D_1234, 0x9E3779B97], dtype=torch.int64)
P = 0.3


def _source():
    return HEADER.read_text()


def _function(name):
    """The body of ``name`` in the header (from its name to the next blank line)."""
    src = _source()
    start = src.index(name + "(")
    return src[start:src.index("\n\n", start)]


def _steps(name, call):
    """The transpose steps ``name`` makes, in order: ``(shift, mask, lane bit, lane xor)``
    parsed from its calls of ``call`` (``transpose_step`` / ``transpose_step2``)."""
    pat = (call + r"<(\d+), (0x[0-9a-f]+)u>\([^;]*?\((\w) & (\d)\) != 0, (\d+)\);")
    steps = [(int(sh), int(mask, 16), int(bit), int(xor))
             for sh, mask, _var, bit, xor in re.findall(pat, _function(name))]
    assert steps, f"no {call} found in {name}"
    return steps


def _keep_bits16(bh, key, grp):
    """``keep_bits16``: bit t says whether row 16 grp + t keeps key ``key`` (per lane)."""
    rounds = re.search(r"constexpr int kPhiloxRounds = (\d+);", _source())
    assert rounds and int(rounds.group(1)) == ROUNDS, "the kernels' Philox rounds are the stream's"
    seed = RNG[0]
    k0, k1 = seed & M32, (seed >> 32) & M32
    words = philox4x32(k0, k1, key, grp, torch.full_like(key, bh), torch.full_like(key, int(RNG[1]) & M32))
    thresh = keep_threshold(P)
    bits = torch.zeros_like(key)
    for w, word in enumerate(words):
        for b in range(4):
            bits |= (((word >> (8 * b)) & 0xFF) >= thresh).long() << (4 * w + b)
    return bits


def test_keep_bits_arithmetic_is_the_byte_compare():
    # keep_bits16 tests four bytes at a time (keep_high_bits) and gathers the results with a
    # multiply (gather_high_bits): the header's expressions, modelled exactly, against a plain
    # per-byte compare for every threshold 0..256 (256: p rounds to 1) and every byte value in
    # every byte position, among random words.
    body = _function("keep_high_bits")
    assert "const uint32_t s = (word & 0x7f7f7f7fu) + lo_add;" in body
    assert "return (word & s) | ((word | s) & sel);" in body
    assert ("return ((b & 0x80808080u) | ((a >> 4) & 0x08080808u)) * 0x00204081u;"
            in _function("gather_high_bits"))
    key = _function("dropout_key")
    assert "key.lo_add = t > 255u ? 0u : (128u - (t & 127u)) * 0x01010101u;" in key
    assert "key.sel = t < 128u ? 0x80808080u : 0u;" in key
    bits16 = _function("keep_bits16")
    assert "return (r0 >> 24) | ((r1 >> 16) & 0xff00u);" in bits16
    assert "gather_high_bits(keep_high_bits(w.x, key.lo_add, key.sel)," in bits16
    assert "gather_high_bits(keep_high_bits(w.z, key.lo_add, key.sel)," in bits16

    gen = torch.Generator().manual_seed(0)
    every_byte = torch.arange(256, dtype=torch.int64) * 0x01010101
    random = torch.randint(0, 2**32, (4, 4096), generator=gen, dtype=torch.int64)
    x, y, z, w = (torch.cat([every_byte.roll(17 * i), r]) for i, r in enumerate(random))
    for t in range(257):
        lo_add = 0 if t > 255 else (128 - (t & 127)) * 0x01010101
        sel = 0x80808080 if t < 128 else 0

        def high(word):
            s = (word & 0x7F7F7F7F) + lo_add
            return (word & s) | ((word | s) & sel)

        def gather(a, b):
            return (((b & 0x80808080) | ((a >> 4) & 0x08080808)) * 0x00204081) & M32

        r0, r1 = gather(high(x), high(y)), gather(high(z), high(w))
        got = (r0 >> 24) | ((r1 >> 16) & 0xFF00)
        want = torch.zeros_like(x)
        for k, word in enumerate((x, y, z, w)):
            for b in range(4):
                want |= (((word >> (8 * b)) & 0xFF) >= t).long() << (4 * k + b)
        assert torch.equal(got, want), t


def _shfl_xor(x, lane_xor):
    return x[LANES ^ lane_xor]


def _step(a, sh, mask, upper, lane_xor):
    """``transpose_step``."""
    nmask = ~mask & M32
    send = torch.where(upper, (a << sh) & mask, (a >> sh) & nmask)
    recv = _shfl_xor(send, lane_xor)
    return (a & torch.where(upper, torch.full_like(a, mask), torch.full_like(a, nmask))) | recv


def _step2(a, b, sh, mask, upper, lane_xor):
    """``transpose_step2``."""
    nmask = ~mask & M32
    send = torch.where(upper, ((a << sh) & mask) | (b & nmask), ((a >> sh) & nmask) | (b & mask))
    recv = _shfl_xor(send, lane_xor)
    a_new = torch.where(upper, (a & mask) | (recv & nmask), (a & nmask) | (recv & mask))
    b_new = torch.where(upper, (b & mask) | ((recv & mask) >> sh),
                        (b & nmask) | (((recv & nmask) << sh) & M32))
    return a_new, b_new


def query_rows_bits(k_cols, bh, grp, key_of):
    """``dropout_query_rows_bits<k_cols>`` over the warp: ``(out0, out1)``, one int per lane."""
    body = _function("dropout_query_rows_bits")
    assert "const int c = 32 * e + 8 * (s >> 1) + 2 * q + (s & 1);" in body
    assert "lo |= (bits & 0xffu) << (8 * e);" in body and "hi |= (bits >> 8) << (8 * e);" in body
    s, q = LANES >> 2, LANES & 3
    lo = torch.zeros(32, dtype=torch.int64)
    hi = torch.zeros(32, dtype=torch.int64)
    for e in range(k_cols // 32):
        c = 32 * e + 8 * (s >> 1) + 2 * q + (s & 1)
        bits = _keep_bits16(bh, key_of(c), torch.full_like(c, grp))
        lo |= (bits & 0xFF) << (8 * e)
        hi |= (bits >> 8) << (8 * e)
    steps = _steps("dropout_query_rows_bits", "transpose_step2")
    assert len(steps) == 3
    for sh, mask, bit, lane_xor in steps:
        lo, hi = _step2(lo, hi, sh, mask, (s & bit) != 0, lane_xor)
    return lo, hi


def key_rows_bits(bh, j0, j1, q0):
    """``dropout_key_rows_bits`` over the warp: ``(out0, out1)``, one int per lane."""
    body = _function("dropout_key_rows_bits")
    assert "const uint32_t grp = uint32_t(q0 >> 4) + uint32_t(q);" in body
    q = LANES & 3
    grp = (q0 >> 4) + q
    w = _keep_bits16(bh, j0, grp) | (_keep_bits16(bh, j1, grp) << 16)
    steps = _steps("dropout_key_rows_bits", "transpose_step")
    assert len(steps) == 2
    for sh, mask, bit, lane_xor in steps:
        w = _step(w, sh, mask, (q & bit) != 0, lane_xor)
    return w & 0xFFFF, w >> 16


def key_rows_bit(g, e):
    """``key_rows_bit``, checked against the header's definition."""
    assert "return 8 * (g & 1) + 2 * (g >> 1) + e;" in _function("key_rows_bit")
    return 8 * (g & 1) + 2 * (g >> 1) + e


def _ref(bh, rows, cols):
    """Reference keep bits of (rows, cols) of (batch * H + head) ``bh`` with H = 4."""
    b, h = bh // 4, bh % 4
    return keep_mask(RNG, P, torch.tensor(b), 4, torch.tensor(h), rows, cols)


@pytest.mark.parametrize("k_cols", [64, 128])
@pytest.mark.parametrize("walk", ["tile", "list", "short-list"])
def test_query_rows_bits_are_the_reference_mask(k_cols, walk):
    # Rows = queries (forward, dQ): the warp's 16 rows are group grp; columns a key tile or
    # listed keys (scattered, ascending), columns past a short list read key 0.
    gen = torch.Generator().manual_seed(k_cols)
    for bh, grp in ((0, 0), (5, 7), (11, 1000)):
        if walk == "tile":
            keys = 3 * k_cols + torch.arange(k_cols)
            n = k_cols
        else:
            keys = torch.randperm(20000, generator=gen)[:k_cols].sort().values
            n = k_cols if walk == "list" else k_cols - 37
        key_of = lambda c: torch.where(c < n, keys[c.clamp(max=k_cols - 1)], 0)  # noqa: E731
        out = query_rows_bits(k_cols, bh, grp, key_of)
        for r in range(2):
            rows = 16 * grp + (LANES >> 2) + 8 * r
            for g in range(k_cols // 8):
                for e in range(2):
                    c = 8 * g + 2 * (LANES & 3) + e
                    want = _ref(bh, rows, key_of(c))
                    got = ((out[r] >> (2 * g + e)) & 1).bool()
                    assert torch.equal(got, want), (r, g, e)


@pytest.mark.parametrize("keys", ["tile", "interval-block"])
def test_key_rows_bits_are_the_reference_mask(keys):
    # Rows = keys (dK / dV): this lane's keys are rows lane / 4 and + 8 of the warp's 16 (a
    # key tile's consecutive keys or a key-interval block's scattered ones), columns the 64
    # queries from q0.
    gen = torch.Generator().manual_seed(3)
    for bh, q0 in ((0, 0), (6, 64), (9, 4096 + 192)):
        if keys == "tile":
            warp_keys = 128 + torch.arange(16)
        else:
            warp_keys = torch.randperm(50000, generator=gen)[:16]
        j0, j1 = warp_keys[LANES >> 2], warp_keys[(LANES >> 2) + 8]
        out = key_rows_bits(bh, j0, j1, q0)
        for r, j in enumerate((j0, j1)):
            for g in range(8):
                for e in range(2):
                    query = q0 + 8 * g + 2 * (LANES & 3) + e
                    want = _ref(bh, query, j)
                    got = ((out[r] >> key_rows_bit(g, e)) & 1).bool()
                    assert torch.equal(got, want), (r, g, e)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_accumulator_layout_is_the_helpers(head_dim, tmp_path):
    # The layout above is the kernels' (their wgmma fragments): a host program built with the
    # kernels' configuration headers walks every thread's values (nvcc and CUTLASS, no GPU).
    import subprocess

    from flash_dmattn.backends.cuda import toolchain

    nvcc, inc = toolchain.find_nvcc(), toolchain.find_cutlass_include()
    if nvcc is None or inc is None:
        pytest.skip("needs nvcc and the CUTLASS headers")
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "layout"
    build = subprocess.run(
        [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "--expt-extended-lambda",
         "-gencode", "arch=compute_90a,code=sm_90a", "-DFLASH_DMATTN_SM90=1",
         f"-DFLASH_DMATTN_HEADDIM={head_dim}", "-DFLASH_DMATTN_IS_BF16=1",
         "-DFLASH_DMATTN_HAS_MASK=1", "-DFLASH_DMATTN_HAS_BIAS=1", "-DFLASH_DMATTN_PACKED=0",
         f"-I{inc}", f"-I{root / 'csrc'}", "-o", str(exe),
         str(root / "tests" / "cuda_fragment_layout.cu")],
        capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "sm_90a" in build.stderr and "nvcc fatal" in build.stderr:
        pytest.skip("this nvcc cannot build sm_90a")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout
