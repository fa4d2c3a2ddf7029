"""KeyIntervals masks: validation, to_dense, and every path that runs them against the same
call with the equivalent dense bool mask (outputs and all gradients)."""
import pytest
import torch

from flash_dmattn import (
    KeyIntervals,
    flash_dmattn_func,
    flash_dmattn_varlen_func,
    flex_dmattn_func,
    registry,
)
from flash_dmattn.api import reference_dmattn_func
from flash_dmattn.inputs import AttentionInputs, VarlenInputs
from flash_dmattn.ops import AttentionOp, VarlenAttentionOp
from flash_dmattn.utils.padding import cu_seqlens_from_lengths

B, H, HKV, D = 2, 4, 2, 8


def _qkv(lq, lk, dtype=torch.float64, heads=H, kv_heads=HKV, grad=False, batch=B, d=D):
    q = torch.randn(batch, lq, heads, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, lk, kv_heads, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, lk, kv_heads, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def _random_intervals(shape, lk, width=6):
    """Bounds around 0..lk (some before, some after, some empty or reversed)."""
    start = torch.randint(-3, lk + 3, shape)
    end = start + torch.randint(-2, width, shape)
    return start, end


def _bias(lq, lk, dtype=torch.float64, grad=True, neg_inf=True):
    bias = torch.randn(B, H, lq, lk, dtype=dtype)
    if neg_inf:
        bias[torch.rand_like(bias) < 0.1] = float("-inf")
    return bias.requires_grad_(grad)


def _grads(out, leaves, gout):
    return torch.autograd.grad(out, leaves, gout, allow_unused=True)


def _assert_same(got, want, tol=1e-10):
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------
# The type
# ---------------------------------------------------------------------------------------
def test_rejects_non_tensors_and_non_integers():
    end = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(TypeError, match="start"):
        KeyIntervals([0, 1, 2, 3, 4], end)
    with pytest.raises(TypeError, match="end"):
        KeyIntervals(end, end.float())
    with pytest.raises(TypeError, match="end"):
        KeyIntervals(end, end.bool())


def test_rejects_bad_ranks_shapes_and_devices():
    t = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="start"):
        KeyIntervals(torch.tensor(3), t)
    with pytest.raises(ValueError, match="end"):
        KeyIntervals(t, torch.zeros(1, 1, 1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="broadcast"):
        KeyIntervals(t, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="start.*end"):
        KeyIntervals(t, torch.zeros(5, dtype=torch.int64, device="meta"))


def test_normalises_bounds():
    start = torch.arange(6, dtype=torch.int32)
    end = torch.full((3, 1), 1 << 40, dtype=torch.int64)  # huge: clamped, still "after all"
    ki = KeyIntervals(start, end)
    assert ki.bounds.dtype == torch.int32 and ki.bounds.shape == (2, 1, 3, 6)
    assert ki.shape == (1, 3, 6)
    assert torch.equal(ki.start[0, 2], start)
    assert (ki.end > 1 << 29).all()
    low = KeyIntervals(torch.full((6,), -(1 << 40)), start)
    assert torch.equal(low.to_dense(6), KeyIntervals(torch.zeros(6, dtype=torch.int64), start).to_dense(6))
    assert KeyIntervals.from_bounds(ki.bounds).bounds is ki.bounds


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8])
def test_widens_narrow_integer_dtypes(dtype):
    start = torch.arange(6, dtype=dtype)
    ki = KeyIntervals(start, start + 2)
    assert ki.bounds.dtype == torch.int32
    assert torch.equal(ki.start[0, 0], start.int())


@pytest.mark.parametrize("lq,lk", [(7, 11), (11, 7), (9, 9), (1, 5)])
def test_to_dense_matches_definition(lq, lk):
    torch.manual_seed(0)
    start, end = _random_intervals((2, 3, lk), lk)
    dense = KeyIntervals(start, end).to_dense(lq)
    assert dense.shape == (2, 3, lq, lk) and dense.dtype == torch.bool
    for i in range(lq):
        p = i + lk - lq
        assert torch.equal(dense[:, :, i], (start <= p) & (p < end))
    with pytest.raises(ValueError, match="seqlen_k"):
        KeyIntervals(start, end).to_dense(lq, lk + 1)


