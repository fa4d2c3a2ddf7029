"""Key-interval masks on the Triton kernels: outputs and every gradient against the reference
run on the same mask in dense form (float64), plus the planner's lists against brute force.

On CPU the kernels run under Triton's interpreter at small shapes; on a GPU the ``gpu`` cases
run larger bf16 problems and are judged against the reference at float64, with the error of
the reference run at bf16 as the yardstick (as FlashAttention's tests do).
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_dmattn as fd
from flash_dmattn import KeyIntervals
from flash_dmattn.planning.key_lists import key_ranges, plan_intervals

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_kernels = pytest.mark.skipif(not (ON_GPU or INTERP),
                                   reason="needs a GPU or TRITON_INTERPRET=1")


def _intervals(gen, shape, lk, lo=-4, span=None):
    span = span or lk
    start = torch.randint(lo, lk, shape, generator=gen)
    end = start + torch.randint(-3, span, shape, generator=gen)
    return start, end


def _run(fn, q, k, v, mask, bias, causal, softcap, deterministic=False):
    out = fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal, softcap=softcap,
             deterministic=deterministic)
    return out


def _grads(out, inputs, g):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], g)


def check_case(B, Lq, Lk, H, Hkv, D, bounds_shape, bias_shape, causal, softcap=0.0,
               device="cpu", dtype=torch.float32, seed=0, empty_rows=False, neg_inf_bias=False,
               intervals=None, fn=None):
    """Run ``fn`` (the triton call unless given) on a random problem and compare its output
    and every gradient with the float64 reference on the same mask in dense form."""
    fn = fn or fd.triton_dmattn_func
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=gen)
    k = torch.randn(B, Lk, Hkv, D, generator=gen)
    v = torch.randn(B, Lk, Hkv, D, generator=gen)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen)
    if bias is not None and neg_inf_bias:
        bias = bias.masked_fill(torch.rand(bias.shape, generator=gen) < 0.2, float("-inf"))
    if intervals is None:
        start, end = _intervals(gen, bounds_shape, Lk)
        if empty_rows:
            # No key reaches the first third of the queries.
            start = start.clamp(min=Lk - Lq + Lq // 3)
        intervals = KeyIntervals(start, end)
    dense = intervals.to_dense(Lq)

    def leaf(t, dt):
        return None if t is None else t.to(device, dt).requires_grad_(True)

    qt, kt, vt, bt = (leaf(t, dtype) for t in (q, k, v, bias))
    ki = intervals.to(device)
    out = _run(fn, qt, kt, vt, ki, bt, causal, softcap)
    g = torch.randn(out.shape, generator=gen).to(device, dtype)
    grads = _grads(out, (qt, kt, vt, bt), g)

    q64, k64, v64, b64 = (leaf(t, torch.float64) for t in (q, k, v, bias))
    ref = _run(fd.reference_dmattn_func, q64, k64, v64, dense.to(device), b64, causal, softcap)
    ref_grads = _grads(ref, (q64, k64, v64, b64), g.double())

    assert not torch.isnan(out).any()
    if dtype == torch.float32:
        tol = dict(atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(out.double(), ref, **tol)
        for a, r in zip(grads, ref_grads):
            assert not torch.isnan(a).any()
            torch.testing.assert_close(a.double(), r, **tol)
        return out
    # Low precision: the kernel's error against float64 stays within a small multiple of the
    # error of the reference itself run at the same precision.
    qb, kb, vb, bb = (leaf(t, dtype) for t in (q, k, v, bias))
    low = _run(fd.reference_dmattn_func, qb, kb, vb, dense.to(device), bb, causal, softcap)
    low_grads = _grads(low, (qb, kb, vb, bb), g)
    for a, lo_, r in zip((out, *grads), (low, *low_grads), (ref, *ref_grads)):
        assert not torch.isnan(a).any()
        err = (a.double() - r).abs().max().item()
        base = (lo_.double() - r).abs().max().item()
        assert err <= 3 * base + 1e-3 * r.abs().max().item() + 1e-5, (err, base)
    return out


CPU_CASES = [
    # (B, Lq, Lk, H, Hkv, D, bounds shape, bias shape, causal)
    (2, 37, 45, 4, 2, 16, (2, 2, 45), (2, 2, 1, 45), False),
    (2, 37, 45, 4, 2, 16, (2, 2, 45), (2, 2, 1, 45), True),
    (1, 45, 37, 2, 1, 16, (1, 1, 37), (1, 1, 1, 37), True),       # Lq > Lk
    (1, 5, 40, 4, 2, 16, (1, 2, 40), (1, 2, 1, 40), True),        # few queries, Lq < Lk
    (2, 33, 33, 4, 2, 24, (2, 4, 33), (2, 4, 1, 33), True),       # bounds per query head
    (2, 33, 33, 4, 2, 16, (33,), (1, 1, 1, 33), True),            # bounds shared by all
    (2, 33, 33, 4, 1, 16, (1, 1, 33), None, False),               # MQA, no bias
    (2, 30, 30, 2, 2, 16, (2, 1, 30), (1, 2, 1, 30), True),
]


@needs_kernels
@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_intervals_match_dense(case, softcap, monkeypatch):
    if ON_GPU:
        pytest.skip("interpreter sizes; the GPU runs test_intervals_gpu")
    from flash_dmattn.backends.triton import common

    monkeypatch.setattr(common, "DEBUG_POISON", True)  # unwritten outputs show as NaN
    check_case(*case, softcap=softcap)


@needs_kernels
def test_empty_rows_and_neg_inf_bias(monkeypatch):
    if ON_GPU:
        pytest.skip("interpreter sizes")
    from flash_dmattn.backends.triton import common

    monkeypatch.setattr(common, "DEBUG_POISON", True)
    out = check_case(2, 31, 31, 4, 2, 16, (2, 2, 31), (2, 2, 1, 31), True, empty_rows=True,
                     neg_inf_bias=True)
    assert (out[:, : 31 // 3] == 0).all()


@needs_kernels
def test_segmented_dkv_and_deterministic(monkeypatch):
    """Key blocks split over several programs (atomic partial sums) give the same gradients;
    deterministic=True keeps one program per block and is bitwise reproducible."""
    if ON_GPU:
        pytest.skip("interpreter sizes")
    from flash_dmattn.backends.triton import intervals

    monkeypatch.setattr(intervals, "SEGMENT_ROWS", 16)
    check_case(1, 70, 70, 2, 1, 16, (1, 1, 70), (1, 1, 1, 70), True, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 40, 2, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 40, 1, 16, generator=gen, requires_grad=True)
    v = torch.randn(1, 40, 1, 16, generator=gen, requires_grad=True)
    ki = KeyIntervals(*_intervals(gen, (1, 1, 40), 40))
    runs = []
    for _ in range(2):
        out = fd.triton_dmattn_func(q, k, v, attn_mask=ki, is_causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("causal_selection", [False, True])
def test_topk_selection_with_ties(causal_selection):
    """The library's own selections (random and tied biases, padding) through the kernels."""
    if ON_GPU:
        pytest.skip("interpreter sizes")
    from flash_dmattn.utils.mask import topk_intervals

    gen = torch.Generator().manual_seed(5)
    B, L, H, Hkv, D, W = 2, 48, 4, 2, 16, 7
    bias = torch.randint(0, 3, (B, Hkv, 1, L), generator=gen).float()
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, -9:] = False
    ki = topk_intervals(bias, W, is_causal=causal_selection, padding_mask=pad)
    check_case(B, L, L, H, Hkv, D, None, (B, Hkv, 1, L), True, intervals=ki)


