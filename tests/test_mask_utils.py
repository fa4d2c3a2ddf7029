"""Tests for flash_dmattn.utils.mask.create_mask and flash_dmattn.utils.dynamic."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_dmattn.masks import KeyIntervals
from flash_dmattn.testing import dropout_mask, dropout_rng
from flash_dmattn.utils import mask as mask_mod
from flash_dmattn.utils.dynamic import (
    _dynamic_mask_and_bias,
    apply_dynamic_mask_attention,
    dynamic_mask_bias,
)
from flash_dmattn.utils.mask import create_mask

F32_MIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------
# Independent slow reference: plain Python, one row at a time.
# --------------------------------------------------------------------------------------
def _ref_row(bias_row, allowed_row, window, min_dtype, block_size, kind):
    n = len(bias_row)
    valid = [allowed_row[j] and not math.isnan(bias_row[j]) and bias_row[j] > min_dtype for j in range(n)]
    if kind == "relu":
        keep = [valid[j] and bias_row[j] > 0 for j in range(n)]
    elif n > window:
        cands = sorted((j for j in range(n) if valid[j]), key=lambda j: (-bias_row[j], j))
        chosen = set(cands[:window])
        keep = [j in chosen for j in range(n)]
    else:
        keep = list(valid)
    if block_size is not None and block_size > 1:
        out = []
        for start in range(0, n, block_size):
            blk = keep[start:start + block_size]
            out.extend([2 * sum(blk) > len(blk)] * len(blk))
        # smoothing never turns on a key that was not a candidate
        keep = [o and (allowed_row[j] and bias_row[j] > min_dtype) for j, o in enumerate(out)]
    return keep


def _ref_mask4d(attention_mask, query_len, key_len):
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        b, length = attention_mask.shape
        if length == key_len:
            return attention_mask.view(b, 1, 1, key_len)
        pad = torch.ones(b, key_len - length, dtype=torch.bool)
        return torch.cat([pad, attention_mask], -1).view(b, 1, 1, key_len)
    return attention_mask


def ref_create_mask(bias, attention_mask, query_len, key_len, window, min_dtype, block_size=None, kind="topk"):
    m4 = _ref_mask4d(attention_mask, query_len, key_len)
    shape = bias.shape if m4 is None else torch.broadcast_shapes(bias.shape, m4.shape)
    b = bias.double().expand(shape)
    m = torch.ones(shape, dtype=torch.bool) if m4 is None else m4.expand(shape)
    out = torch.zeros(shape, dtype=torch.bool)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in shape[:-1]]).reshape(-1, 3).tolist():
        i, h, q = idx
        row = _ref_row(b[i, h, q].tolist(), m[i, h, q].tolist(), window, min_dtype, block_size, kind)
        out[i, h, q] = torch.tensor(row, dtype=torch.bool)
    return out


# --------------------------------------------------------------------------------------
# create_mask: handmade cases
# --------------------------------------------------------------------------------------
def _row(values):
    return torch.tensor(values, dtype=torch.float32).view(1, 1, 1, -1)


def test_topk_ties_go_to_lower_index():
    bias = _row([1.0] * 10)
    out = create_mask(bias, None, 1, 1, 10, 3, F32_MIN)
    assert out.flatten().tolist() == [True] * 3 + [False] * 7

    bias = _row([0.0, 5.0, 2.0, 2.0, 5.0, 2.0, 2.0, 1.0])
    out = create_mask(bias, None, 1, 1, 8, 4, F32_MIN)
    # Both 5s, then the two lowest-index 2s.
    assert out.flatten().tolist() == [False, True, True, True, True, False, False, False]


def test_topk_ties_many_rows_large():
    # Many equal values across a long row: torch.topk's tie order is unspecified here.
    torch.manual_seed(0)
    bias = torch.randint(0, 3, (2, 3, 5, 300)).float()
    out = create_mask(bias, None, 2, 5, 300, 17, F32_MIN)
    assert torch.equal(out, ref_create_mask(bias, None, 5, 300, 17, F32_MIN))


def test_keep_count_equals_window():
    torch.manual_seed(1)
    bias = torch.randn(2, 3, 4, 50)
    out = create_mask(bias, None, 2, 4, 50, 7, F32_MIN)
    assert out.shape == (2, 3, 4, 50)
    assert (out.sum(-1) == 7).all()


def test_masked_values_never_kept_even_if_few_candidates():
    bias = _row([F32_MIN, 1.0, NEG_INF, F32_MIN, 2.0, NEG_INF])
    out = create_mask(bias, None, 1, 1, 6, 4, F32_MIN)
    assert out.flatten().tolist() == [False, True, False, False, True, False]
    # key_len <= window path.
    out = create_mask(bias, None, 1, 1, 6, 10, F32_MIN)
    assert out.flatten().tolist() == [False, True, False, False, True, False]
    # A row with no candidates at all.
    out = create_mask(_row([NEG_INF] * 5), None, 1, 1, 5, 2, F32_MIN)
    assert not out.any()


def test_key_len_not_above_window_keeps_all_allowed():
    bias = _row([-5.0, 0.0, 3.0, F32_MIN])
    allowed = torch.tensor([[True, True, False, True]])
    out = create_mask(bias, allowed, 1, 1, 4, 4, F32_MIN)
    assert out.flatten().tolist() == [True, True, False, False]


def test_padding_mask_key_len_restricts_candidates():
    bias = torch.tensor([[9.0, 8.0, 1.0, 2.0, 3.0], [9.0, 8.0, 1.0, 2.0, 3.0]]).view(2, 1, 1, 5)
    pad = torch.tensor([[False, False, True, True, True], [True, True, True, True, False]])
    out = create_mask(bias, pad, 2, 5, 5, 2, F32_MIN)
    assert out.shape == (2, 1, 1, 5)
    assert out[0].flatten().tolist() == [False, False, False, True, True]
    assert out[1].flatten().tolist() == [True, True, False, False, False]


def test_padding_mask_query_len_is_left_padded_with_cache_keys():
    # key_len 6 = 3 cache keys + 3 new keys; the (B, query_len) mask covers the new keys.
    bias = torch.tensor([5.0, 4.0, 0.0, 9.0, 8.0, 7.0]).view(1, 1, 1, 6)
    pad = torch.tensor([[False, True, True]])
    out = create_mask(bias, pad, 1, 3, 6, 3, F32_MIN)
    assert out.shape == (1, 1, 1, 6)
    assert out.flatten().tolist() == [True, False, False, False, True, True]
    assert torch.equal(out, ref_create_mask(bias, pad, 3, 6, 3, F32_MIN))


def test_4d_mask_restricts_candidates():
    bias = torch.arange(6, dtype=torch.float32).view(1, 1, 1, 6)  # prefers high indices
    causal = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2).view(1, 1, 4, 6)
    out = create_mask(bias, causal, 1, 4, 6, 2, F32_MIN)
    assert out.shape == (1, 1, 4, 6)
    expected = torch.tensor([
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(out[0, 0], expected)


def test_per_key_bias_gives_per_key_result():
    bias = torch.randn(2, 3, 1, 20)
    assert create_mask(bias, None, 2, 7, 20, 5, F32_MIN).shape == (2, 3, 1, 20)
    pad = torch.ones(2, 20, dtype=torch.bool)
    assert create_mask(bias, pad, 2, 7, 20, 5, F32_MIN).shape == (2, 3, 1, 20)
    pad_q = torch.ones(2, 7, dtype=torch.bool)
    assert create_mask(bias, pad_q, 2, 7, 20, 5, F32_MIN).shape == (2, 3, 1, 20)
    # A huge query_len costs nothing for a per-key bias: no (Lq, Lk) tensor is built.
    assert create_mask(bias, None, 2, 10**9, 20, 5, F32_MIN).shape == (2, 3, 1, 20)
    # Broadcast with a per-head-less 4-D mask keeps the smaller shape.
    assert create_mask(bias[:1, :1], torch.ones(1, 1, 1, 20, dtype=torch.bool), 2, 7, 20, 5, F32_MIN).shape == (
        1, 1, 1, 20
    )


def test_relu():
    bias = _row([-1.0, 0.0, 0.5, 3.0, F32_MIN, NEG_INF, 2.0])
    allowed = torch.tensor([[True, True, True, True, True, True, False]])
    out = create_mask(bias, allowed, 1, 1, 7, 1, F32_MIN, type="relu")
    assert out.flatten().tolist() == [False, False, True, True, False, False, False]


def test_block_smoothing_exact():
    # relu keeps exactly the positive entries, so the pre-smoothing mask is handmade.
    pre = [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 0]
    bias = _row([1.0 if p else -1.0 for p in pre])
    out = create_mask(bias, None, 1, 1, 14, 1, F32_MIN, block_size=4, type="relu")
    # blocks: [1,1,0,0]: 2/4 exactly half -> dropped; [1,1,1,0]: 3/4 -> kept;
    # [0,0,1,0]: 1/4 -> dropped; ragged tail [1,0] (len 2): 1/2 exactly half -> dropped.
    assert out.flatten().tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [False] * 2

    pre = [0, 1, 1, 0, 0, 1, 1]
    bias = _row([1.0 if p else -1.0 for p in pre])
    out = create_mask(bias, None, 1, 1, 7, 1, F32_MIN, block_size=3, type="relu")
    # [0,1,1]: 2/3 -> kept; [0,0,1]: 1/3 -> dropped; ragged tail [1] (len 1): 1/1 -> kept.
    assert out.flatten().tolist() == [True, True, True, False, False, False, True]


def test_block_smoothing_after_topk():
    bias = _row([9.0, 8.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0])
    out = create_mask(bias, None, 1, 1, 8, 3, F32_MIN, block_size=2)
    # topk(3) -> {0, 1, 4}; blocks [1,1] kept, [0,0] dropped, [1,0] half -> dropped, [0,0].
    assert out.flatten().tolist() == [True, True, False, False, False, False, False, False]
    out1 = create_mask(bias, None, 1, 1, 8, 3, F32_MIN, block_size=1)
    assert torch.equal(out1, create_mask(bias, None, 1, 1, 8, 3, F32_MIN))


def test_chunked_path_matches_reference(monkeypatch):
    monkeypatch.setattr(mask_mod, "_CHUNK_ELEMENTS", 50)
    torch.manual_seed(2)
    bias = torch.randint(-2, 3, (2, 2, 9, 13)).float()
    allowed = torch.rand(2, 1, 9, 13) > 0.3
    out = create_mask(bias, allowed, 2, 9, 13, 4, F32_MIN, block_size=3)
    assert torch.equal(out, ref_create_mask(bias, allowed, 9, 13, 4, F32_MIN, block_size=3))
    # per-key bias with a per-query mask is also chunked
    out = create_mask(bias[:, :, :1], allowed, 2, 9, 13, 4, F32_MIN)
    assert torch.equal(out, ref_create_mask(bias[:, :, :1], allowed, 9, 13, 4, F32_MIN))


def test_bias_is_detached_and_inputs_untouched():
    bias = torch.randn(1, 2, 3, 10, requires_grad=True)
    before = bias.detach().clone()
    out = create_mask(bias, None, 1, 3, 10, 4, F32_MIN)
    assert not out.requires_grad and out.dtype == torch.bool
    assert torch.equal(bias.detach(), before)


def test_non_bool_mask_type_error():
    bias = torch.zeros(1, 1, 1, 4)
    with pytest.raises(TypeError, match=r"\.bool\(\)"):
        create_mask(bias, torch.ones(1, 4, dtype=torch.int64), 1, 1, 4, 2, F32_MIN)
    with pytest.raises(TypeError, match=r"\.bool\(\)"):
        create_mask(bias, torch.zeros(1, 1, 1, 4), 1, 1, 4, 2, F32_MIN)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(type="softmax"), ValueError),
        (dict(window_size=0), ValueError),
        (dict(window_size=-3), ValueError),
        (dict(block_size=0), ValueError),
        (dict(block_size=-2), ValueError),
        (dict(block_size=2.0), TypeError),
        (dict(attention_mask=torch.ones(1, 3, dtype=torch.bool)), ValueError),  # neither Lk nor Lq
        (dict(attention_mask=torch.ones(1, 1, 4, dtype=torch.bool)), ValueError),  # 3-D
        (dict(attention_mask=torch.ones(1, 4, 1, 8, dtype=torch.bool)), ValueError),  # heads mismatch
        (dict(attention_mask=torch.ones(1, 1, 3, 8, dtype=torch.bool)), ValueError),  # query dim
        (dict(attention_bias=torch.zeros(1, 2, 8)), ValueError),  # 3-D bias
        (dict(attention_bias=torch.zeros(1, 2, 1, 7)), ValueError),  # wrong key dim
        (dict(attention_bias=torch.zeros(3, 2, 1, 8)), ValueError),  # wrong batch dim
        (dict(attention_bias=torch.zeros(1, 2, 1, 8, dtype=torch.int64)), TypeError),
    ],
)
def test_validation_errors(kwargs, exc):
    args = dict(
        attention_bias=torch.zeros(1, 2, 1, 8),
        attention_mask=None,
        batch_size=1,
        query_len=4,
        key_len=8,
        window_size=2,
        min_dtype=F32_MIN,
    )
    args.update(kwargs)
    with pytest.raises(exc):
        create_mask(**args)


# --------------------------------------------------------------------------------------
# create_mask vs the slow reference on random shapes
# --------------------------------------------------------------------------------------
@st.composite
def _cases(draw):
    b = draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    lq = draw(st.integers(1, 9))
    lk = draw(st.integers(1, 40))
    window = draw(st.integers(1, 45))
    block = draw(st.one_of(st.none(), st.integers(1, 6)))
    kind = draw(st.sampled_from(["topk", "topk", "relu"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    min_dtype = torch.finfo(dtype).min
    bias_q = draw(st.sampled_from([1, lq]))
    bias_b = draw(st.sampled_from([1, b]))
    bias_h = draw(st.sampled_from([1, h]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    bias = torch.randint(-3, 4, (bias_b, bias_h, bias_q, lk), generator=g).to(dtype)
    special = torch.rand(bias.shape, generator=g)
    bias = bias.masked_fill(special < 0.1, min_dtype).masked_fill(special > 0.93, float("-inf"))
    mask_kind = draw(st.sampled_from(["none", "key", "query", "4d"]))
    if mask_kind == "key":
        mask = torch.rand(b, lk, generator=g) > 0.3
    elif mask_kind == "query" and lq < lk:
        mask = torch.rand(b, lq, generator=g) > 0.3
    elif mask_kind == "4d":
        mshape = (draw(st.sampled_from([1, b])), draw(st.sampled_from([1, h])), draw(st.sampled_from([1, lq])), lk)
        mask = torch.rand(mshape, generator=g) > 0.3
    else:
        mask = None
    return bias, mask, b, lq, lk, window, min_dtype, block, kind


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_create_mask_matches_reference(case):
    bias, mask, b, lq, lk, window, min_dtype, block, kind = case
    out = create_mask(bias, mask, b, lq, lk, window, min_dtype, block_size=block, type=kind)
    ref = ref_create_mask(bias, mask, lq, lk, window, min_dtype, block_size=block, kind=kind)
    assert out.dtype == torch.bool
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------
# dynamic_mask_bias
# --------------------------------------------------------------------------------------
def test_dynamic_mask_bias_formula_and_layouts():
    torch.manual_seed(3)
    B, L, Hkv, D = 2, 5, 3, 4
    value = torch.randn(B, L, Hkv, D)
    w = torch.randn(Hkv, Hkv * D) * 0.3
    A = torch.randn(Hkv)
    out = dynamic_mask_bias(value, w, A)
    dt = torch.einsum("blk,hk->blh", value.reshape(B, L, Hkv * D).double(), w.double())
    expected = torch.exp(A.double() * torch.log1p(torch.exp(dt)))  # softplus written out
    expected = expected.permute(0, 2, 1).unsqueeze(2)
    assert out.shape == (B, Hkv, 1, L) and out.dtype == value.dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    # heads-first layout
    out_hf = dynamic_mask_bias(value.transpose(1, 2), w, A, heads_first=True)
    torch.testing.assert_close(out_hf, out)
    # nn.Linear without bias = same as its weight; with bias = calling the module
    lin = torch.nn.Linear(Hkv * D, Hkv, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    torch.testing.assert_close(dynamic_mask_bias(value, lin, A), out)
    lin_b = torch.nn.Linear(Hkv * D, Hkv)
    got = dynamic_mask_bias(value, lin_b, A)
    want = torch.exp(A * F.softplus(lin_b(value.reshape(B, L, -1)))).transpose(1, 2).unsqueeze(2)
    torch.testing.assert_close(got, want)
    # low precision input keeps its dtype
    assert dynamic_mask_bias(value.bfloat16(), w, A).dtype == torch.bfloat16


def test_dynamic_mask_bias_gradcheck():
    torch.manual_seed(4)
    value = torch.randn(1, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    w = (0.5 * torch.randn(2, 4, dtype=torch.float64)).requires_grad_()
    A = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, w_, a: dynamic_mask_bias(v, w_, a), (value, w, A))
    vh = value.detach().transpose(1, 2).contiguous().requires_grad_()
    assert torch.autograd.gradcheck(lambda v, w_, a: dynamic_mask_bias(v, w_, a, heads_first=True), (vh, w, A))


@pytest.mark.parametrize(
    "value_shape, w_shape, a_shape, exc",
    [
        ((2, 5, 3), (3, 12), (3,), ValueError),
        ((2, 5, 3, 4), (3, 11), (3,), ValueError),
        ((2, 5, 3, 4), (12, 3), (3,), ValueError),
        ((2, 5, 3, 4), (3, 12), (2,), ValueError),
        ((2, 5, 3, 4), (3, 12), (1, 3), ValueError),
    ],
)
def test_dynamic_mask_bias_shape_errors(value_shape, w_shape, a_shape, exc):
    with pytest.raises(exc, match=r"shape"):
        dynamic_mask_bias(torch.randn(value_shape), torch.randn(w_shape), torch.randn(a_shape))


def test_dynamic_mask_bias_type_errors():
    with pytest.raises(TypeError):
        dynamic_mask_bias(torch.randn(1, 2, 1, 2), [[1.0, 2.0]], torch.randn(1))
    with pytest.raises(TypeError):
        dynamic_mask_bias(torch.ones(1, 2, 1, 2, dtype=torch.int64), torch.randn(1, 2), torch.randn(1))


# --------------------------------------------------------------------------------------
# apply_dynamic_mask_attention
# --------------------------------------------------------------------------------------
def _dma_inputs(seed=5, B=2, H=4, Hkv=2, Lq=40, Lk=40, D=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    w = torch.randn(Hkv, Hkv * D, generator=g) * 0.2
    A = torch.randn(Hkv, generator=g)
    return q, k, v, w, A


def _naive_dma(q, k, v, w, A, allowed, keep_window_size, dropout_keep=None, dropout_p=0.0):
    """Dense reference; ``allowed`` is a (B|1, Hkv|1, Lq, Lk) bool candidate mask;
    ``dropout_keep`` an optional (B, H, Lq, Lk) dropout keep-mask."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = H // Hkv
    bias = torch.exp(A.view(1, 1, Hkv) * F.softplus(v.transpose(1, 2).reshape(B, Lk, Hkv * D) @ w.T))
    bias = bias.transpose(1, 2).unsqueeze(2)  # (B, Hkv, 1, Lk)
    allowed = allowed.expand(B, Hkv, Lq, Lk)
    keep = allowed.clone()
    if Lk > keep_window_size:
        keep = torch.zeros_like(allowed)
        for b in range(B):
            for h in range(Hkv):
                for i in range(Lq):
                    cand = allowed[b, h, i].nonzero().flatten()
                    vals = bias[b, h, 0, cand]
                    top = vals.topk(min(keep_window_size, cand.numel())).indices  # continuous values: no ties
                    keep[b, h, i, cand[top]] = True
    kk = k.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(D) + bias.repeat_interleave(g, 1)
    scores = scores.masked_fill(~keep.repeat_interleave(g, 1), float("-inf"))
    p = scores.softmax(-1)
    if dropout_keep is not None:
        p = p * dropout_keep / (1 - dropout_p)
    return p @ vv, keep


