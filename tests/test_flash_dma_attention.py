"""flash_dma_attention: outputs and every gradient (query, key, value, dt_proj, a_coef) against
a dense float64 implementation written here, at odd lengths, GQA / MQA, causal and not,
windows shorter and longer than the keys, and tied biases."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flash_dmattn
from flash_dmattn import KeyIntervals, flash_dma_attention
from flash_dmattn.testing import dropout_mask, dropout_rng
from naive import assert_close


def dma_naive(q, k, v, w, a, keep_window_size, causal, scale=None, w_bias=None, keep=None, dropout_p=0.0):
    """The call written out densely in float64: the bias, the per-row top-k among the keys a
    query sees (stable sort: ties to the lower key index), then plain masked attention, with
    the probabilities multiplied by ``keep / (1 - dropout_p)`` when a keep-mask
    ``(B, H, Lq, Lk)`` is given. Returns ``(out, kept (B, Hkv, Lq, Lk))``."""
    q, k, v, w, a = (t.double() for t in (q, k, v, w, a))
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    dt = v.reshape(B, Lk, Hkv * D) @ w.T
    if w_bias is not None:
        dt = dt + w_bias.double()
    bias = torch.exp(a * F.softplus(dt)).permute(0, 2, 1)[:, :, None, :]  # (B, Hkv, 1, Lk)
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    visible = (j <= i + Lk - Lq) if causal else torch.ones(Lq, Lk, dtype=torch.bool)
    visible = visible.expand(B, Hkv, Lq, Lk)
    if Lk > keep_window_size:
        score = bias.detach().expand(B, Hkv, Lq, Lk).masked_fill(~visible, float("-inf"))
        order = score.sort(dim=-1, descending=True, stable=True).indices[..., :keep_window_size]
        visible = visible & torch.zeros_like(visible).scatter(-1, order, True)
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(g, 2)) * scale
    s = s + bias.repeat_interleave(g, 1)
    seen = visible.repeat_interleave(g, 1)
    empty = ~seen.any(-1, keepdim=True)  # causal queries before the first key see nothing
    p = torch.softmax(s.masked_fill(~seen, float("-inf")).masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(g, 2))
    return out, visible


def make_inputs(B, Lq, Lk, H, Hkv, D, dtype=torch.float64, seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=gen)
    k = torch.randn(B, Lk, Hkv, D, generator=gen)
    v = torch.randn(B, Lk, Hkv, D, generator=gen)
    w = torch.randn(Hkv, Hkv * D, generator=gen) * 0.3
    a = -torch.rand(Hkv, generator=gen) - 0.3
    if ties:
        # Exact ties in the ranking: runs of keys with identical values (hence identical bias in
        # any precision), and a head whose A is 0 (bias 1 for every key).
        v[:, 1::3] = v[:, 0:-1:3][:, : v[:, 1::3].shape[1]]
        v[:, 2::4] = v[:, 0:1].expand_as(v[:, 2::4])
        a[0] = 0.0
    return [t.to(dtype) for t in (q, k, v, w, a)]


def run_both(inputs, keep_window_size, causal, scale=None, dropout_p=0.0, seed=1234):
    """Output and gradients of the library call and of the naive one (float64); with dropout,
    the naive call uses the keep-mask the library call drew (rebuilt from the same seed)."""
    results = []
    gen = torch.Generator().manual_seed(99)
    grad_out = None
    keep = None
    for fn in ("lib", "naive"):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        if fn == "lib":
            torch.manual_seed(seed)
            rng = dropout_rng(leaves[0].device)
            torch.manual_seed(seed)
            out = flash_dma_attention(*leaves, keep_window_size=keep_window_size, causal=causal,
                                      softmax_scale=scale, dropout_p=dropout_p)
            if dropout_p > 0.0:
                B, Lq, H, _ = out.shape
                keep = dropout_mask(rng, B, H, Lq, leaves[1].shape[1], dropout_p)
        else:
            out, _ = dma_naive(*leaves, keep_window_size, causal, scale, keep=keep, dropout_p=dropout_p)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        results.append((out.detach(), grads))
    return results, keep


NAMES = ("dq", "dk", "dv", "d_dt_proj", "d_a_coef")

CASES = [
    # B, Lq, Lk, H, Hkv, D, keep_window_size
    (2, 13, 13, 4, 2, 8, 5),    # GQA, odd length, window shorter than the keys
    (1, 13, 13, 4, 2, 8, 13),   # window == Lk: no selection
    (2, 11, 11, 3, 1, 6, 40),   # MQA, window longer than the keys
    (1, 17, 17, 2, 2, 16, 1),   # window of one key
    (2, 3, 19, 4, 2, 8, 6),     # fewer queries than keys (the last positions: a chunk / decode)
    (1, 9, 7, 2, 1, 8, 3),      # more queries than keys
    (1, 1, 15, 2, 2, 8, 4),     # one query
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Lq{}-Lk{}-H{}-Hkv{}-D{}-W{}".format(*c))
def test_matches_naive_outputs_and_gradients(case, causal):
    B, Lq, Lk, H, Hkv, D, W = case
    inputs = make_inputs(B, Lq, Lk, H, Hkv, D, seed=Lq * 31 + Lk)
    ((out, grads), (ref, ref_grads)), _ = run_both(inputs, W, causal)
    assert out.shape == (B, Lq, H, D) and out.dtype == torch.float64
    assert_close("out", out, ref, 1e-10)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, 1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keep_window_size", [2, 4, 7])
def test_ties_go_to_the_lower_key(causal, keep_window_size):
    inputs = make_inputs(2, 15, 15, 4, 2, 8, seed=7, ties=True)
    ((out, grads), (ref, ref_grads)), _ = run_both(inputs, keep_window_size, causal)
    assert_close("out", out, ref, 1e-10)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, 1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_float32_and_softmax_scale(causal):
    inputs = make_inputs(2, 21, 21, 4, 2, 16, dtype=torch.float32, seed=3)
    ((out, grads), (ref, ref_grads)), _ = run_both(inputs, 6, causal, scale=0.3)
    assert out.dtype == torch.float32
    assert_close("out", out, ref, 1e-5)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, 1e-5)


DROPOUT_CASES = [
    (2, 13, 13, 4, 2, 8, 5),    # GQA, selection
    (1, 9, 7, 2, 1, 8, 3),      # more queries than keys (causal: rows that see nothing)
    (2, 3, 19, 4, 2, 8, 40),    # fewer queries than keys, no selection
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: "B{}-Lq{}-Lk{}-H{}-Hkv{}-D{}-W{}".format(*c))
def test_dropout_matches_naive_on_the_calls_keep_mask(case, causal):
    B, Lq, Lk, H, Hkv, D, W = case
    inputs = make_inputs(B, Lq, Lk, H, Hkv, D, seed=Lq + Lk)
    ((out, grads), (ref, ref_grads)), keep = run_both(inputs, W, causal, dropout_p=0.3)
    # The mask dropped some of the entries and kept most: the comparison is not vacuous.
    assert 0.4 < keep.double().mean() < 0.95
    assert_close("out", out, ref, 1e-10)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g, r, 1e-10)


def test_dropout_is_reproducible_and_zero_is_off():
    inputs = make_inputs(2, 13, 13, 4, 2, 8, seed=5)

    def call(seed, p):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        torch.manual_seed(seed)
        out = flash_dma_attention(*leaves, keep_window_size=5, causal=True, dropout_p=p)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        return (out.detach(), *grads)

    first, again, other = call(0, 0.2), call(0, 0.2), call(1, 0.2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    plain = call(0, 0.0)
    without = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = flash_dma_attention(*without, keep_window_size=5, causal=True)
    for a, b in zip(plain, (out.detach(), *torch.autograd.grad(out.square().sum(), without))):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], plain[0])


def test_each_query_keeps_the_window_of_keys_it_sees():
    # The causal selection: query i keeps min(i + 1, W) keys, all at positions <= i.
    q, k, v, w, a = make_inputs(1, 12, 12, 4, 2, 8, seed=4)
    _, kept = dma_naive(q, k, v, w, a, 4, True)
    assert torch.equal(kept.sum(-1), torch.arange(1, 13).clamp(max=4).expand(1, 2, 12))
    _, probs = flash_dma_attention(q, k, v, w, a, keep_window_size=4, causal=True, return_attn_probs=True)
    # Probabilities are nonzero exactly on the kept keys of each query; the two query heads of
    # a group share their kv head's selection.
    assert torch.equal(probs > 0, kept.repeat_interleave(2, 1))


@pytest.mark.parametrize("causal", [True, False])
def test_return_attn_probs(causal):
    B, Lq, Lk, H, Hkv, D, W = 2, 10, 13, 4, 2, 8, 5
    q, k, v, w, a = make_inputs(B, Lq, Lk, H, Hkv, D, seed=12)
    out, probs = flash_dma_attention(q, k, v, w, a, keep_window_size=W, causal=causal, return_attn_probs=True)
    ref, kept = dma_naive(q, k, v, w, a, W, causal)
    assert_close("out", out, ref, 1e-10)
    # The probabilities written out: softmax over the kept keys of the scaled scores plus bias.
    qd, kd, vd, wd, ad = (t.double() for t in (q, k, v, w, a))
    bias = torch.exp(ad * F.softplus(vd.reshape(B, Lk, Hkv * D) @ wd.T)).permute(0, 2, 1)[:, :, None, :]
    g = H // Hkv
    s = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(g, 2)) * D ** -0.5
    s = (s + bias.repeat_interleave(g, 1)).masked_fill(~kept.repeat_interleave(g, 1), float("-inf"))
    want = torch.softmax(s, -1)
    assert probs.shape == (B, H, Lq, Lk)
    assert_close("probs", probs, want, 1e-6 if probs.dtype == torch.float32 else 1e-10)
    assert_close("probs @ v", torch.einsum("bhij,bjhd->bihd", probs.double(), vd.repeat_interleave(g, 2)),
                 ref, 1e-6)
    # With dropout the probabilities are those before dropout (as flash_dmattn_func's).
    _, dropped = flash_dma_attention(q, k, v, w, a, keep_window_size=W, causal=causal, dropout_p=0.5,
                                     return_attn_probs=True)
    assert torch.equal(dropped, probs)


def test_selection_is_key_intervals_with_the_window(monkeypatch):
    # The kernels get the selection as KeyIntervals carrying the window promise (cost
    # proportional to the window), and no mask at all when every key fits in the window.
    import flash_dmattn.dma as dma

    seen = []
    real = dma.flash_dmattn_func

    def spy(*args, **kwargs):
        seen.append(kwargs["attn_mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dma, "flash_dmattn_func", spy)
    q, k, v, w, a = make_inputs(1, 9, 9, 2, 1, 8, seed=1)
    for causal in (True, False):
        flash_dma_attention(q, k, v, w, a, keep_window_size=4, causal=causal)
        assert isinstance(seen[-1], KeyIntervals) and seen[-1].window == 4
    flash_dma_attention(q, k, v, w, a, keep_window_size=9, causal=True)
    assert seen[-1] is None


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("causal", [True, False])
def test_the_triton_kernels_run_the_selection(causal, dropout_p, monkeypatch):
    # The same call with the kernels' backend forced (on CPU through Triton's interpreter):
    # the KeyIntervals selection with its window, the per-key bias and its gradients, and the
    # kernels' dropout on the keep-mask the call drew.
    pytest.importorskip("triton")
    import os

    import flash_dmattn.dma as dma

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.fail("tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU")
    monkeypatch.setattr(dma, "flash_dmattn_func", flash_dmattn.triton_dmattn_func)
    B, L, H, Hkv, D = 1, 37, 4, 2, 16
    inputs = [t.to(device) for t in make_inputs(B, L, L, H, Hkv, D, dtype=torch.float32, seed=1)]
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    torch.manual_seed(6)
    keep = dropout_mask(dropout_rng(device), B, H, L, L, dropout_p).cpu() if dropout_p else None
    torch.manual_seed(6)
    out = flash_dma_attention(*leaves, keep_window_size=8, causal=causal, dropout_p=dropout_p)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    grads = torch.autograd.grad(out, leaves, grad_out)
    leaves = [t.cpu().clone().requires_grad_(True) for t in inputs]
    ref, _ = dma_naive(*leaves, 8, causal, keep=keep, dropout_p=dropout_p)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.cpu().double())
    assert_close("out", out.cpu(), ref, 1e-5)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(name, g.cpu(), r, 1e-5)


def test_dt_proj_as_linear_with_bias():
    B, L, H, Hkv, D, W = 2, 11, 4, 2, 8, 4
    q, k, v, w, a = make_inputs(B, L, L, H, Hkv, D, seed=21)
    lin = nn.Linear(Hkv * D, Hkv, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    out = flash_dma_attention(q, k, v, lin, a, keep_window_size=W, causal=True)
    out.sum().backward()
    w2 = w.clone().requires_grad_(True)
    b2 = lin.bias.detach().clone().requires_grad_(True)
    ref, _ = dma_naive(q, k, v, w2, a, W, True, w_bias=b2)
    ref.sum().backward()
    assert_close("out", out, ref, 1e-10)
    assert_close("d_weight", lin.weight.grad, w2.grad, 1e-10)
    assert_close("d_bias", lin.bias.grad, b2.grad, 1e-10)


def test_exported_at_top_level():
    assert flash_dmattn.flash_dma_attention is flash_dma_attention
    assert "flash_dma_attention" in flash_dmattn.__all__


@pytest.mark.parametrize(
    "change, exc",
    [
        (dict(q=torch.randn(2, 9, 3, 8)), ValueError),          # H not a multiple of Hkv
        (dict(q=torch.randn(2, 9, 4, 6)), ValueError),          # head_dim differs
        (dict(q=torch.randn(9, 4, 8)), ValueError),             # not 4-D
        (dict(v=torch.randn(2, 8, 2, 8)), ValueError),          # key / value shapes differ
        (dict(w=torch.randn(4, 32)), ValueError),               # dt_proj for 4 kv heads, keys have 2
        (dict(a=torch.randn(3)), ValueError),                   # a_coef not (Hkv,)
        (dict(keep_window_size=0), ValueError),
        (dict(keep_window_size=2.0), TypeError),
        (dict(keep_window_size=True), TypeError),
        (dict(dropout_p=1.0), ValueError),
        (dict(dropout_p=-0.1), ValueError),
        (dict(dropout_p=True), TypeError),
        (dict(causal=1), TypeError),
        (dict(return_attn_probs=None), TypeError),
        (dict(q=[[1.0]]), TypeError),
    ],
)
def test_argument_errors(change, exc):
    q, k, v, w, a = make_inputs(2, 9, 9, 4, 2, 8, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, w=w, a=a)
    opts = {}
    for name, value in change.items():
        (args if name in args else opts)[name] = value
    with pytest.raises(exc):
        flash_dma_attention(args["q"], args["k"], args["v"], args["w"], args["a"], **opts)