def test_call_validation_names_attn_mask():
    q, k, v = _qkv(5, 7)
    ok = torch.zeros(7, dtype=torch.int32)
    for start in (torch.zeros(6, dtype=torch.int32),      # wrong Lk
                  torch.zeros(3, 1, 7, dtype=torch.int32),  # wrong batch
                  torch.zeros(3, 7, dtype=torch.int32)):    # heads neither 1, Hkv nor H
        with pytest.raises(ValueError, match="attn_mask"):
            flash_dmattn_func(q, k, v, attn_mask=KeyIntervals(start, start))
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    with pytest.raises(ValueError, match="attn_mask"):
        AttentionInputs.from_args(qm, km, vm, attn_mask=KeyIntervals(ok, ok))
    with pytest.raises(TypeError, match="KeyIntervals"):
        flash_dmattn_func(q, k, v, attn_mask=[ok, ok])


def test_varlen_validation_names_attn_mask():
    q = torch.randn(5, H, D)
    k = torch.randn(9, HKV, D)
    cu_q, cu_k = cu_seqlens_from_lengths([2, 3]), cu_seqlens_from_lengths([4, 5])
    ok = torch.zeros(9, dtype=torch.int32)
    inputs = VarlenInputs.from_args(q, k, k, cu_q, cu_k, 3, 5, attn_mask=KeyIntervals(ok, ok))
    assert inputs.attn_mask is None and inputs.key_intervals.shape == (2, 1, 9)
    assert inputs.key_intervals.dtype == torch.int32
    for start in (torch.zeros(8, dtype=torch.int32),       # wrong total_k
                  torch.zeros(2, 1, 9, dtype=torch.int32),  # a batch dim
                  torch.zeros(3, 9, dtype=torch.int32)):    # heads neither 1, Hkv nor H
        with pytest.raises(ValueError, match="attn_mask"):
            flash_dmattn_varlen_func(q, k, k, cu_q, cu_k, 3, 5,
                                     attn_mask=KeyIntervals(start, start))
    with pytest.raises(ValueError, match="attn_mask"):
        VarlenInputs.from_args(q.to("meta"), k.to("meta"), k.to("meta"), cu_q.to("meta"),
                               cu_k.to("meta"), 3, 5, attn_mask=KeyIntervals(ok, ok))
    with pytest.raises(TypeError, match="KeyIntervals"):
        flash_dmattn_varlen_func(q, k, k, cu_q, cu_k, 3, 5, attn_mask=(ok, ok))


# ---------------------------------------------------------------------------------------
# AttentionOp carries the bounds to implementations that take them
# ---------------------------------------------------------------------------------------
def test_attention_op_passes_key_intervals_only_when_given():
    seen = []

    def forward(q, k, v, mask, bias, scale, is_causal, softcap, **extra):
        seen.append(("fwd", sorted(extra)))
        return q * 1.0, q.new_zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, det, needs,
                 **extra):
        seen.append(("bwd", sorted(extra)))
        if "key_intervals" in extra:
            assert extra["key_intervals"].dtype == torch.int32
        return dout.clone(), None, None, None

    op = AttentionOp("test_key_intervals_passing", forward, backward)
    q = torch.randn(1, 3, 2, 4, requires_grad=True)
    kv = torch.randn(1, 3, 2, 4)
    bounds = torch.zeros(2, 1, 1, 3, dtype=torch.int32)
    with torch.no_grad():  # the eager shortcut
        op(q, kv, kv, None, None, 1.0, False, 0.0, key_intervals=bounds)
    out, _ = op(q, kv, kv, None, None, 1.0, False, 0.0, key_intervals=bounds)  # the custom op
    out.sum().backward()
    out, _ = op(q, kv, kv, None, None, 1.0, False, 0.0)
    out.sum().backward()
    assert seen == [("fwd", ["key_intervals"]), ("fwd", ["key_intervals"]),
                    ("bwd", ["key_intervals"]), ("fwd", []), ("bwd", [])]


def test_varlen_op_refuses_key_intervals():
    q = torch.randn(4, H, D)
    k = torch.randn(4, HKV, D)
    cu = cu_seqlens_from_lengths([4])
    start = torch.zeros(4, dtype=torch.int32)
    inputs = VarlenInputs.from_args(q, k, k, cu, cu, 4, 4, attn_mask=KeyIntervals(start, start))
    op = VarlenAttentionOp("test_key_intervals_varlen_refusal", None, None)
    with pytest.raises(RuntimeError, match="KeyIntervals"):
        op.attention(inputs)


