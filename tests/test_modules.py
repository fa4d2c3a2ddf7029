"""flash_dmattn.modules: MultiheadAttention against torch.nn.MultiheadAttention, and
DynamicMaskAttention against a plain-PyTorch implementation written here (float64)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flash_dmattn.modules import DynamicMaskAttention, MultiheadAttention
from flash_dmattn.testing import dropout_mask, dropout_rng

# torch.nn.MultiheadAttention.forward (torch.nn.modules.activation) warns that a bool
# key_padding_mask with a float attn_mask, or the reverse, is deprecated; these tests compare
# against it on exactly those combinations.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Support for mismatched key_padding_mask and attn_mask:UserWarning:"
    "torch.nn.modules.activation"
)

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)

# ---------------------------------------------------------------------------------------------
# MultiheadAttention
# ---------------------------------------------------------------------------------------------

E, H, B, L, S = 16, 4, 3, 5, 7


def mha_pair(seed=0, **kw):
    torch.manual_seed(seed)
    ours = MultiheadAttention(E, H, dtype=DT, **kw)
    ref = nn.MultiheadAttention(E, H, dtype=DT, **{k: v for k, v in kw.items() if k != "backend"})
    # Random biases too (torch initialises them to 0, which would hide bias bugs).
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def seq_inputs(batch_first, lq=L, s=S, kdim=E, vdim=E, seed=1, batched=True):
    g = torch.Generator().manual_seed(seed)

    def make(length, dim):
        shape = (B, length, dim) if batch_first else (length, B, dim)
        if not batched:
            shape = (length, dim)
        return torch.randn(*shape, dtype=DT, generator=g)

    return make(lq, E), make(s, kdim), make(s, vdim)


def run(module, q, k, v, **kw):
    """Forward + backward of a random projection of the outputs; returns everything compared."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    module.zero_grad()
    out, w = module(q, k, v, **kw)
    g = torch.Generator().manual_seed(123)
    loss = (out * torch.randn(out.shape, dtype=DT, generator=g)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, dtype=DT, generator=g)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), (None if w is None else w.detach()), [t.grad for t in (q, k, v)], grads


def assert_same(a, b):
    out_a, w_a, gin_a, gp_a = a
    out_b, w_b, gin_b, gp_b = b
    torch.testing.assert_close(out_a, out_b, **TOL)
    if w_b is None:
        assert w_a is None
    else:
        torch.testing.assert_close(w_a, w_b, **TOL)
    for ga, gb in zip(gin_a, gin_b):
        torch.testing.assert_close(ga, gb, **TOL)
    assert gp_a.keys() == gp_b.keys()
    for name in gp_b:
        torch.testing.assert_close(gp_a[name], gp_b[name], **TOL, msg=name)


def bool_kpm(seed=2):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, S, generator=g) < 0.4
    m[:, 0] = False  # every row keeps a visible key (torch gives NaN for empty rows)
    return m


def float_kpm(seed=3):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, S, dtype=DT, generator=g)
    m[:, 3] = float("-inf")
    return m


def attn_mask_of(kind, seed=4, lq=L, s=S):
    g = torch.Generator().manual_seed(seed)
    shape = (lq, s) if kind.endswith("2d") else (B * H, lq, s)
    if kind.startswith("bool"):
        m = torch.rand(*shape, generator=g) < 0.4
        m[..., 0] = False
        return m
    m = torch.randn(*shape, dtype=DT, generator=g)
    m[..., 2] = float("-inf")
    return m


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_self_attention_matches_torch(batch_first, need_weights, average):
    ours, ref = mha_pair(batch_first=batch_first)
    q, _, _ = seq_inputs(batch_first, s=L)
    kw = dict(need_weights=need_weights, average_attn_weights=average)
    assert_same(run(ours, q, q, q, **kw), run(ref, q, q, q, **kw))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_kdim_vdim_cross_attention(batch_first, need_weights):
    ours, ref = mha_pair(batch_first=batch_first, kdim=6, vdim=10)
    assert ours.in_proj_weight is None and ours.k_proj_weight.shape == (E, 6)
    q, k, v = seq_inputs(batch_first, kdim=6, vdim=10)
    kw = dict(need_weights=need_weights, key_padding_mask=bool_kpm())
    assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))