def _causal(Lq, Lk):
    return torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=Lk - Lq).view(1, 1, Lq, Lk)


@pytest.mark.parametrize("keep_window_size", [8, 64])
def test_dynamic_topk_mask_matches_naive(keep_window_size):
    # Exercises the mask/bias construction without needing the attention kernel.
    q, k, v, w, A = _dma_inputs()
    mask, bias = _dynamic_mask_and_bias(q, k, v, w, A, None, keep_window_size, True)
    _, keep = _naive_dma(q, k, v, w, A, _causal(40, 40), keep_window_size)
    if keep_window_size >= 40:
        assert mask is None
    else:
        # No candidate mask: the selection is a KeyIntervals mask, applied with is_causal.
        assert isinstance(mask, KeyIntervals) and mask.shape == (2, 2, 40)
        dense = mask.to_dense(40) & _causal(40, 40)
        assert torch.equal(dense, keep)
        assert (dense.sum(-1) == torch.arange(1, 41).clamp(max=8)).all()
    torch.testing.assert_close(bias, dynamic_mask_bias(v, w, A, heads_first=True))


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("lq", [40, 7, 1])
def test_dynamic_key_intervals_equal_the_dense_path(is_causal, lq):
    # A per-key candidate mask (padding, bool or additive, per batch or per kv head) and
    # Lq <= Lk give KeyIntervals; they must select exactly what create_mask selects from the
    # candidates written out per query row (what the dense path does).
    q, k, v, w, A = _dma_inputs(Lq=lq)
    g = torch.Generator().manual_seed(lq)
    causal = _causal(lq, 40) if is_causal else torch.ones(1, 1, lq, 40, dtype=torch.bool)
    for per_key in (
        None,
        torch.rand(2, 1, 1, 40, generator=g) > 0.3,
        torch.rand(2, 2, 1, 40, generator=g) > 0.3,
        torch.zeros(1, 1, 1, 40).masked_fill(torch.rand(1, 1, 1, 40, generator=g) > 0.7, float("-inf")),
    ):
        mask, bias = _dynamic_mask_and_bias(q, k, v, w, A, per_key, 8, is_causal)
        assert isinstance(mask, KeyIntervals) and mask.shape[2] == 40
        allowed = torch.ones(1, 1, 1, 40, dtype=torch.bool) if per_key is None else per_key
        if allowed.dtype != torch.bool:
            allowed = allowed == 0
        dense = create_mask(bias, causal & allowed, 2, lq, 40, 8, F32_MIN)
        got = mask.to_dense(lq) & causal  # the kernel applies is_causal on top
        assert torch.equal(got, dense.expand_as(got))