# ---------------------------------------------------------------------------------------
# torch-reference: outputs and gradients equal the dense-mask call
# ---------------------------------------------------------------------------------------
# Every broadcast shape of the bounds ((start shape, end shape); they broadcast together).
BOUND_SHAPES = [
    ((None,), (None,)),
    ((1, None), (1, None)),
    ((HKV, None), (HKV, None)),
    ((H, None), (H, None)),
    ((B, 1, None), (B, 1, None)),
    ((B, HKV, None), (B, HKV, None)),
    ((B, H, None), (B, H, None)),
    ((1, 1, None), (B, H, None)),
    ((None,), (B, HKV, None)),
]
LENGTHS = [(7, 11), (13, 5), (9, 9), (1, 6)]


def _shape(spec, lk):
    return tuple(lk if n is None else n for n in spec)


def _intervals(shapes, lk, width=6):
    start = torch.randint(-3, lk + 3, _shape(shapes[0], lk))
    end = start + torch.randint(-2, width, _shape(shapes[1], lk))
    return KeyIntervals(start, end)


@pytest.mark.parametrize("shapes", BOUND_SHAPES, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_dense(shapes, lq, lk, causal):
    torch.manual_seed(lq * 31 + lk)
    q, k, v = _qkv(lq, lk, grad=True)
    bias = _bias(lq, lk)
    ki = _intervals(shapes, lk)
    leaves = (q, k, v, bias)
    out = reference_dmattn_func(q, k, v, ki, bias, is_causal=causal)
    gout = torch.randn_like(out)
    got = (out,) + _grads(out, leaves, gout)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), bias, is_causal=causal)
    want = (ref,) + _grads(ref, leaves, gout)
    _assert_same(got, want)