@pytest.mark.parametrize("kpm", ["none", "bool", "float"])
@pytest.mark.parametrize("mask", ["none", "bool2d", "float2d", "bool3d", "float3d"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_masks_match_torch(kpm, mask, need_weights):
    ours, ref = mha_pair(batch_first=True)
    q, k, v = seq_inputs(True)
    kw = dict(need_weights=need_weights, average_attn_weights=False)
    if kpm != "none":
        kw["key_padding_mask"] = bool_kpm() if kpm == "bool" else float_kpm()
    if mask != "none":
        kw["attn_mask"] = attn_mask_of(mask)
    assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_is_causal_hint(float_mask, with_kpm, need_weights):
    ours, ref = mha_pair(batch_first=False)
    q, _, _ = seq_inputs(False, s=L)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=DT)  # 0 / -inf
    kw = dict(is_causal=True, need_weights=need_weights, attn_mask=causal if float_mask else causal != 0)
    if with_kpm:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[:, -2:] = True  # padding at the end: every causal row keeps key 0
        kw["key_padding_mask"] = kpm
    assert_same(run(ours, q, q, q, **kw), run(ref, q, q, q, **kw))


@pytest.mark.parametrize("add_bias_kv,add_zero_attn", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_bias_kv_and_zero_attn(add_bias_kv, add_zero_attn, need_weights):
    ours, ref = mha_pair(add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    q, k, v = seq_inputs(False)
    kw = dict(need_weights=need_weights, key_padding_mask=bool_kpm(), attn_mask=attn_mask_of("float3d"))
    assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))


@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_unbatched(need_weights, average):
    ours, ref = mha_pair()
    q, k, v = seq_inputs(False, batched=False)
    g = torch.Generator().manual_seed(9)
    kpm = torch.rand(S, generator=g) < 0.4
    kpm[0] = False
    kw = dict(need_weights=need_weights, average_attn_weights=average, key_padding_mask=kpm,
              attn_mask=torch.randn(H, L, S, dtype=DT, generator=g))
    a, b = run(ours, q, k, v, **kw), run(ref, q, k, v, **kw)
    assert a[0].shape == (L, E)
    assert_same(a, b)


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_float_attn_mask_gets_gradient(need_weights):
    # A float attn_mask is an additive bias: torch differentiates through it, and so do we.
    ours, ref = mha_pair(batch_first=True)
    q, k, v = seq_inputs(True)
    grads = []
    for m in (ours, ref):
        am = attn_mask_of("float3d").requires_grad_(True)
        out, w = m(q, k, v, attn_mask=am, key_padding_mask=float_kpm(), need_weights=need_weights)
        loss = out.pow(2).sum() + (0 if w is None else w.pow(2).sum())
        loss.backward()
        grads.append(am.grad)
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], **TOL)


def test_mha_no_bias_and_no_grad_weights_path():
    ours, ref = mha_pair(bias=False, batch_first=True)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    q, k, v = seq_inputs(True)
    kw = dict(key_padding_mask=float_kpm(), attn_mask=attn_mask_of("bool2d"), average_attn_weights=False)
    with torch.no_grad():  # the torch-reference return_attn_probs route
        out_a, w_a = ours(q, k, v, **kw)
        out_b, w_b = ref(q, k, v, **kw)
    torch.testing.assert_close(out_a, out_b, **TOL)
    torch.testing.assert_close(w_a, w_b, **TOL)
    assert w_a.shape == (B, H, L, S)