def test_dynamic_topk_mask_chunked(monkeypatch):
    # The dense path (a candidate mask per query row) built in chunks of query rows.
    import flash_dmattn.utils.dynamic as dyn

    q, k, v, w, A = _dma_inputs(Lq=13, Lk=21)
    rows = torch.ones(1, 1, 13, 21, dtype=torch.bool)
    full, _ = _dynamic_mask_and_bias(q, k, v, w, A, rows, 5, True)
    monkeypatch.setattr(dyn, "_CHUNK_ELEMENTS", 90)
    monkeypatch.setattr(mask_mod, "_CHUNK_ELEMENTS", 90)
    chunked, _ = _dynamic_mask_and_bias(q, k, v, w, A, rows, 5, True)
    assert torch.equal(full, chunked)
    _, keep = _naive_dma(q, k, v, w, A, _causal(13, 21), 5)
    assert torch.equal(chunked, keep)
    intervals, _ = _dynamic_mask_and_bias(q, k, v, w, A, None, 5, True)
    assert torch.equal(intervals.to_dense(13) & _causal(13, 21), keep)


def test_dynamic_mask_with_float_and_per_query_head_masks():
    q, k, v, w, A = _dma_inputs(Lq=6, Lk=10)
    causal = _causal(6, 10)
    additive = torch.zeros(1, 1, 6, 10).masked_fill(~causal, float("-inf"))
    m_bool, _ = _dynamic_mask_and_bias(q, k, v, w, A, causal, 3, False)
    m_float, _ = _dynamic_mask_and_bias(q, k, v, w, A, additive, 3, False)
    m_min, _ = _dynamic_mask_and_bias(q, k, v, w, A, additive.clamp(min=F32_MIN), 3, False)
    assert torch.equal(m_bool, m_float) and torch.equal(m_bool, m_min)
    # A mask with one entry per query head forces the bias to be expanded to H heads.
    per_head = causal.expand(2, 4, 6, 10)
    m_h, bias_h = _dynamic_mask_and_bias(q, k, v, w, A, per_head, 3, True)
    assert m_h.shape == (2, 4, 6, 10) and bias_h.shape == (2, 4, 1, 10)
    torch.testing.assert_close(bias_h, dynamic_mask_bias(v, w, A, heads_first=True).repeat_interleave(2, 1))
    assert torch.equal(m_h, m_bool.repeat_interleave(2, 1))