@pytest.mark.parametrize("kv_heads", [1, HKV, H])
def test_reference_gqa_and_probs(kv_heads):
    torch.manual_seed(kv_heads)
    lq, lk = 10, 15
    q, k, v = _qkv(lq, lk, kv_heads=kv_heads)
    ki = _intervals(((B, kv_heads, None), (B, kv_heads, None)), lk)
    bias = _bias(lq, lk, grad=False)
    got = reference_dmattn_func(q, k, v, ki, bias, is_causal=True, return_attn_probs=True)
    want = reference_dmattn_func(q, k, v, ki.to_dense(lq), bias, is_causal=True,
                                 return_attn_probs=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_reference_chunks(monkeypatch):
    # Several query chunks per call: the intervals are evaluated chunk by chunk.
    from flash_dmattn.reference import attention as ref_mod

    monkeypatch.setattr(ref_mod, "CHUNK_ELEMENTS", 3 * B * H * 17)
    test_reference_matches_dense(BOUND_SHAPES[5], 20, 17, True)
    test_reference_matches_dense(BOUND_SHAPES[0], 17, 20, False)


def test_reference_empty_intervals_and_masked_rows():
    torch.manual_seed(0)
    lq, lk = 6, 9
    q, k, v = _qkv(lq, lk, grad=True)
    bias = _bias(lq, lk, neg_inf=False)
    leaves = (q, k, v, bias)
    # Every interval empty: every row fully masked -> 0, lse -inf, zero gradients.
    empty = KeyIntervals(torch.full((lk,), 5), torch.full((lk,), 5))
    out = reference_dmattn_func(q, k, v, empty, bias)
    assert torch.equal(out, torch.zeros_like(out))
    grads = _grads(out, leaves, torch.randn_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # Keys seen only by positions >= lk - 2: the first rows see nothing (causal too).
    late = KeyIntervals(torch.full((lk,), lk - 2), torch.full((lk,), lk))
    for causal in (False, True):
        out, lse, _ = reference_dmattn_func(q, k, v, late, bias, is_causal=causal,
                                            return_attn_probs=True)
        assert not out.isnan().any()
        assert torch.equal(out[:, : lq - 2], torch.zeros_like(out[:, : lq - 2]))
        assert (lse[:, :, : lq - 2] == float("-inf")).all()
        assert torch.isfinite(lse[:, :, lq - 2:]).all()
        ref = reference_dmattn_func(q, k, v, late.to_dense(lq), bias, is_causal=causal)
        gout = torch.randn_like(out)
        out = reference_dmattn_func(q, k, v, late, bias, is_causal=causal)
        _assert_same((out,) + _grads(out, leaves, gout), (ref,) + _grads(ref, leaves, gout))


def _dense_cache_mask(ki, lq, lk, cache_seqlens):
    """The dense mask of key intervals in a KV-cache call: batch b's queries sit at
    positions i + n_b - Lq (the causal diagonal)."""
    rows = []
    for b, n in enumerate(cache_seqlens.tolist()):
        pos = torch.arange(lq) + n - lq
        bounds = ki.bounds[:, min(b, ki.shape[0] - 1)]
        rows.append(ki.from_bounds(bounds.unsqueeze(1)).visible(pos)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_with_cache_seqlens(causal):
    torch.manual_seed(3)
    lq, lk = 3, 12
    q, k, v = _qkv(lq, lk, grad=True)
    cache = torch.tensor([7, 12], dtype=torch.int32)
    ki = _intervals(((None,), (B, HKV, None)), lk, width=10)
    out = reference_dmattn_func(q, k, v, ki, is_causal=causal, cache_seqlens=cache)
    dense = _dense_cache_mask(ki, lq, lk, cache)
    ref = reference_dmattn_func(q, k, v, dense, is_causal=causal, cache_seqlens=cache)
    gout = torch.randn_like(out)
    _assert_same((out,) + _grads(out, (q, k, v), gout), (ref,) + _grads(ref, (q, k, v), gout))


def test_reference_paged_kv():
    torch.manual_seed(4)
    lq, page, pages = 2, 16, 3
    q = torch.randn(B, lq, H, D, dtype=torch.float64)
    pool_k = torch.randn(8, page, HKV, D, dtype=torch.float64)
    pool_v = torch.randn(8, page, HKV, D, dtype=torch.float64)
    table = torch.tensor([[5, 1, 7], [0, 2, 3]], dtype=torch.int32)
    lk = pages * page
    ki = _intervals(((B, 1, None), (B, 1, None)), lk, width=40)
    out = reference_dmattn_func(q, pool_k, pool_v, ki, block_table=table, is_causal=True)
    ref = reference_dmattn_func(q, pool_k, pool_v, ki.to_dense(lq), block_table=table,
                                is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------
# flex (forward on CPU: FlexAttention has no CPU backward)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes", BOUND_SHAPES, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_flex_matches_dense(shapes, lq, lk, causal):
    # float64 inputs on both sides: 1e-10 leaves room only for summation-order rounding.
    torch.manual_seed(lq * 17 + lk)
    q, k, v = _qkv(lq, lk, d=16)
    bias = _bias(lq, lk, grad=False)
    ki = _intervals(shapes, lk)
    out = flex_dmattn_func(q, k, v, ki, bias, is_causal=causal)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), bias, is_causal=causal)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("lq,lk", [(200, 333), (333, 150), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_multi_tile(lq, lk, causal):
    # Over 128 positions: dead, full and partial flex tiles in one call; wide intervals (plus
    # every-query sinks and empty keys) make some tiles full.
    torch.manual_seed(lq + lk)
    q, k, v = _qkv(lq, lk, dtype=torch.float32, d=16)
    start = torch.randint(-50, lk, (B, HKV, lk))
    end = start + torch.randint(0, 300, (B, HKV, lk))
    start[..., :4], end[..., :4] = 0, lk  # sinks
    start[..., 60:70], end[..., 60:70] = 0, 0  # never seen
    ki = KeyIntervals(start, end)
    out = flex_dmattn_func(q, k, v, ki, is_causal=causal)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), is_causal=causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_flex_interval_tiles_match_dense_definition(monkeypatch):
    from flash_dmattn.backends import flex as flex_mod

    monkeypatch.setattr(flex_mod, "_INTERVAL_CHUNK_ELEMENTS", 1000)  # several chunks
    blk = flex_mod.BLOCK
    torch.manual_seed(0)
    for lq, lk in [(300, 300), (200, 333), (333, 150), (5, 7)]:
        start = torch.randint(-3, lk + 3, (2, 3, lk))
        end = start + torch.randint(-2, 300, (2, 3, lk))
        ki = KeyIntervals(start, end)
        live, full = flex_mod._interval_tiles(ki.bounds, lq, lk)
        nq, nk = -(-lq // blk), -(-lk // blk)
        pad = torch.zeros(2, 3, nq * blk, nk * blk, dtype=torch.bool)
        pad[..., :lq, :lk] = ki.to_dense(lq)
        inside = torch.zeros_like(pad)
        inside[..., :lq, :lk] = True
        tiles = lambda t: t.unflatten(2, (nq, blk)).unflatten(4, (nk, blk))  # noqa: E731
        assert torch.equal(live, tiles(pad).any(5).any(3))
        assert torch.equal(full, tiles(pad | ~inside).all(5).all(3))


def test_flex_empty_intervals_and_masked_rows():
    torch.manual_seed(1)
    lq, lk = 6, 9
    q, k, v = _qkv(lq, lk, d=16)
    empty = KeyIntervals(torch.full((lk,), 3), torch.full((lk,), 2))
    out = flex_dmattn_func(q, k, v, empty)
    assert torch.equal(out, torch.zeros_like(out))
    late = KeyIntervals(torch.full((lk,), lk - 2), torch.full((lk,), lk))
    out = flex_dmattn_func(q, k, v, late, is_causal=True)
    ref = reference_dmattn_func(q, k, v, late.to_dense(lq), is_causal=True)
    assert not out.isnan().any()
    assert torch.equal(out[:, : lq - 2], torch.zeros_like(out[:, : lq - 2]))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_with_cache_seqlens(causal):
    torch.manual_seed(5)
    lq, lk = 3, 140
    q, k, v = _qkv(lq, lk, d=16)
    cache = torch.tensor([70, 140], dtype=torch.int32)
    ki = _intervals(((B, HKV, None), (B, HKV, None)), lk, width=100)
    out = flex_dmattn_func(q, k, v, ki, is_causal=causal, cache_seqlens=cache)
    ref = reference_dmattn_func(q, k, v, ki, is_causal=causal, cache_seqlens=cache)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------
# varlen: per-sequence positions, against per-sequence dense calls
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [None, HKV, H])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence_dense(heads, causal):
    torch.manual_seed(7)
    lens_q, lens_k = [3, 9, 0, 6, 1], [7, 4, 5, 6, 8]  # lq < lk, lq > lk, empty, equal
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q), cu_seqlens_from_lengths(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, HKV, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, HKV, D, dtype=torch.float64, requires_grad=True)
    shape = (tk,) if heads is None else (heads, tk)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    start = torch.randint(-2, 9, shape)
    end = start + torch.randint(-1, 7, shape)
    out = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                   attn_mask=KeyIntervals(start, end), attn_bias=bias,
                                   is_causal=causal)
    gout = torch.randn_like(out)
    leaves = (q, k, v, bias)
    got = (out,) + _grads(out, leaves, gout)
    parts = []
    for i, lq in enumerate(lens_q):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lq == 0:
            continue
        dense = KeyIntervals(start[..., ks], end[..., ks]).to_dense(lq)
        b = bias.view(-1, tk)[:, ks][None, :, None]
        parts.append(flash_dmattn_func(q[None, qs], k[None, ks], v[None, ks], dense, b,
                                       is_causal=causal)[0])
    ref = torch.cat(parts)
    want = (ref,) + _grads(ref, leaves, gout)
    _assert_same(got, want)


def test_varlen_probs():
    torch.manual_seed(8)
    lens_q, lens_k = [2, 5], [6, 3]
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q), cu_seqlens_from_lengths(lens_k)
    q = torch.randn(7, H, D, dtype=torch.float64)
    k = torch.randn(9, HKV, D, dtype=torch.float64)
    start = torch.randint(-1, 6, (H, 9))
    ki = KeyIntervals(start, start + 3)
    out, lse, probs = flash_dmattn_varlen_func(q, k, k, cu_q, cu_k, 5, 6, attn_mask=ki,
                                               return_attn_probs=True)
    for i in range(2):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        dense = KeyIntervals(start[:, ks], start[:, ks] + 3).to_dense(lens_q[i])
        o, l, p = flash_dmattn_func(q[None, qs], k[None, ks], k[None, ks], dense,
                                    return_attn_probs=True)
        torch.testing.assert_close(out[qs], o[0])
        torch.testing.assert_close(lse[:, qs], l[0])
        torch.testing.assert_close(probs[i, :, : lens_q[i], : lens_k[i]], p[0])


