"""Tests for flash_dmattn.planning.selection.topk_intervals (top-W selections as KeyIntervals).

The intervals must give exactly the visibility of the dense helpers (create_mask for a shared
top-W, causal_topk_mask for the causal one), ties included, and must never build anything of
size (L, L).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_dmattn.masks import KeyIntervals
from interpreter_only import triton_kernels_skip_reason
from flash_dmattn.planning import selection, selection_kernels
from flash_dmattn.planning.selection import kth_smallest_of_prefixes, topk_intervals
from flash_dmattn.utils.mask import causal_topk_mask, create_mask

F32_MIN = torch.finfo(torch.float32).min


def _causal(length):
    return torch.ones(length, length, dtype=torch.bool).tril()


def _dense(bias, window, is_causal, padding, min_dtype):
    """The dense helpers' mask, (B, H, L, L)."""
    batch, heads, _, length = bias.shape
    md = torch.finfo(bias.dtype).min if min_dtype is None else min_dtype
    if is_causal:
        return causal_topk_mask(bias, padding, window, md)
    out = create_mask(bias, padding, batch, length, length, window, md)
    return out.expand(batch, heads, length, length)


def _from_intervals(intervals, length, is_causal):
    dense = intervals.to_dense(length)
    return dense & _causal(length) if is_causal else dense


def _naive_intervals(bias, window, is_causal, padding, min_dtype):
    """Plain Python, O(L^2 W): query i keeps the W best candidates among its visible keys."""
    batch, heads, _, length = bias.shape
    md = torch.finfo(bias.dtype).min if min_dtype is None else min_dtype
    out = torch.zeros(batch, heads, length, length, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            row = bias[b, h, 0].double().tolist()
            cand = [
                j for j in range(length)
                if row[j] > md and (padding is None or bool(padding[b, j]))
            ]
            for i in range(length):
                seen = [j for j in cand if j <= i] if is_causal else cand
                best = sorted(seen, key=lambda j: (-row[j], j))[:window]
                out[b, h, i, best] = True
    return out


def _check(bias, window, is_causal, padding=None, min_dtype=None, fn=topk_intervals):
    length = bias.shape[-1]
    got = fn(bias, window, is_causal=is_causal, padding_mask=padding, min_dtype=min_dtype)
    assert isinstance(got, KeyIntervals)
    assert got.shape == (bias.shape[0], bias.shape[1], length)
    assert got.bounds.dtype == torch.int32
    dense = _from_intervals(got, length, is_causal)
    want = _dense(bias, window, is_causal, padding, min_dtype)
    assert torch.equal(dense, want)
    # Empty intervals are normalised to [0, 0); non-empty causal ones are [j, t_j) with j < t_j.
    start, end = got.start, got.end
    empty = start >= end
    assert bool((start[empty] == 0).all()) and bool((end[empty] == 0).all())
    if is_causal:
        j = torch.arange(length, dtype=torch.int32).expand_as(start)
        assert torch.equal(start[~empty], j[~empty])
        assert bool((end <= length).all())
    return got


# --------------------------------------------------------------------------------------
# Handmade cases
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_causal", [False, True])
def test_all_ties_keep_the_earliest(is_causal):
    bias = torch.ones(1, 1, 1, 10)
    got = _check(bias, 3, is_causal)
    if is_causal:
        # Key j < 3 is kept by every later query; key j >= 3 by none (keys 0..2 outrank it).
        assert got.end[0, 0].tolist() == [10, 10, 10] + [0] * 7
    else:
        assert (got.end[0, 0] > 0).tolist() == [True] * 3 + [False] * 7


def test_causal_interval_ends_at_the_wth_better_key():
    # Biases 5 1 4 3 2 6, W = 2. Key 1 (bias 1) is outranked by keys 0, 2, 3, 4, 5: its
    # interval ends at the 2nd of them, position 2. Key 2 (bias 4) by 0 and 5: ends at 5.
    # Key 3 (bias 3) by 0, 2, 5: the 2nd is at 2 <= 3, so no query keeps it (empty). Keys 0
    # and 5 have fewer than 2 better keys: kept to the end.
    bias = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, 6.0]).view(1, 1, 1, -1)
    got = _check(bias, 2, True)
    assert got.start[0, 0].tolist() == [0, 1, 2, 0, 0, 5]
    assert got.end[0, 0].tolist() == [6, 2, 5, 0, 0, 6]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [1, 2, 5, 31, 32, 33, 100])