@pytest.mark.parametrize(
    "overrides, exc",
    [
        (dict(q=torch.randn(2, 3, 40, 16)), ValueError),  # H not a multiple of Hkv
        (dict(q=torch.randn(2, 4, 40, 8)), ValueError),  # head_dim mismatch
        (dict(k=torch.randn(2, 2, 39, 16)), ValueError),  # k/v mismatch
        (dict(causal_mask=torch.ones(2, 3, 40, 40, dtype=torch.bool)), ValueError),
        (dict(causal_mask=torch.ones(40, 40, dtype=torch.bool)), ValueError),
        (dict(causal_mask=torch.ones(1, 1, 40, 40, dtype=torch.int64)), TypeError),
        (dict(keep_window_size=0), ValueError),
    ],
)
def test_apply_dynamic_mask_attention_validation(overrides, exc):
    q, k, v, w, A = _dma_inputs()
    args = dict(q=q, k=k, v=v, causal_mask=None, keep_window_size=8)
    args.update(overrides)
    with pytest.raises(exc):
        apply_dynamic_mask_attention(
            args["q"], args["k"], args["v"], w, A,
            causal_mask=args["causal_mask"], keep_window_size=args["keep_window_size"],
        )


@pytest.mark.parametrize("keep_window_size", [8, 64])
def test_apply_dynamic_mask_attention_matches_naive(keep_window_size):
    q, k, v, w, A = _dma_inputs()
    out = apply_dynamic_mask_attention(q, k, v, w, A, keep_window_size=keep_window_size, is_causal=True)
    expected, _ = _naive_dma(q, k, v, w, A, _causal(40, 40), keep_window_size)
    assert out.shape == (2, 4, 40, 16)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_apply_dynamic_mask_attention_explicit_mask_not_causal():
    q, k, v, w, A = _dma_inputs()
    causal = _causal(40, 40)
    additive = torch.zeros(1, 1, 40, 40).masked_fill(~causal, float("-inf"))
    out = apply_dynamic_mask_attention(q, k, v, w, A, causal_mask=additive, keep_window_size=8, is_causal=False)
    expected, _ = _naive_dma(q, k, v, w, A, causal, 8)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_apply_dynamic_mask_attention_decode_shape_bottom_right_causal():
    # Lq < Lk (queries are the last Lq positions): causal visibility is bottom-right aligned.
    q, k, v, w, A = _dma_inputs(Lq=7, Lk=40)
    out = apply_dynamic_mask_attention(q, k, v, w, A, keep_window_size=8, is_causal=True)
    expected, _ = _naive_dma(q, k, v, w, A, _causal(7, 40), 8)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_apply_dynamic_mask_attention_per_query_head_mask():
    q, k, v, w, A = _dma_inputs()
    causal = _causal(40, 40)
    out = apply_dynamic_mask_attention(
        q, k, v, w, A, causal_mask=causal.expand(2, 4, 40, 40), keep_window_size=8, is_causal=True
    )
    expected, _ = _naive_dma(q, k, v, w, A, causal, 8)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("is_causal", [True, False])