# ---------------------------------------------------------------------------------------
# Dispatch and compile: never silently ignored
# ---------------------------------------------------------------------------------------
def test_auto_dispatch_runs_key_intervals():
    torch.manual_seed(9)
    lq, lk = 9, 14
    q, k, v = _qkv(lq, lk, dtype=torch.float32)
    ki = _intervals(BOUND_SHAPES[5], lk)
    inputs = AttentionInputs.from_args(q, k, v, attn_mask=ki, is_causal=True)
    backend = registry.select_backend(inputs)
    assert not backend.not_supported_reasons(inputs)
    out = flash_dmattn_func(q, k, v, attn_mask=ki, is_causal=True)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _registered(name):
    return next(b for b in registry.registered_backends() if b.name == name)


def _backend_and_device(name):
    """The registered backend and the device its kernels run on here. A backend this machine
    cannot run (cuda on a CPU-only machine, triton without a GPU or its interpreter) skips:
    the same case runs where the backend is available."""
    backend = _registered(name)
    if not backend.available:
        pytest.skip(f"{name} unavailable: {backend.unavailable_reason()}")
    device = "cuda" if name == "cuda" or (name == "triton" and torch.cuda.is_available()) else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return backend, device


def _backend_params():
    return [pytest.param(b.name, id=b.name) for b in registry.registered_backends()]