def test_mha_state_dict_round_trip_and_keys():
    for kw in ({}, dict(kdim=6, vdim=10, add_bias_kv=True), dict(bias=False)):
        ours, ref = mha_pair(**kw)
        assert list(ours.state_dict()) == list(ref.state_dict())
        fresh = MultiheadAttention(E, H, dtype=DT, **kw)
        fresh.load_state_dict(ref.state_dict())  # strict: same keys and shapes
        for (n1, t1), (n2, t2) in zip(fresh.state_dict().items(), ref.state_dict().items()):
            assert n1 == n2 and torch.equal(t1, t2)


class _OutputOnly:
    """A torch MHA asked for its weights (so its dropout runs through F.dropout, where a test
    can set the mask) whose weights are then left out, as with need_weights=False."""

    def __init__(self, module):
        self.module = module

    def __call__(self, q, k, v, **kw):
        out, _ = self.module(q, k, v, **{**kw, "need_weights": True})
        return out, None

    def zero_grad(self):
        self.module.zero_grad()

    def named_parameters(self):
        return self.module.named_parameters()


@pytest.mark.parametrize("extra", [{}, dict(add_bias_kv=True, add_zero_attn=True)],
                         ids=["plain", "extra-keys"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_dropout_is_the_kernels_and_matches_torch_on_its_mask(need_weights, average, extra, monkeypatch):
    # Training with dropout runs flash_dmattn's dropout (no fallback to torch): outputs,
    # weights (after dropout, as torch returns them) and every gradient equal torch's own
    # MultiheadAttention run with its dropout replaced by the keep-mask the kernel call drew.
    p = 0.4
    ours, ref = mha_pair(dropout=p, batch_first=True, **extra)
    q, k, v = seq_inputs(True)
    kw = dict(key_padding_mask=bool_kpm(), need_weights=need_weights, average_attn_weights=average)
    keys = S + (2 if extra else 0)
    torch.manual_seed(7)
    keep = dropout_mask(dropout_rng("cpu"), B, H, L, keys, p)
    assert 0.3 < keep.double().mean() < 0.9
    torch.manual_seed(7)
    a = run(ours, q, k, v, **kw)

    def same_mask(x, p=0.5, training=True, inplace=False):
        assert p == 0.4 and training
        return x * keep.reshape(x.shape).to(x.dtype) / (1 - p)  # torch's weights: (B * H, L, S)

    monkeypatch.setattr(F, "dropout", same_mask)
    b = run(ref if need_weights else _OutputOnly(ref), q, k, v, **kw)
    assert_same(a, b)

    # Without autograd the weights come from the reference backend's call, same mask.
    with torch.no_grad():
        torch.manual_seed(7)
        out_a, w_a = ours(q, k, v, **kw)
        out_b, w_b = ref(q, k, v, **{**kw, "need_weights": True})
    torch.testing.assert_close(out_a, out_b, **TOL)
    if need_weights:
        torch.testing.assert_close(w_a, w_b, **TOL)

    # Reproducible with the seed; eval mode has no dropout.
    torch.manual_seed(7)
    assert_same(run(ours, q, k, v, **kw), a)
    monkeypatch.undo()
    ours.eval(), ref.eval()
    assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))


def test_mha_dropout_one_drops_every_probability():
    # dropout=1 (torch accepts it): the attention output is zero, as torch's.
    ours, ref = mha_pair(dropout=1.0, batch_first=True)
    q, k, v = seq_inputs(True)
    for need_weights in (True, False):
        kw = dict(key_padding_mask=bool_kpm(), need_weights=need_weights)
        assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))