def test_apply_dynamic_mask_attention_dropout(is_causal):
    # Outputs and gradients (q, k, v, dt_proj, A) equal to the dense reference run on the
    # dropout keep-mask the call drew (float64, so exactly).
    inputs = [t.double() for t in _dma_inputs(Lq=17, Lk=17)]
    torch.manual_seed(3)
    keep = dropout_mask(dropout_rng("cpu"), 2, 4, 17, 17, 0.25)
    assert 0.5 < keep.double().mean() < 0.95
    results = []
    for run in ("library", "naive"):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        if run == "library":
            torch.manual_seed(3)
            out = apply_dynamic_mask_attention(*leaves, keep_window_size=5, is_causal=is_causal,
                                               dropout_p=0.25)
        else:
            allowed = _causal(17, 17) if is_causal else torch.ones(1, 1, 17, 17, dtype=torch.bool)
            out, _ = _naive_dma(*leaves, allowed, 5, dropout_keep=keep, dropout_p=0.25)
        grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        results.append((out.detach(), *torch.autograd.grad(out, leaves, grad)))
    for name, got, want in zip(("out", "dq", "dk", "dv", "d_dt_proj", "dA"), *results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("chunk", [None, 1, 200])
@pytest.mark.parametrize("seed", range(12))
def test_causal_topk_mask_equals_create_mask(seed, chunk, monkeypatch):
    """The per-key fast path gives create_mask's exact result: ties to the lower index,
    min_dtype / -inf / NaN entries and padding never kept, prefixes shorter than the window.
    A small _CHUNK_ELEMENTS splits the rows into many chunks (the running window carries over)."""
    from flash_dmattn.utils.mask import causal_topk_mask

    if chunk is not None:
        monkeypatch.setattr(mask_mod, "_CHUNK_ELEMENTS", chunk)

    g = torch.Generator().manual_seed(seed)
    B, H = 1 + seed % 2, 1 + (seed // 2) % 2
    L = int(torch.randint(1, 100, (1,), generator=g))
    W = int(torch.randint(1, L + 3, (1,), generator=g))
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    bias = torch.randn(B, H, 1, L, generator=g).to(dtype)
    if seed % 3 == 0:
        bias = (bias * 2).round() / 2  # many ties
    min_dtype = torch.finfo(dtype).min
    bias[..., ::7] = min_dtype
    bias[..., 3::11] = float("-inf")
    if seed % 4 == 0:
        bias[..., 5::13] = float("nan")
    padding = torch.rand(B, L, generator=g) > 0.2 if seed % 2 == 0 else None
    i = torch.arange(L)
    candidates = (i[None, :] <= i[:, None])[None, None]
    if padding is not None:
        candidates = candidates & padding[:, None, None, :]
    want = create_mask(bias, candidates, B, L, L, W, min_dtype).expand(B, H, L, L)
    got = causal_topk_mask(bias, padding, W, min_dtype)
    assert got.dtype == torch.bool and got.shape == (B, H, L, L)
    assert torch.equal(got, want)


def test_causal_topk_mask_rejects_bad_inputs():
    from flash_dmattn.utils.mask import causal_topk_mask

    with pytest.raises(ValueError, match="per key"):
        causal_topk_mask(torch.randn(1, 2, 3, 3), None, 2, -1e30)
    with pytest.raises(ValueError, match="padding_mask"):
        causal_topk_mask(torch.randn(1, 2, 1, 3), torch.ones(1, 4, dtype=torch.bool), 2, -1e30)
    with pytest.raises(TypeError):
        causal_topk_mask(torch.ones(1, 2, 1, 3, dtype=torch.int64), None, 2, -1e30)
    with pytest.raises(ValueError, match="window_size"):
        causal_topk_mask(torch.randn(1, 2, 1, 3), None, 0, -1e30)