@pytest.mark.parametrize("name", _backend_params())
@pytest.mark.parametrize("lq,lk,causal", [(9, 14, True), (14, 9, True), (12, 12, False)])
def test_every_backend_declines_or_matches(name, lq, lk, causal):
    """A backend that accepts KeyIntervals must honour them (compare with the dense mask).
    Triton cases run on CPU under TRITON_INTERPRET=1 only (conftest sets it on CPU-only
    machines) and on CUDA otherwise."""
    backend, device = _backend_and_device(name)
    torch.manual_seed(lq + lk)
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (t.to(device) for t in _qkv(lq, lk, dtype=dtype, d=16))
    bias = torch.randn(B, HKV, 1, lk, dtype=dtype, device=device)
    ki = _intervals(BOUND_SHAPES[5], lk, width=8).to(device)
    inputs = AttentionInputs.from_args(q, k, v, attn_mask=ki, attn_bias=bias, is_causal=causal)
    if backend.not_supported_reasons(inputs):
        return  # declines: fine
    out = backend.attention(inputs)
    ref = reference_dmattn_func(q.double(), k.double(), v.double(), ki.to_dense(lq),
                                bias.double(), is_causal=causal)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", _backend_params())
def test_every_backend_varlen_declines_or_matches(name):
    backend, device = _backend_and_device(name)
    torch.manual_seed(10)
    dtype = torch.float32 if device == "cpu" else torch.float16
    lens_q, lens_k = [3, 8], [7, 5]
    cu_q = cu_seqlens_from_lengths(lens_q).to(device)
    cu_k = cu_seqlens_from_lengths(lens_k).to(device)
    q = torch.randn(11, H, 16, dtype=dtype, device=device)
    k = torch.randn(12, HKV, 16, dtype=dtype, device=device)
    start = torch.randint(-1, 8, (HKV, 12))
    ki = KeyIntervals(start, start + 4).to(device)
    inputs = VarlenInputs.from_args(q, k, k, cu_q, cu_k, 8, 7, attn_mask=ki, is_causal=True)
    if backend.varlen_not_supported_reasons(inputs):
        return
    out = backend.varlen_attention(inputs)
    for i in range(2):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        dense = KeyIntervals(start[:, ks], start[:, ks] + 4).to_dense(lens_q[i]).to(device)
        ref = reference_dmattn_func(q[None, qs].double(), k[None, ks].double(),
                                    k[None, ks].double(), dense, is_causal=True)[0]
        torch.testing.assert_close(out[qs].double(), ref, atol=2e-3, rtol=2e-3)