def test_plan_lists_match_brute_force():
    gen = torch.Generator().manual_seed(1)
    Lq, Lk = 53, 61
    start, end = _intervals(gen, (3, Lk), Lk)
    bounds = KeyIntervals(start, end).bounds
    for causal in (False, True):
        plan = plan_intervals(bounds, Lq, Lk, causal, block_m=16, block_n=8, backward=True,
                              end_bucket=16)
        dense = KeyIntervals.from_bounds(bounds).to_dense(Lq)[0]  # (3, Lq, Lk)
        if causal:
            i = torch.arange(Lq)[:, None] + (Lk - Lq)
            dense = dense & (torch.arange(Lk)[None, :] <= i)
        for r in range(3):
            for m in range(plan.n_tiles):
                s, n = plan.tile_start[r, m].item(), plan.tile_len[r, m].item()
                nf = plan.tile_full[r, m].item()
                got = plan.keys[s:s + n].tolist()
                rows = dense[r, m * 16:(m + 1) * 16]
                want = rows.any(0).nonzero().flatten().tolist()
                every = rows.all(0).nonzero().flatten().tolist()
                # The keys every query of the tile sees first, then the others; each group
                # in position order.
                assert got[:nf] == every
                assert got[nf:] == [j for j in want if j not in every]
        # Key blocks: every seen key exactly once, each block's range covers its keys'.
        ranges = key_ranges(bounds, Lq, Lk, causal)
        seen = []
        for blk in range(plan.n_blocks):
            r = blk // plan.blocks_per_row
            for key in plan.blk_keys[blk].tolist():
                if key < 0:
                    continue
                seen.append((r, key))
                assert plan.blk_qlo[blk] <= ranges.lo[r, key]
                assert ranges.hi[r, key] <= plan.blk_qhi[blk]
        want = {(r, j) for r in range(3) for j in range(Lk) if dense[r, :, j].any()}
        assert sorted(seen) == sorted(want)