def test_mha_explicit_backend_and_errors():
    ours, ref = mha_pair(backend="torch-reference", batch_first=True)
    q, k, v = seq_inputs(True)
    kw = dict(need_weights=False, attn_mask=attn_mask_of("bool3d"))
    assert_same(run(ours, q, k, v, **kw), run(ref, q, k, v, **kw))

    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="unknown backend"):
        MultiheadAttention(E, H, backend="nope")
    with pytest.raises(ValueError, match="is_causal"):
        ours(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ours(q, k, v, attn_mask=torch.zeros(L, L, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(q, k, v, key_padding_mask=torch.zeros(B, S + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        ours(q, k, v, attn_mask=torch.zeros(L, S, dtype=torch.long))
    with pytest.raises(ValueError, match="last dim"):
        ours(q, k[..., :4], v)


# ---------------------------------------------------------------------------------------------
# DynamicMaskAttention
# ---------------------------------------------------------------------------------------------


def rotate_half_plain(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_tables(batch, length, dim, batched):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=DT) / dim))
    pos = torch.arange(length, dtype=DT)
    if batched:  # a different offset per sequence, as with left padding
        pos = pos[None, :] + torch.arange(batch, dtype=DT)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def dma_plain(m, x, padding=None, rope=None, keep=None):
    """The layer written out densely (float64), sharing no code with the library; ``keep``
    ``(B, H, L, L)``: the dropout keep-mask, applied with the layer's ``dropout``."""
    Bx, Lx, _ = x.shape
    Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    q = m.q_proj(x).view(Bx, Lx, Hq, D)
    k = m.k_proj(x).view(Bx, Lx, Hkv, D)
    v = m.v_proj(x).view(Bx, Lx, Hkv, D)
    if rope is not None:
        cos, sin = rope[0].unsqueeze(-2), rope[1].unsqueeze(-2)
        q = q * cos + rotate_half_plain(q) * sin
        k = k * cos + rotate_half_plain(k) * sin
    dt = v.reshape(Bx, Lx, Hkv * D) @ m.dt_proj.weight.T
    if m.dt_proj.bias is not None:
        dt = dt + m.dt_proj.bias
    zoh = torch.exp(m.A * F.softplus(dt)).permute(0, 2, 1)[:, :, None, :]  # (B, Hkv, 1, L)
    i = torch.arange(Lx)[:, None]
    j = torch.arange(Lx)[None, :]
    allowed = (j <= i) if m.is_causal else torch.ones(Lx, Lx, dtype=torch.bool)
    allowed = allowed.expand(Bx, Hkv, Lx, Lx)
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
    if Lx > m.window_size:
        score = zoh.detach().expand(Bx, Hkv, Lx, Lx).masked_fill(~allowed, float("-inf"))
        order = score.sort(dim=-1, descending=True, stable=True).indices
        top = torch.zeros_like(allowed).scatter(-1, order[..., : m.window_size], True)
        allowed = allowed & top
    g = Hq // Hkv
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(g, 2)) / D ** 0.5
    s = s + zoh.repeat_interleave(g, 1)
    vis = allowed.repeat_interleave(g, 1)
    s = s.masked_fill(~vis, float("-inf"))
    empty = ~vis.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep / (1 - m.dropout)
    out = torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(g, 2))
    return m.o_proj(out.reshape(Bx, Lx, Hq * D))


def make_dma(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(hidden_size=32, num_heads=4, num_kv_heads=2, window_size=6)
    cfg.update(kw)
    m = DynamicMaskAttention(**cfg).to(DT)
    with torch.no_grad():
        m.A.copy_(-torch.rand_like(m.A) - 0.2)  # make the bias vary noticeably across keys
        for lin in (m.q_proj, m.k_proj, m.v_proj, m.o_proj, m.dt_proj):
            if lin.bias is not None:
                lin.bias.normal_(0, 0.2)
    return m


def hidden(batch, length, size=32, seed=5):
    return torch.randn(batch, length, size, dtype=DT, generator=torch.Generator().manual_seed(seed))


def compare_dma(m, x, padding=None, rope=None, keep=None, seed=None):
    """Outputs and gradients (input and every parameter) equal to the plain layer (run with
    the dropout keep-mask ``keep`` that the layer's call draws after ``manual_seed(seed)``)."""
    results = []
    for fn in (lambda xx: m(xx, padding, rope), lambda xx: dma_plain(m, xx, padding, rope, keep)):
        xx = x.clone().requires_grad_(True)
        m.zero_grad()
        if seed is not None:
            torch.manual_seed(seed)
        out = fn(xx)
        (out * torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(11))).sum().backward()
        results.append((out.detach(), xx.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    torch.testing.assert_close(o1, o2, **TOL)
    torch.testing.assert_close(gx1, gx2, **TOL)
    for n in gp2:
        torch.testing.assert_close(gp1[n], gp2[n], **TOL, msg=n)
    return o1


def test_dma_shape_and_gradients_reach_dt_proj_and_A():
    m = DynamicMaskAttention(32, 4, 2, window_size=8)  # default init, float32
    x = torch.randn(2, 12, 32)
    out = m(x)
    assert out.shape == (2, 12, 32) and out.dtype == torch.float32
    out.pow(2).sum().backward()
    assert m.dt_proj.weight.grad is not None and m.dt_proj.weight.grad.abs().sum() > 0
    assert m.A.grad is not None and (m.A.grad != 0).all()


@pytest.mark.parametrize("length", [5, 6, 13])  # below, at, above window_size=6
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_dma_matches_plain(length, is_causal, bias):
    m = make_dma(is_causal=is_causal, bias=bias)
    compare_dma(m, hidden(2, length))


@pytest.mark.parametrize("length", [5, 13])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("side", ["left", "right"])
def test_dma_padding_matches_plain_and_is_ignored(length, is_causal, side):
    m = make_dma(is_causal=is_causal, num_kv_heads=1)  # MQA
    pad = torch.ones(3, length, dtype=torch.long)
    n_pad = [0, 2, 4]
    for b, n in enumerate(n_pad):
        if n:
            if side == "left":
                pad[b, :n] = 0
            else:
                pad[b, -n:] = 0
    x = hidden(3, length)
    out = compare_dma(m, x, pad)
    # Changing the padded tokens' hidden states leaves every real token's output unchanged.
    x2 = torch.where(pad.bool()[..., None], x, torch.randn_like(x) * 10)
    with torch.no_grad():
        out2 = m(x2, pad.bool())
    real = pad.bool()
    torch.testing.assert_close(out[real], out2[real], **TOL)


@pytest.mark.parametrize("batched_tables", [False, True])
@pytest.mark.parametrize("length", [5, 13])
def test_dma_rotary(batched_tables, length):
    m = make_dma()
    x = hidden(2, length)
    rope = rotary_tables(2, length, m.head_dim, batched_tables)
    with_rope = compare_dma(m, x, rope=rope)
    with torch.no_grad():
        without = m(x)
    assert (with_rope - without).abs().max() > 1e-3


def test_dma_top_k_ties_keep_lower_indices():
    # dt_proj = 0 gives one bias value for every key: the selection is then decided by
    # the tie rule (lower key index first), which the plain layer's stable sort also uses.
    m = make_dma(window_size=3)
    with torch.no_grad():
        m.dt_proj.weight.zero_()
    for is_causal in (True, False):
        m.is_causal = is_causal
        compare_dma(m, hidden(2, 9))


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("length", [5, 13])
def test_dma_dropout_in_training_only(is_causal, length):
    # Training: the kernel's dropout, outputs and every gradient equal to the plain layer run
    # on the keep-mask the call drew; eval: no dropout.
    m = make_dma(is_causal=is_causal, dropout=0.3)
    x = hidden(2, length)
    pad = torch.ones(2, length, dtype=torch.bool)
    pad[1, :2] = False
    torch.manual_seed(5)
    keep = dropout_mask(dropout_rng("cpu"), 2, m.num_heads, length, length, 0.3)
    assert 0.4 < keep.double().mean() < 0.95
    trained = compare_dma(m, x, pad, keep=keep, seed=5)
    m.eval()
    evaluated = compare_dma(m, x, pad)
    assert (trained - evaluated).abs().max() > 1e-3
    assert "dropout=0.3" in repr(m)


def _dense_key_mask(m, bias, padding):
    """The layer's former mask: the dense bool top-k mask of the dense helpers."""
    from flash_dmattn.utils.mask import causal_topk_mask, create_mask

    batch, _, _, length = bias.shape
    if length <= m.window_size:
        return None if padding is None else padding.view(batch, 1, 1, length)
    min_dtype = torch.finfo(bias.dtype).min
    if m.is_causal:
        return causal_topk_mask(bias, padding, m.window_size, min_dtype)
    return create_mask(bias, padding, batch, length, length, m.window_size, min_dtype)


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_dma_key_intervals_equal_the_dense_mask_path(is_causal, tied, monkeypatch):
    # Beyond the window the layer hands the kernel KeyIntervals; on the reference backend its
    # outputs and gradients equal those of the dense (B, Hkv, L, L) mask it used to build.
    from flash_dmattn.masks import KeyIntervals

    m = make_dma(is_causal=is_causal, window_size=5, backend="torch-reference")
    if tied:
        with torch.no_grad():
            m.dt_proj.weight.mul_(torch.rand_like(m.dt_proj.weight) < 0.1)  # few distinct biases
    x = hidden(3, 23)
    pad = torch.ones(3, 23, dtype=torch.bool)
    pad[1, :4] = False
    pad[2, -6:] = False
    seen = []
    original = DynamicMaskAttention._key_mask

    def spy(self, bias, padding):
        mask = original(self, bias, padding)
        seen.append(mask)
        return mask

    results = []
    for key_mask in (spy, lambda self, bias, padding: _dense_key_mask(self, bias, padding)):
        monkeypatch.setattr(DynamicMaskAttention, "_key_mask", key_mask)
        xx = x.clone().requires_grad_(True)
        m.zero_grad()
        out = m(xx, pad)
        out.pow(2).sum().backward()
        results.append((out.detach(), xx.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert isinstance(seen[0], KeyIntervals) and seen[0].shape == (3, m.num_kv_heads, 23)
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    torch.testing.assert_close(o1, o2, **TOL)
    torch.testing.assert_close(gx1, gx2, **TOL)
    for n in gp2:
        torch.testing.assert_close(gp1[n], gp2[n], **TOL, msg=n)


def test_dma_explicit_backend_and_float32():
    m = make_dma(backend="torch-reference")
    compare_dma(m, hidden(1, 13))
    m32 = DynamicMaskAttention(32, 4, window_size=4).float()
    out = m32(torch.randn(2, 10, 32), attention_mask=torch.ones(2, 10, dtype=torch.bool))
    assert out.shape == (2, 10, 32) and torch.isfinite(out).all()


def test_dma_constructor_and_input_errors():
    with pytest.raises(ValueError, match="divisible"):
        DynamicMaskAttention(30, 4)
    with pytest.raises(ValueError, match="multiple"):
        DynamicMaskAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="window_size"):
        DynamicMaskAttention(32, 4, window_size=0)
    with pytest.raises(ValueError, match="dropout"):
        DynamicMaskAttention(32, 4, dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        DynamicMaskAttention(32, 4, dropout=True)
    with pytest.raises(ValueError, match="even"):
        DynamicMaskAttention(32, 4, head_dim=5)
    with pytest.raises(ValueError, match="unknown backend"):
        DynamicMaskAttention(32, 4, backend="nope")
    with pytest.raises(TypeError):
        DynamicMaskAttention(32.0, 4)
    assert DynamicMaskAttention(30, 4, head_dim=8).q_proj.out_features == 32  # explicit head_dim
    m = DynamicMaskAttention(32, 4)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="position_embeddings"):
        m(x, position_embeddings=(torch.ones(5, 4), torch.ones(5, 4)))