def test_compiled_call_with_key_intervals():
    torch.manual_seed(11)
    lq, lk = 10, 13
    q, k, v = _qkv(lq, lk, dtype=torch.float32, grad=True)
    bias = torch.randn(B, HKV, 1, lk, requires_grad=True)
    ki = _intervals(BOUND_SHAPES[5], lk, width=8)
    compiled = torch.compile(flash_dmattn_func, backend="aot_eager")
    out = compiled(q, k, v, attn_mask=ki, attn_bias=bias, is_causal=True)
    gout = torch.randn_like(out)
    leaves = (q, k, v, bias)
    got = (out,) + _grads(out, leaves, gout)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), bias, is_causal=True)
    want = (ref,) + _grads(ref, leaves, gout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # New bounds of the same shape reuse the graph and are honoured (not baked in).
    ki2 = _intervals(BOUND_SHAPES[5], lk, width=8)
    out2 = compiled(q, k, v, attn_mask=ki2, attn_bias=bias, is_causal=True)
    ref2 = reference_dmattn_func(q, k, v, ki2.to_dense(lq), bias, is_causal=True)
    torch.testing.assert_close(out2, ref2, atol=1e-5, rtol=1e-5)


def test_inductor_compiled_call_with_key_intervals():
    torch.manual_seed(12)
    lq, lk = 8, 8
    q, k, v = _qkv(lq, lk, dtype=torch.float32)
    ki = _intervals(BOUND_SHAPES[0], lk, width=8)
    out = torch.compile(flash_dmattn_func)(q, k, v, attn_mask=ki, is_causal=True)
    ref = reference_dmattn_func(q, k, v, ki.to_dense(lq), is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# GPU: flex compiled, forward and backward
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [BOUND_SHAPES[0], BOUND_SHAPES[2], BOUND_SHAPES[6]],
                         ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("lq,lk", [(200, 333), (333, 200), (256, 256)])
def test_flex_cuda_forward_backward(shapes, lq, lk):
    torch.manual_seed(lq + 2 * lk)
    dtype = torch.bfloat16
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(lq, lk, dtype=dtype, grad=False, d=64))
    bias = torch.randn(B, HKV, 1, lk, device="cuda", dtype=dtype, requires_grad=True)
    ki = _intervals(shapes, lk, width=200).to("cuda")
    leaves = (q, k, v, bias)
    out = flex_dmattn_func(q, k, v, ki, bias, is_causal=True)
    gout = torch.randn_like(out)
    got = (out,) + _grads(out, leaves, gout)
    dq, dk, dv, db = (t.detach().double().requires_grad_() for t in leaves)
    ref = reference_dmattn_func(dq, dk, dv, ki.to_dense(lq), db, is_causal=True)
    want = (ref,) + _grads(ref, (dq, dk, dv, db), gout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert not a.isnan().any(), name
        err = (a.double() - b).abs().max().item()
        assert err <= 0.05 * max(1.0, b.abs().max().item()), (name, err)


def test_cuda_interval_reasons_name_what_it_does_not_run():
    """The cuda backend's key-interval kernels decline, each with its reason: bounds per query
    head within a kv group, a per-query bias, head dims over 128, KV caches, deterministic."""
    from flash_dmattn.backends.cuda.intervals import interval_reasons
    from flash_dmattn.inputs import AttentionInputs

    q = torch.randn(1, 16, 4, 64)
    k = torch.randn(1, 16, 2, 64)
    j = torch.arange(16)
    ki = KeyIntervals(j, j + 4)
    assert interval_reasons(AttentionInputs.from_args(q, k, k, ki, torch.randn(1, 2, 1, 16))) == []
    cases = [
        (AttentionInputs.from_args(q, k, k, KeyIntervals(j.expand(4, 16), (j + 4).expand(4, 16))),
         "per query head"),
        (AttentionInputs.from_args(q, k, k, ki, torch.randn(16, 16)), "per-key bias"),
        (AttentionInputs.from_args(q.requires_grad_(), k, k, ki, deterministic=True),
         "deterministic"),
        (AttentionInputs.from_args(torch.randn(1, 16, 4, 192), torch.randn(1, 16, 2, 192),
                                   torch.randn(1, 16, 2, 192), ki), "head_dim"),
        (AttentionInputs.from_args(q, k, k, ki, cache_seqlens=torch.tensor([9], dtype=torch.int32)),
         "KV cache"),
    ]
    for inputs, words in cases:
        assert any(words in r for r in interval_reasons(inputs)), (words, interval_reasons(inputs))
    # The forward is deterministic: a call with no gradient to compute runs.
    q.requires_grad_(False)
    assert interval_reasons(AttentionInputs.from_args(q, k, k, ki, deterministic=True)) == []
    with torch.no_grad():
        assert interval_reasons(AttentionInputs.from_args(q.requires_grad_(), k, k, ki,
                                                          deterministic=True)) == []