@pytest.mark.parametrize("causal", [False, True])
def test_segment_items_cover_every_pair_once(causal):
    """Segment items (the cuda backward's blocks under a window promise): within each segment,
    every key that meets it is in exactly one of the segment's items, the item's range lies in
    the segment and covers the key's range there; the keys every query of the segment sees
    come first; empty items have the empty range [Lq, 0)."""
    from flash_dmattn.planning.key_lists import segment_capacity
    from flash_dmattn.utils.mask import topk_intervals

    gen = torch.Generator().manual_seed(5)
    B, L, Hkv, W, seg, bn = 2, 83, 2, 9, 32, 8
    bias = torch.randn(B, Hkv, 1, L, generator=gen)
    bias[1, 0, 0, 10:30] = 0.5  # ties
    ki = topk_intervals(bias, W, is_causal=True)
    plan = plan_intervals(ki.bounds, L, L, causal, 16, bn, True, window=W, segment_rows=seg)
    cap = segment_capacity(L, seg, bn, W)
    n_seg, n_items = -(-L // seg), cap // bn
    assert plan.segment_rows == seg and plan.blocks_per_row == n_seg * n_items
    ranges = key_ranges(ki.bounds, L, L, causal)
    for r in range(B * Hkv):
        for s in range(n_seg):
            q0, q1 = s * seg, min(L, (s + 1) * seg)
            lo, hi = ranges.lo[r].clamp(min=q0), ranges.hi[r].clamp(max=q1)
            meets = (lo < hi).nonzero().flatten().tolist()
            full = [j for j in meets if lo[j] == q0 and hi[j] == q1]
            got = []
            for c in range(n_items):
                blk = (r * n_seg + s) * n_items + c
                keys = [j for j in plan.blk_keys[blk].tolist() if j >= 0]
                if not keys:
                    assert (plan.blk_qlo[blk], plan.blk_qhi[blk]) == (L, 0)
                    continue
                assert q0 <= plan.blk_qlo[blk] and plan.blk_qhi[blk] <= q1
                assert plan.blk_qlo[blk] == min(lo[j] for j in keys)
                assert plan.blk_qhi[blk] == max(hi[j] for j in keys)
                got += keys
            assert got[:len(full)] == full
            assert sorted(got) == meets


def test_triton_declines_per_query_bias():
    from flash_dmattn.inputs import AttentionInputs
    from flash_dmattn.backends.triton.backend import _interval_reasons

    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 1, 16)
    ki = KeyIntervals(torch.zeros(8, dtype=torch.int64), torch.full((8,), 8))
    inputs = AttentionInputs.from_args(q, k, k, ki, torch.randn(1, 1, 8, 8))
    assert any("per-key bias" in r for r in _interval_reasons(inputs))