def test_random_and_tied_biases(is_causal, window):
    g = torch.Generator().manual_seed(window)
    for bias in (
        torch.randn(2, 3, 1, 33, generator=g),
        torch.randint(0, 3, (2, 3, 1, 33), generator=g).float(),
    ):
        _check(bias, window, is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_min_dtype_inf_and_nan(is_causal):
    g = torch.Generator().manual_seed(1)
    bias = torch.randint(-2, 3, (3, 2, 1, 41), generator=g).float()
    bias[0, 0, 0, 3] = float("-inf")
    bias[0, 1, 0, 7] = float("nan")
    bias[1, 0, 0, 5] = F32_MIN
    bias[1, 1, 0, 9] = float("inf")
    bias[1, 1, 0, 10] = float("inf")
    bias[2, :, 0, :4] = -0.0  # -0.0 and 0.0 tie
    bias[2, :, 0, 4:8] = 0.0
    padding = torch.rand(3, 41, generator=g) > 0.3
    padding[2] = False  # a sequence with no real token at all
    for window in (1, 4, 40, 41, 64):
        _check(bias, window, is_causal, padding)
        _check(bias, window, is_causal, None, min_dtype=0.5)  # a user threshold
        _check(bias, window, is_causal, padding, min_dtype=-1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_low_precision_biases(dtype, is_causal):
    g = torch.Generator().manual_seed(2)
    bias = (torch.randn(2, 2, 1, 57, generator=g) * 0.01).to(dtype)  # many ties after rounding
    bias[0, 0, 0, 11] = torch.finfo(dtype).min
    _check(bias, 9, is_causal)


def test_matches_naive_reference():
    g = torch.Generator().manual_seed(5)
    bias = torch.randint(0, 4, (2, 2, 1, 23), generator=g).float()
    padding = torch.rand(2, 23, generator=g) > 0.2
    for is_causal in (False, True):
        for window in (1, 3, 8, 23):
            got = topk_intervals(bias, window, is_causal=is_causal, padding_mask=padding)
            want = _naive_intervals(bias, window, is_causal, padding, None)
            assert torch.equal(_from_intervals(got, 23, is_causal), want)


def test_broadcast_batch_and_degenerate_sizes():
    g = torch.Generator().manual_seed(3)
    # A batch-1 bias with a batch-3 padding mask (and the other way round).
    bias = torch.randn(1, 2, 1, 12, generator=g)
    padding = torch.rand(3, 12, generator=g) > 0.4
    got = topk_intervals(bias, 4, padding_mask=padding)
    assert got.shape == (3, 2, 12)
    assert torch.equal(_from_intervals(got, 12, True), causal_topk_mask(bias.expand(3, 2, 1, 12), padding, 4, F32_MIN))
    got = topk_intervals(torch.randn(3, 2, 1, 12, generator=g), 4, padding_mask=padding[:1])
    assert got.shape == (3, 2, 12)
    # One key, no keys, no heads.
    for is_causal in (False, True):
        _check(torch.randn(2, 2, 1, 1, generator=g), 1, is_causal)
        assert topk_intervals(torch.randn(2, 2, 1, 0), 3, is_causal=is_causal).shape == (2, 2, 0)
        assert topk_intervals(torch.randn(2, 0, 1, 9), 3, is_causal=is_causal).shape == (2, 0, 9)


def test_kv_cache_step_reads_the_last_queries():
    # Intervals built over the whole sequence serve the last Lq queries (bottom-right aligned).
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(1, 2, 1, 30, generator=g)
    got = topk_intervals(bias, 5)
    full = causal_topk_mask(bias, None, 5, F32_MIN)
    causal_tail = torch.ones(30, 30, dtype=torch.bool).tril()[-4:]
    assert torch.equal(got.to_dense(4) & causal_tail, full[:, :, -4:])


@pytest.mark.parametrize("radix_bits", [1, 2, 3, 5])
def test_every_radix_gives_the_same_result(radix_bits, monkeypatch):
    # The plain-PyTorch path (the _RADIX_BITS it reads).
    monkeypatch.setattr(selection, "_RADIX_BITS", radix_bits)
    g = torch.Generator().manual_seed(radix_bits)
    plain = selection._topk_intervals_torch
    for length in (2, 3, 17, 64, 65, 200):
        _check(torch.randint(0, 5, (2, 2, 1, length), generator=g).float(), 3, True, fn=plain)
        _check(torch.randn(1, 1, 1, length, generator=g), 16, True, fn=plain)


def test_kth_smallest_of_prefixes_against_a_sort():
    g = torch.Generator().manual_seed(6)
    for length, k in ((1, 1), (5, 1), (5, 5), (37, 4), (300, 17)):
        perm = torch.stack([torch.randperm(length, generator=g) for _ in range(3)])
        prefix = torch.randint(k, length + 1, (3, 50), generator=g)
        got = kth_smallest_of_prefixes(perm, prefix, k)
        want = torch.tensor([
            [perm[n, :p].sort().values[k - 1].item() for p in prefix[n].tolist()] for n in range(3)
        ])
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------
# Random cases (hypothesis)
# --------------------------------------------------------------------------------------
@st.composite
def _cases(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    length = draw(st.integers(1, 70))
    window = draw(st.integers(1, length + 3))
    tied = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if tied:
        bias = torch.randint(0, 3, (batch, heads, 1, length), generator=g).float()
    else:
        bias = torch.randn(batch, heads, 1, length, generator=g)
    special = torch.rand(bias.shape, generator=g)
    bias = bias.masked_fill(special < 0.08, F32_MIN).masked_fill(special > 0.94, float("-inf"))
    padding = torch.rand(batch, length, generator=g) > 0.25 if draw(st.booleans()) else None
    min_dtype = draw(st.sampled_from([None, 0.5, -1.0]))
    is_causal = draw(st.booleans())
    return bias, window, is_causal, padding, min_dtype


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_intervals_match_dense_helpers(case):
    _check(*case)


# --------------------------------------------------------------------------------------
# The Triton path (CUDA, or CPU under TRITON_INTERPRET=1) against the plain-PyTorch path
# --------------------------------------------------------------------------------------
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_needs_kernels = pytest.mark.skipif(
    not selection_kernels.available(torch.device(_DEVICE)),
    reason=str(triton_kernels_skip_reason()),
)


def _same_as_plain(bias, window, is_causal=True, padding=None, min_dtype=None):
    """The Triton path's bounds equal the plain path's, bit for bit (int32, same layout)."""
    bias = bias.to(_DEVICE)
    padding = None if padding is None else padding.to(_DEVICE)
    got = topk_intervals(bias, window, is_causal=is_causal, padding_mask=padding, min_dtype=min_dtype)
    want = selection._topk_intervals_torch(
        bias, window, is_causal=is_causal, padding_mask=padding, min_dtype=min_dtype
    )
    assert got.bounds.dtype == torch.int32 and got.bounds.is_contiguous()
    assert torch.equal(got.bounds, want.bounds), (bias.shape, window, is_causal)


def _biases(g, shape):
    """Random, tied and heavily tied biases with masked, -inf and NaN entries."""
    out = []
    for kind in ("randn", "tied", "all-equal"):
        if kind == "randn":
            bias = torch.randn(shape, generator=g)
        elif kind == "tied":
            bias = torch.randint(0, 4, shape, generator=g).float()
        else:
            bias = torch.zeros(shape)
        special = torch.rand(shape, generator=g)
        bias = bias.masked_fill(special < 0.05, F32_MIN).masked_fill(special > 0.96, float("-inf"))
        bias = bias.masked_fill((special > 0.5) & (special < 0.51), float("nan"))
        out.append(bias)
    return out


@_needs_kernels
@pytest.mark.parametrize("length", [2, 3, 7, 16, 17, 32, 33, 64, 100, 257])
def test_kernels_match_plain_path(length):
    g = torch.Generator().manual_seed(length)
    windows = sorted({1, 5, max(1, length - 1), length + 3})
    for kind, bias in enumerate(_biases(g, (2, 2, 1, length))):
        padding = torch.rand(2, length, generator=g) > 0.25
        for window in windows:
            _same_as_plain(bias, window, True, padding if (window + kind) % 2 else None)
        # Every candidate kept (L <= W): the one-launch path, causal and not.
        _same_as_plain(bias, length + 1, False, padding)


@_needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_16_bit_biases_sort_as_packed_keys(dtype):
    # 16-bit biases take the flat sort of packed (row, bias) int32 keys: random, tied and
    # all-equal rows with masked, -inf, NaN and -0.0 entries, padding, several rows.
    g = torch.Generator().manual_seed(11)
    for length in (70,):
        for kind, bias in enumerate(_biases(g, (3, 2, 1, length))):
            bias = bias.to(dtype)
            bias[..., ::7] = bias[..., ::7].abs().neg()  # -0.0 where the entry was 0
            padding = torch.rand(3, length, generator=g) > 0.25
            for window in (1, length - 1):
                _same_as_plain(bias, window, True, padding if (window + kind) % 2 else None)


@_needs_kernels
@pytest.mark.parametrize("radix_bits,check", [(1, 8), (2, 8), (3, 8), (4, 8), (5, 8), (4, 32),
                                              (5, 32)])
def test_kernels_every_radix_and_small_blocks(radix_bits, check, monkeypatch):
    # Small blocks and rank-table rows: several sub-blocks per program, several programs per
    # row (their digit counts summed by the later ones) and many table rows, at small L; the
    # 32-entry rows use every bit of their masks (the sign bit included).
    monkeypatch.setattr(selection_kernels, "radix_bits", lambda length: radix_bits)
    monkeypatch.setattr(selection_kernels, "_TILE", max(16, check) << radix_bits)
    monkeypatch.setattr(selection_kernels, "MAX_BLOCKS", 4)
    monkeypatch.setattr(selection_kernels, "CHECK", check)
    monkeypatch.setattr(selection_kernels, "QUERY_BLOCK", 16)
    g = torch.Generator().manual_seed(radix_bits + check)
    for length in (9, 40, 97) if radix_bits < 3 else (64, 130, 211):
        for window, bias in zip((1, 3, 17), _biases(g, (1, 2, 1, length))):
            padding = torch.rand(1, length, generator=g) > 0.2
            _same_as_plain(bias, window, True, padding)


@_needs_kernels
def test_kernels_query_blocks_past_the_window(monkeypatch):
    # Query blocks of 16 ranks, most past the window: the walks of keys no query sees, and of
    # keys seen to the end, beside those of a first block inside the window.
    monkeypatch.setattr(selection_kernels, "QUERY_BLOCK", 16)
    g = torch.Generator().manual_seed(5)
    for length in (48, 131):
        for window, bias in zip((1, 4, 33), _biases(g, (2, 2, 1, length))):
            padding = torch.rand(2, length, generator=g) > 0.2
            _same_as_plain(bias, window, True, padding if window != 4 else None)
        # A bias rising with the position: every later key outranks the earlier ones, so the
        # bound of a block's first rank is as loose as it gets.
        rising = torch.arange(length, dtype=torch.float32).view(1, 1, 1, length)
        _same_as_plain(rising.expand(1, 2, 1, length).clone(), 7, True)
        _same_as_plain(-rising.expand(1, 2, 1, length).clone(), 7, True)


@_needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_kernels_low_precision_and_thresholds(dtype):
    g = torch.Generator().manual_seed(7)
    bias = (torch.randn(2, 2, 1, 45, generator=g) * 0.01).to(dtype)  # many ties after rounding
    bias[0, 0, 0, 11] = torch.finfo(dtype).min
    bias[1, 1, 0, :5] = -0.0
    bias[1, 1, 0, 5:9] = 0.0
    bias[0, 1, 0, 3] = float("inf")
    for min_dtype in (None, 0.0, -0.004, 0.0031, -1e-300, float("-inf")):
        _same_as_plain(bias, 6, True, None, min_dtype)
    # Thresholds that the bias dtype cannot represent (torch compares with the rounded value).
    if dtype != torch.float64:
        _same_as_plain(torch.full((1, 1, 1, 9), 1.0, dtype=dtype), 2, True, None, 0.9999)


@_needs_kernels
def test_kernels_decline_rows_past_their_limits():
    # The walk packs a count with a digit into one int32 (counts below 2 ** 24), and rows are
    # a grid dimension: longer or more rows take the plain path.
    dev = torch.device(_DEVICE)
    assert selection_kernels.available(dev, 1, selection_kernels.MAX_LENGTH)
    assert not selection_kernels.available(dev, 1, selection_kernels.MAX_LENGTH + 1)
    assert not selection_kernels.available(dev, selection_kernels.MAX_ROWS + 1, 100)


@_needs_kernels
def test_kernels_broadcast_batch_and_strided_bias():
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(1, 3, 1, 50, generator=g)
    padding = torch.rand(4, 50, generator=g) > 0.3
    _same_as_plain(bias, 7, True, padding)
    _same_as_plain(torch.randn(4, 3, 1, 50, generator=g), 7, True, padding[:1])
    # A bias slice of a larger tensor (strides of the heads / keys not the contiguous ones).
    big = torch.randn(2, 6, 2, 100, generator=g)
    _same_as_plain(big[:, ::2, :1, ::2], 5, True, padding[:2, :50])
    # No key, no head: nothing to launch.
    for is_causal in (False, True):
        assert topk_intervals(torch.randn(2, 2, 1, 0, device=_DEVICE), 3, is_causal=is_causal).shape == (2, 2, 0)


@_needs_kernels
def test_kernels_selected_with_few_launches(monkeypatch):
    # One causal call: the score pass, (torch's sort,) the level-0 counts, a partition per
    # level but the last and one query kernel; the plain path is not used.
    monkeypatch.setattr(selection, "_plain_intervals", None)
    launches = []
    for name in ("_score_kernel", "_prep_kernel", "_partition_kernel", "_query_kernel"):
        kernel = getattr(selection_kernels, name)

        class Counting:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                launches.append(self.name)
                return self.kernel[grid]

        monkeypatch.setattr(selection_kernels, name, Counting(kernel, name))
    length = 300  # 9 bits: two levels of 5 bits
    bias = torch.randn(1, 2, 1, length, device=_DEVICE)
    topk_intervals(bias, 8)
    assert launches == ["_score_kernel", "_prep_kernel", "_partition_kernel", "_query_kernel"]
    launches.clear()
    topk_intervals(bias, length)  # every candidate kept
    assert launches == ["_score_kernel"]


@_needs_kernels
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_kernels_match_plain_path_random(case):
    bias, window, _, padding, min_dtype = case
    _same_as_plain(bias, window, True, padding, min_dtype)


# The compiled (not interpreted) kernels are built for sm_90 by tools/compile_check.py
# (workload "selection"), which tests/test_compile_gpu_target.py runs.


# --------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------
def test_rejects_bad_inputs():
    bias = torch.randn(1, 2, 1, 8)
    with pytest.raises(TypeError, match="attention_bias"):
        topk_intervals([1.0, 2.0], 2)
    with pytest.raises(TypeError, match="attention_bias"):
        topk_intervals(torch.ones(1, 2, 1, 8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="attention_bias"):
        topk_intervals(torch.randn(1, 2, 8, 8), 2)
    with pytest.raises(ValueError, match="attention_bias"):
        topk_intervals(torch.randn(2, 8), 2)
    with pytest.raises(TypeError, match="window_size"):
        topk_intervals(bias, 2.0)
    with pytest.raises(TypeError, match="window_size"):
        topk_intervals(bias, True)
    with pytest.raises(ValueError, match="window_size"):
        topk_intervals(bias, 0)
    with pytest.raises(TypeError, match="is_causal"):
        topk_intervals(bias, 2, is_causal=1)
    with pytest.raises(TypeError, match="padding_mask"):
        topk_intervals(bias, 2, padding_mask=torch.ones(1, 8))
    with pytest.raises(TypeError, match="padding_mask"):
        topk_intervals(bias, 2, padding_mask=[True] * 8)
    with pytest.raises(ValueError, match="padding_mask"):
        topk_intervals(bias, 2, padding_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask"):
        topk_intervals(torch.randn(2, 2, 1, 8), 2, padding_mask=torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask"):
        topk_intervals(bias, 2, padding_mask=torch.ones(1, 1, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="min_dtype"):
        topk_intervals(bias, 2, min_dtype="low")


def test_reexported_from_utils_mask():
    from flash_dmattn.utils import mask

    assert mask.topk_intervals is topk_intervals
    assert "topk_intervals" in mask.__all__


# --------------------------------------------------------------------------------------
# Memory: nothing of size (L, L) or (L, L / C)
# --------------------------------------------------------------------------------------
_MEMORY_SCRIPT = textwrap.dedent(
    """
    import torch
    from flash_dmattn.planning.selection import topk_intervals

    torch.set_num_threads(2)
    def status_mib(field):  # VmRSS: resident now; VmHWM: peak resident so far
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB

    L = 1_000_000
    g = torch.Generator().manual_seed(0)
    bias = torch.randint(0, 1000, (1, 1, 1, L), generator=g).float()  # ties included
    padding = torch.rand(1, L, generator=g) > 0.01
    # The measurement must see real allocations: touching 256 MiB has to show up.
    base = status_mib("VmRSS")
    probe = torch.ones(64 * 1024 * 1024, dtype=torch.int32)
    probe_growth = status_mib("VmHWM") - base
    del probe
    base = status_mib("VmRSS")
    got = topk_intervals(bias, 2048, is_causal=True, padding_mask=padding)
    growth = status_mib("VmHWM") - base
    # Spot-check a few keys against their definition: t_j is the position of the W-th
    # candidate that outranks key j.
    b = bias[0, 0, 0]
    ok = True
    for j in (0, 1, 2047, 2048, 5000, 123456, L - 1):
        if not padding[0, j]:
            continue
        better = ((b > b[j]) | ((b == b[j]) & (torch.arange(L) < j))) & padding[0]
        where = better.nonzero().flatten()
        t = L if where.numel() < 2048 else int(where[2047])
        want = (j, t) if t > j else (0, 0)
        ok &= (int(got.start[0, 0, j]), int(got.end[0, 0, j])) == want
    print(f"{probe_growth:.0f} {growth:.0f} {int(ok)}")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_million_keys_without_quadratic_memory():
    # Run in a fresh interpreter so that VmHWM (the process's peak resident memory) starts
    # near the resident memory before the call; the peak growth bounds every temporary. A dense
    # (L, L) bool mask would be ~1 TB, an (L, L / 256) one 4 GB: either fails to allocate
    # (the subprocess dies) or pushes the peak past the bound asserted here.
    # CPU tensors without Triton's interpreter: the plain-PyTorch path (the kernels' buffers
    # are O(L) by construction; interpreting them at 1M keys would take many minutes).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe_growth, growth, ok = proc.stdout.split()[-3:]
    assert float(probe_growth) > 200, "VmHWM did not register a 256 MiB allocation"
    assert float(growth) < 1024, f"peak memory grew by {growth} MiB for L = 1M"
    assert ok == "1"


def test_per_query_bias_error_says_what_to_write():
    with pytest.raises(ValueError, match=r"create_mask\(bias, window_size=W\)"):
        topk_intervals(torch.randn(1, 2, 8, 8), 4)
    with pytest.raises(ValueError, match=r"bias\[:, :, None, :\]"):
        topk_intervals(torch.randn(1, 2, 8), 4)