GPU_CASES = [
    (2, 1000, 1000, 8, 2, 128, (2, 2, 1000), (2, 2, 1, 1000), True),
    (1, 777, 1500, 8, 2, 64, (1, 8, 1500), (1, 8, 1, 1500), True),
    (2, 513, 300, 4, 4, 128, (1, 1, 300), None, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_intervals_gpu(case, dtype, monkeypatch):
    from flash_dmattn.backends.triton import common

    monkeypatch.setattr(common, "DEBUG_POISON", True)
    check_case(*case, device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal_selection", [False, True])
def test_topk_selection_gpu(causal_selection, monkeypatch):
    from flash_dmattn.backends.triton import common, intervals
    from flash_dmattn.utils.mask import topk_intervals

    monkeypatch.setattr(common, "DEBUG_POISON", True)
    monkeypatch.setattr(intervals, "SEGMENT_ROWS", 256)
    B, L, H, Hkv, D, W = 1, 3000, 8, 2, 128, 256
    bias = torch.randn(B, Hkv, 1, L, device="cuda")
    ki = topk_intervals(bias, W, is_causal=causal_selection)
    check_case(B, L, L, H, Hkv, D, None, (B, Hkv, 1, L), True, device="cuda",
               dtype=torch.bfloat16, intervals=ki.to("cpu"))


def test_intervals_that_hide_nothing_take_the_dense_path(monkeypatch):
    """Plain causal as intervals ([j, L)) runs the dense kernels, not the gathering ones,
    forward and backward; one hidden pair sends the call to the interval kernels."""
    from flash_dmattn.backends.triton import intervals

    if not (ON_GPU or INTERP):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    calls = []
    for name in ("interval_forward", "interval_backward"):
        real = getattr(intervals, name)
        monkeypatch.setattr(intervals, name,
                            lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    dev = "cuda" if ON_GPU else "cpu"
    dt = torch.bfloat16 if ON_GPU else torch.float32
    L = 40
    q = torch.randn(1, L, 2, 16, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, L, 1, 16, device=dev, dtype=dt, requires_grad=True)
    j = torch.arange(L, device=dev)
    for start in (j, torch.full_like(j, -5)):
        out = fd.triton_dmattn_func(q, k, k, attn_mask=KeyIntervals(start, torch.full_like(j, L)),
                                    is_causal=True)
        grads = torch.autograd.grad(out.float().sum(), (q, k))
        ref = fd.triton_dmattn_func(q, k, k, is_causal=True)
        ref_grads = torch.autograd.grad(ref.float().sum(), (q, k))
        assert not calls
        torch.testing.assert_close(out, ref)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b)
    out = fd.triton_dmattn_func(q, k, k, attn_mask=KeyIntervals(j, torch.full_like(j, L - 1)),
                                is_causal=True)
    torch.autograd.grad(out.float().sum(), (q, k))
    assert calls == ["interval_forward", "interval_backward"]


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_planner_kernels_match_reference(causal):
    """The planner's kernels give the plain-PyTorch planner's lists and equivalent blocks."""
    from flash_dmattn.planning.key_lists import plan_intervals_reference
    from flash_dmattn.planning.list_kernels import plan_fast

    if ON_GPU:
        pytest.skip("interpreter sizes")
    gen = torch.Generator().manual_seed(7)
    for Lq, Lk in ((53, 61), (70, 40), (16, 16), (5, 40)):
        start, end = _intervals(gen, (2, 3, Lk), Lk)
        bounds = KeyIntervals(start, end).bounds
        ref = plan_intervals_reference(bounds, Lq, Lk, causal, 16, 8, True, 16)
        tile_start, tile_len, tile_full, keys, blocks = plan_fast(bounds, Lq, Lk, causal, 16, 8,
                                                                  True, 16)
        assert torch.equal(tile_start, ref.tile_start)
        assert torch.equal(tile_len, ref.tile_len)
        assert torch.equal(tile_full, ref.tile_full)
        assert torch.equal(keys, ref.keys)
        for got, want in zip(blocks, (ref.blk_keys, ref.blk_qlo, ref.blk_qhi)):
            assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_planner_kernels_match_reference_segment_items(causal):
    """Under a window promise the planner's kernels build the same segment items as the
    plain-PyTorch planner, also when a list runs past its segment's room (cut there)."""
    from flash_dmattn.planning import key_lists, list_kernels
    from flash_dmattn.utils.mask import topk_intervals

    if ON_GPU:
        pytest.skip("interpreter sizes")
    gen = torch.Generator().manual_seed(3)
    for L, W, seg in ((75, 6, 16), (40, 13, 32), (33, 20, 16)):
        bias = torch.randn(2, 1, 1, L, generator=gen)
        bounds = topk_intervals(bias, W, is_causal=True).bounds
        ref_blocks = key_lists.segment_items(
            key_lists.key_ranges(bounds, L, L, causal), L, seg, 8,
            key_lists.segment_capacity(L, seg, 8, W))
        fast = key_lists.plan_intervals(bounds, L, L, causal, 16, 8, True, window=W,
                                        segment_rows=seg)
        for got, want in zip((fast.blk_keys, fast.blk_qlo, fast.blk_qhi), ref_blocks):
            assert torch.equal(got, want)
        assert fast.segment_rows == seg
        # A window covering every key promises nothing: key blocks then.
        wide = key_lists.plan_intervals(bounds, L, L, causal, 16, 8, True, window=L,
                                        segment_rows=seg)
        assert wide.hides_nothing or wide.segment_rows is None
    # A broken promise (window 2, lists longer than the room): both cut at the same place.
    start = torch.zeros(1, 1, 30, dtype=torch.int64)
    bounds = KeyIntervals(start, torch.full_like(start, 30), window=2).bounds
    cap = key_lists.segment_capacity(30, 16, 8, 2)
    ref_blocks = key_lists.segment_items(key_lists.key_ranges(bounds, 30, 30, causal), 30, 16,
                                         8, cap)
    tile = list_kernels.plan_fast(bounds, 30, 30, causal, 16, 8, True, 16, capacity=17,
                                  segment_rows=16, segment_capacity=cap)
    for got, want in zip(tile[4], ref_blocks):
        assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("causal_selection", [False, True])
def test_window_promise_lists_equal_the_waiting_planner(causal_selection):
    """A top-W selection carries its window; the planner then lays every tile's list out at
    capacity W + block_m - 1 without waiting for the device, and the lists hold the same keys
    in the same order as the planner that sizes them exactly (and so do the outputs)."""
    from flash_dmattn.planning.key_lists import plan_intervals
    from flash_dmattn.utils.mask import topk_intervals

    if ON_GPU:
        pytest.skip("interpreter sizes")
    gen = torch.Generator().manual_seed(11)
    B, L, Hkv, W, bm = 2, 90, 2, 7, 16
    bias = torch.randn(B, Hkv, 1, L, generator=gen)
    bias[0, 0, 0, 40:50] = 0.25  # ties
    ki = topk_intervals(bias, W, is_causal=causal_selection)
    assert ki.window == W and ki.to("cpu").window == W
    for causal in (False, True):
        exact = plan_intervals(ki.bounds, L, L, causal, bm, 8, True)
        fixed = plan_intervals(ki.bounds, L, L, causal, bm, 8, True, window=W)
        cap = W + bm - 1
        assert fixed.keys.numel() == B * Hkv * fixed.n_tiles * cap
        assert torch.equal(fixed.tile_start.flatten(),
                           torch.arange(B * Hkv * fixed.n_tiles, dtype=torch.int32) * cap)
        assert torch.equal(fixed.tile_len, exact.tile_len)
        assert torch.equal(fixed.tile_full, exact.tile_full)
        for r in range(B * Hkv):
            for t in range(exact.n_tiles):
                n = int(exact.tile_len[r, t])
                a, b0 = int(exact.tile_start[r, t]), int(fixed.tile_start[r, t])
                assert torch.equal(fixed.keys[b0:b0 + n], exact.keys[a:a + n])
        for got, want in ((fixed.blk_keys, exact.blk_keys), (fixed.blk_qlo, exact.blk_qlo),
                          (fixed.blk_qhi, exact.blk_qhi)):
            assert torch.equal(got, want)
    check_case(B, L, L, 4, Hkv, 16, None, (B, Hkv, 1, L), True, intervals=ki)


def test_window_promise_is_validated():
    j = torch.arange(8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            KeyIntervals(j, j + 2, window=bad)
    assert KeyIntervals(j, j + 2, window=2).window == 2
    assert KeyIntervals(j, j + 2).window is None


@needs_kernels
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_interval_problems(data):
    """Random shapes, GQA, broadcasts of the bounds and the per-key bias, causal with any
    Lq/Lk, softcap: outputs and every gradient against the dense reference."""
    if ON_GPU:
        pytest.skip("interpreter sizes")
    b = data.draw(st.integers(1, 2))
    hkv = data.draw(st.integers(1, 2))
    h = hkv * data.draw(st.sampled_from([1, 2, 3]))
    lq = data.draw(st.integers(1, 40))
    lk = data.draw(st.integers(1, 40))
    d = data.draw(st.sampled_from([8, 16, 24]))
    bounds_shape = (data.draw(st.sampled_from([1, b])), data.draw(st.sampled_from([1, hkv, h])),
                    lk)
    bias_shape = data.draw(st.sampled_from([
        None, (1, 1, 1, lk), (b, hkv, 1, lk), (b, h, 1, lk), (1, h, 1, lk)]))
    check_case(b, lq, lk, h, hkv, d, bounds_shape, bias_shape,
               causal=data.draw(st.booleans()), softcap=data.draw(st.sampled_from([0.0, 2.0])),
               seed=data.draw(st.integers(0, 1000)))
