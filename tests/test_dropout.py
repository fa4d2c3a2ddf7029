"""Attention dropout: the random stream, the reference, the Triton kernels and the declines.

Every implementation keeps entry ``(b, h, i, j)`` by a pure function of the call's ``(seed,
offset)`` and those coordinates (:mod:`flash_dmattn.dropout`), and
:func:`flash_dmattn.testing.dropout_mask` rebuilds it. So outputs and every gradient are
compared with a dense float64 formula run on that same mask; the stream itself gets
known-answer and statistical tests (keep rate within its binomial bound, no agreement beyond
chance across heads, batches, calls and query / key tiles).

The Triton tests run the kernels on CPU tensors under ``TRITON_INTERPRET=1`` (16x16 tiles),
or compiled on a GPU; either way against the float64 formula on the call's mask.
"""
import math

import pytest
import torch

from interpreter_only import skip_unless_available, triton_kernels_skip_reason
from naive import assert_close, expand_heads

from flash_dmattn import (
    KeyIntervals,
    flash_dmattn_func,
    flash_dmattn_func_auto,
    flash_dmattn_varlen_func,
    registry,
    testing,
)
from flash_dmattn.dropout import dense_keep_mask, keep_threshold, philox, philox4x32
from flash_dmattn.inputs import AttentionInputs, VarlenInputs


def dense_dropout_attention(q, k, v, keep, p, mask=None, bias=None, scale=None, causal=False,
                            softcap=0.0):
    """Float64 ``(B, Lq, H, D)`` attention with ``P`` replaced by ``P * keep / (1 - p)``;
    ``keep`` a bool ``(B, H, Lq, Lk)``. Differentiable in q, k, v and bias."""
    q, k, v = q.double(), k.double(), v.double()
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(g, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + expand_heads(bias.double(), B, H, Hkv, Lq, Lk)
    visible = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if mask is not None:
        visible = visible & expand_heads(mask, B, H, Hkv, Lq, Lk)
    if causal:
        visible = visible & torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    s = s.masked_fill(~visible, float("-inf"))
    live = visible.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(live, s, torch.zeros_like(s)), -1) * live
    probs = probs * keep.to(probs.device) / (1.0 - p)
    return torch.einsum("bhij,bjhd->bihd", probs, v.repeat_interleave(g, 2))


def leaves(*shapes, dtype=torch.float64, device="cpu", gen=None):
    return [torch.randn(s, generator=gen).to(dtype=dtype, device=device).requires_grad_()
            for s in shapes]


def call_with_mask(fn, seed, q, k, v, p, **kw):
    """``fn(q, k, v, dropout_p=p, **kw)`` after ``torch.manual_seed(seed)``, and the keep-mask
    that call used."""
    B, Lq, H, _ = q.shape
    Lk = k.shape[1]
    torch.manual_seed(seed)
    rng = testing.dropout_rng(q.device)
    torch.manual_seed(seed)
    out = fn(q, k, v, dropout_p=p, **kw)
    return out, testing.dropout_mask(rng, B, H, Lq, Lk, p)


def check_against_dense(out, keep, p, tensors, tol, **kw):
    """``out`` and the gradients of ``tensors`` (q, k, v, bias or None) against the float64
    formula on ``keep``."""
    q, k, v, bias = tensors
    ref_in = [t.detach().double().cpu().requires_grad_() if t is not None else None
              for t in tensors]
    ref = dense_dropout_attention(*ref_in[:3], keep.cpu(), p, bias=ref_in[3], **kw)
    assert_close("out", out.detach().cpu(), ref.detach(), tol)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = torch.autograd.grad(out, [t for t in tensors if t is not None],
                              dout.to(out.dtype).to(out.device))
    want = torch.autograd.grad(ref, [t for t in ref_in if t is not None], dout)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert a.shape == b.shape, name
        assert_close(name, a.detach().cpu(), b, tol)


# --- The random stream -----------------------------------------------------------------------

@pytest.mark.parametrize("rounds", [7, 10])
def test_philox_known_answers(rounds):
    # Random123's known-answer vectors of Philox4x32-7 (the stream's) and -10:
    # (key), (counter) -> four words.
    ones, pi_key, pi_ctr = (0xFFFFFFFF,) * 2, (0xA4093822, 0x299F31D0), (
        0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    want = {
        7: [(0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48),
            (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662),
            (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)],
        10: [(0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8),
             (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
             (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)],
    }[rounds]
    cases = zip([(0, 0), ones, pi_key], [(0, 0, 0, 0), (0xFFFFFFFF,) * 4, pi_ctr], want)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    for key, ctr, words in cases:
        got = philox4x32(t(key[0]), t(key[1]), *map(t, ctr), rounds=rounds)
        assert [int(w) for w in got] == list(words)
    # The stream's generator is Philox4x32-7 keyed by the 64-bit seed, low word first.
    assert int(philox(t(0x299F31D0A4093822), *map(t, pi_ctr))) == 0x4DFCCABA


def test_rng_comes_from_torch_generator_and_advances():
    torch.manual_seed(3)
    a, b = testing.dropout_rng("cpu"), testing.dropout_rng("cpu")
    torch.manual_seed(3)
    assert torch.equal(testing.dropout_rng("cpu"), a)
    assert not torch.equal(a, b)
    assert a.dtype == torch.int64 and a.shape == (2,)
    assert 0 <= int(a.min()) and int(a.max()) < 2 ** 62


def test_mask_is_a_function_of_coordinates():
    # A call with fewer batches, rows or keys (and as many heads: the counter holds
    # batch * heads + head) has a sub-block of the mask: nothing depends on the lengths, the
    # chunking or the tiling, only on (batch, head, row, key).
    rng = torch.tensor([123456789, 987654], dtype=torch.int64)
    big = testing.dropout_mask(rng, 3, 4, 40, 50, 0.3)
    assert torch.equal(testing.dropout_mask(rng, 2, 4, 17, 23, 0.3), big[:2, :, :17, :23])
    rows = dense_keep_mask(rng, 0.3, 3, 4, 40, 50, rows=slice(16, 32))
    assert torch.equal(rows, big[:, :, 16:32])
    # Entry (b, h, i, j) reads byte i % 4 of word (i % 16) // 4 of Philox at counter
    # (j, i // 16, b * H + h, offset), kept iff it reaches round(p * 256).
    assert keep_threshold(0.5) == 128 and keep_threshold(0.0) == 0
    assert keep_threshold(0.1) == 26 and keep_threshold(0.3) == 77
    assert keep_threshold(1 / 512 - 1e-9) == 0 and keep_threshold(1 - 1 / 512 + 1e-9) == 256
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    for b, h, i, j in ((0, 0, 0, 0), (2, 3, 39, 49), (1, 2, 17, 13), (0, 1, 5, 8),
                       (1, 1, 20, 31), (2, 0, 7, 36)):
        words = philox4x32(t(123456789), t(0), t(j), t(i // 16), t(b * 4 + h), t(987654))
        byte = (int(words[(i % 16) // 4]) >> (8 * (i % 4))) & 0xFF
        assert bool(big[b, h, i, j]) == (byte >= keep_threshold(0.3))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.03])
def test_keep_rate_within_binomial_bound(p):
    torch.manual_seed(0)
    keep = testing.dropout_mask(testing.dropout_rng("cpu"), 2, 4, 64, 96, p)
    # The keep rate is 1 - p with p rounded to a multiple of 1/256 (8-bit random numbers).
    pq = keep_threshold(p) / 256
    assert abs(pq - p) <= 1 / 512

    def check(k):
        # Six standard deviations of the binomial: a false alarm has odds ~1e-9.
        rate = k.double().mean().item()
        assert abs(rate - (1 - pq)) <= 6 * math.sqrt(pq * (1 - pq) / k.numel()), rate

    check(keep)
    # Each of the 16 query rows one Philox evaluation serves (its 16 bytes) keeps at that rate.
    for slot in range(16):
        check(keep[:, :, slot::16])


def _agreement_is_chance(a, b, p):
    """Two keep-masks agree on a fraction of entries within 6 sigma of independent draws'
    ``(1-p)^2 + p^2`` (``p`` rounded as the keep rate is), and their correlation is within
    6 / sqrt(n) of 0."""
    n = a.numel()
    p = keep_threshold(p) / 256
    expect = (1 - p) ** 2 + p ** 2
    agree = (a == b).double().mean().item()
    assert abs(agree - expect) <= 6 * math.sqrt(expect * (1 - expect) / n), (agree, expect)
    x, y = a.double().flatten(), b.double().flatten()
    corr = ((x - x.mean()) * (y - y.mean())).mean() / (x.std() * y.std())
    assert abs(corr.item()) <= 6 / math.sqrt(n), corr


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_independence_across_heads_batches_calls_and_tiles(p):
    torch.manual_seed(1)
    rng1, rng2 = testing.dropout_rng("cpu"), testing.dropout_rng("cpu")
    a = testing.dropout_mask(rng1, 2, 2, 128, 128, p)
    b = testing.dropout_mask(rng2, 2, 2, 128, 128, p)
    _agreement_is_chance(a[:, 0], a[:, 1], p)                  # heads
    _agreement_is_chance(a[0], a[1], p)                        # batches
    _agreement_is_chance(a, b, p)                              # calls
    _agreement_is_chance(a[:, :, :64], a[:, :, 64:], p)        # query tiles
    _agreement_is_chance(a[..., :64], a[..., 64:], p)          # key tiles
    _agreement_is_chance(a[:, :, 1:, 1:], a[:, :, :-1, :-1], p)  # diagonal neighbours
    _agreement_is_chance(a[:, :, :, 16:], a[:, :, :, :-16], p)  # a tile width apart
    _agreement_is_chance(a[:, :, 16:], a[:, :, :-16], p)        # a row group apart
    # Rows that share a Philox evaluation (16 consecutive query rows of one key): neighbouring
    # bytes of one word, the same byte of neighbouring words, the first and last byte of the
    # group; and neighbouring keys (neighbouring counters).
    _agreement_is_chance(a[:, :, 1:], a[:, :, :-1], p)
    _agreement_is_chance(a[:, :, 4:], a[:, :, :-4], p)
    _agreement_is_chance(a[:, :, 15::16], a[:, :, 0::16], p)
    _agreement_is_chance(a[..., 1:], a[..., :-1], p)


# --- Validation, declines and dispatch -------------------------------------------------------

@pytest.mark.parametrize("bad, exc", [(-0.1, ValueError), (1.0, ValueError),
                                      (float("nan"), ValueError), (True, TypeError),
                                      ("0.1", TypeError)])
def test_dropout_p_validated(bad, exc):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(exc, match="dropout_p"):
        flash_dmattn_func(q, q, q, dropout_p=bad)


def test_no_rng_drawn_without_dropout():
    q = torch.randn(1, 4, 2, 8)
    torch.manual_seed(5)
    inputs = AttentionInputs.from_args(q, q, q)
    assert inputs.dropout_p == 0.0 and inputs.dropout_rng is None
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)  # the generator did not move


def test_backends_decline_dropout_with_a_reason():
    q = torch.randn(1, 8, 2, 16)
    inputs = AttentionInputs.from_args(q, q, q, dropout_p=0.1)
    assert "dropout_p=0.1" in inputs.describe()
    flex = registry._BACKENDS["flex"]
    assert any("dropout" in r for r in flex.not_supported_reasons(inputs))
    if "cuda" in registry._BACKENDS:
        # The cuda kernels' dropout covers dense calls and packed sequences on Hopper
        # (tests/test_cuda_dropout.py): no dropout reason for a packed call of a head dim the
        # sm_90 backward takes.
        cuda = registry._BACKENDS["cuda"]
        packed = VarlenInputs.from_args(q[0], q[0], q[0], torch.tensor([0, 8]), torch.tensor([0, 8]),
                                        8, 8, dropout_p=0.1)
        assert not any("dropout" in r for r in cuda.varlen_not_supported_reasons(packed))
    with pytest.raises(ValueError, match="dropout"):
        flash_dmattn_func_auto("flex")(q, q, q, dropout_p=0.1)
    # The reference runs it (its CPU fast path, SDPA, has another random stream: not taken).
    from flash_dmattn.reference.sdpa_cpu import sdpa_cpu_reasons
    assert any("dropout" in r for r in sdpa_cpu_reasons(inputs))
    assert flash_dmattn_func_auto("torch-reference")(q, q, q, dropout_p=0.1).shape == q.shape


# --- The reference -----------------------------------------------------------------------------

# (B, Lq, Lk, H, Hkv, D, causal, softcap, mask spec, bias spec)
REF_CASES = [
    (2, 7, 11, 4, 2, 8, True, 0.0, None, "BK1L"),
    (1, 13, 5, 2, 2, 16, False, 5.0, "B1QL", "BHQL"),
    (2, 9, 9, 6, 1, 8, True, 0.0, "B11L", None),
]


def _aux(spec, B, H, Hkv, Lq, Lk, gen, kind):
    if spec is None:
        return None
    dims = {"B": B, "H": H, "K": Hkv, "Q": Lq, "L": Lk, "1": 1}
    shape = tuple(dims[c] for c in spec)
    if kind == "mask":
        m = torch.rand(shape, generator=gen) > 0.3
        m[..., 0] = True  # no empty rows to keep the comparison about dropout
        return m
    return torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: "b{}q{}k{}h{}kv{}".format(*c[:5]))
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_reference_matches_dense_formula_on_the_calls_mask(case, p):
    B, Lq, Lk, H, Hkv, D, causal, softcap, mspec, bspec = case
    gen = torch.Generator().manual_seed(2)
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), gen=gen)
    mask = _aux(mspec, B, H, Hkv, Lq, Lk, gen, "mask")
    bias = _aux(bspec, B, H, Hkv, Lq, Lk, gen, "bias")
    out, keep = call_with_mask(flash_dmattn_func, 4, q, k, v, p, attn_mask=mask, attn_bias=bias,
                               is_causal=causal, softcap=softcap)
    assert 0 < keep.double().mean().item() < 1
    check_against_dense(out, keep, p, (q, k, v, bias), 1e-12, mask=mask, causal=causal,
                        softcap=softcap)


def test_reference_float32_cpu_path_uses_the_same_mask():
    # float32 on CPU would take SDPA; with dropout it must take the oracle on the same mask.
    gen = torch.Generator().manual_seed(3)
    q, k, v = leaves((2, 10, 4, 16), (2, 12, 2, 16), (2, 12, 2, 16), dtype=torch.float32, gen=gen)
    out, keep = call_with_mask(flash_dmattn_func, 8, q, k, v, 0.3, is_causal=True)
    check_against_dense(out, keep, 0.3, (q, k, v, None), 2e-5, causal=True)


def test_same_seed_same_result_and_calls_differ():
    gen = torch.Generator().manual_seed(4)
    q, k, v = leaves((1, 9, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8), gen=gen)
    runs = []
    for seed in (6, 6):
        torch.manual_seed(seed)
        out = flash_dmattn_func(q, k, v, dropout_p=0.4, deterministic=True)
        runs.append((out, torch.autograd.grad(out.sum(), (q, k, v))))
        runs.append(flash_dmattn_func(q, k, v, dropout_p=0.4))  # the next call: a new mask
    (o1, g1), n1, (o2, g2), n2 = runs
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert torch.equal(n1, n2) and not torch.equal(o1, n1)


def test_varlen_reference_per_sequence_masks():
    lens_q, lens_k = [3, 0, 9, 5], [4, 2, 9, 7]
    H, Hkv, D, p = 4, 2, 8, 0.3
    gen = torch.Generator().manual_seed(5)
    q, k, v = leaves((sum(lens_q), H, D), (sum(lens_k), Hkv, D), (sum(lens_k), Hkv, D), gen=gen)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k).cumsum(0).int()
    torch.manual_seed(9)
    rng = testing.dropout_rng("cpu")
    torch.manual_seed(9)
    out = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True,
                                   dropout_p=p)
    keep = testing.dropout_mask(rng, len(lens_q), H, max(lens_q), max(lens_k), p)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = []
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        refs.append(dense_dropout_attention(q[None, qs], k[None, ks], v[None, ks],
                                            keep[i:i + 1, :, :lens_q[i], :lens_k[i]], p,
                                            causal=True)[0])
    ref = torch.cat(refs)
    assert_close("out", out.detach(), ref.detach(), 1e-12)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(name, a, b, 1e-12)


def test_compiles_without_graph_breaks_and_matches_eager():
    gen = torch.Generator().manual_seed(6)
    q, k, v = leaves((1, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8), dtype=torch.float32, gen=gen)

    def f(q, k, v):
        return flash_dmattn_func(q, k, v, is_causal=True, dropout_p=0.25)

    torch.manual_seed(10)
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager.square().sum(), (q, k, v))
    torch.manual_seed(10)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(compiled.square().sum(), (q, k, v))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


# --- The Triton kernels ------------------------------------------------------------------------

TRITON_SKIP = triton_kernels_skip_reason()
needs_kernels = pytest.mark.skipif(TRITON_SKIP is not None, reason=str(TRITON_SKIP))
KDEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 under the interpreter (the kernels accumulate in fp32: ~1e-6); fp16 compiled on a GPU,
# where P and dS are rounded to fp16 before their dots (tests/test_triton_kernels.py).
KDTYPE = torch.float32 if KDEV == "cpu" else torch.float16
KTOL = {torch.float32: 2e-5, torch.float16: 4e-3}[KDTYPE]


@pytest.fixture
def poisoned(monkeypatch):
    # Kernel-written outputs start as NaN: anything the kernels forget to write shows up.
    from flash_dmattn.backends.triton import common

    monkeypatch.setattr(common, "DEBUG_POISON", True)


def _spy_forward_launches(monkeypatch):
    """The meta flags of every forward kernel launch, in order."""
    from flash_dmattn.backends.triton import forward_kernel

    seen = []
    for name in ("launch_fwd", "launch_fwd_untuned"):
        real = getattr(forward_kernel, name)

        def launch(grid, args, meta, real=real):
            seen.append(dict(meta))
            return real(grid, args, meta)
        monkeypatch.setattr(forward_kernel, name, launch)
    return seen


# (name, B, Lq, Lk, H, Hkv, D, causal, softcap, mask spec, bias spec, expected forward path)
KERNEL_CASES = [
    ("dense", 2, 19, 23, 4, 2, 16, False, 0.0, None, "BHQL", dict(USE_LIST=False)),
    ("causal-lists", 1, 37, 29, 2, 1, 24, True, 3.0, None, "BK1L", dict(USE_LIST=True)),
    ("per-query-mask", 2, 21, 35, 2, 2, 16, False, 0.0, "B1QL", "11QL", dict(USE_LIST=True)),
    ("per-key-mask-bits", 1, 33, 40, 4, 2, 16, True, 0.0, "BK1L", "1K1L", dict(MASK_BITS=1)),
]


@needs_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c[0])
def test_triton_matches_dense_formula_on_the_calls_mask(case, poisoned, monkeypatch):
    name, B, Lq, Lk, H, Hkv, D, causal, softcap, mspec, bspec, path = case
    seen = _spy_forward_launches(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), dtype=KDTYPE, device=KDEV,
                     gen=gen)
    mask = _aux(mspec, B, H, Hkv, Lq, Lk, gen, "mask")
    bias = _aux(bspec, B, H, Hkv, Lq, Lk, gen, "bias")
    if mask is not None:
        mask = mask.to(KDEV)
    if bias is not None:
        bias = bias.detach().to(KDEV, KDTYPE).requires_grad_()
    fn = flash_dmattn_func_auto("triton")
    out, keep = call_with_mask(fn, 11, q, k, v, 0.3, attn_mask=mask, attn_bias=bias,
                               is_causal=causal, softcap=softcap)
    assert seen and all(m["DROPOUT"] for m in seen)
    assert all(seen[0][key] == want for key, want in path.items()), seen[0]
    check_against_dense(out, keep, 0.3, (q, k, v, bias), KTOL,
                        mask=None if mask is None else mask.cpu(), causal=causal,
                        softcap=softcap)


@needs_kernels
def test_triton_gathered_keys_and_other_tiles_use_the_same_mask(poisoned, monkeypatch):
    # The gathered-key forward / dQ and a forward with other tile shapes: the mask is the
    # coordinates', not the tiles'.
    from flash_dmattn.backends.triton import forward as fwd_mod
    from flash_dmattn.planning import gather

    monkeypatch.setattr(gather, "_FORCED_POLICY", "always")
    seen = _spy_forward_launches(monkeypatch)
    B, Lq, Lk, H, Hkv, D = 1, 33, 45, 2, 1, 16
    gen = torch.Generator().manual_seed(8)
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), dtype=KDTYPE, device=KDEV,
                     gen=gen)
    mask = (torch.rand(B, 1, Lq, Lk, generator=gen) > 0.6).to(KDEV)
    mask[..., 0] = True
    fn = flash_dmattn_func_auto("triton")
    out, keep = call_with_mask(fn, 12, q, k, v, 0.5, attn_mask=mask, is_causal=True)
    assert seen[0]["GATHER"]
    check_against_dense(out, keep, 0.5, (q, k, v, None), KTOL, mask=mask.cpu(), causal=True)
    # Forward tiles of 32 x 16 instead: the same output as the formula on the same mask.
    monkeypatch.setattr(gather, "_FORCED_POLICY", "never")
    bm, bn = fwd_mod.fwd_blocks(D)
    monkeypatch.setattr(fwd_mod, "fwd_blocks", lambda d: (2 * bm, bn))
    torch.manual_seed(12)
    again = fn(q, k, v, attn_mask=mask, is_causal=True, dropout_p=0.5)
    assert seen[-1]["BLOCK_M"] == 2 * bm
    ref = dense_dropout_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), keep.cpu(),
                                  0.5, mask=mask.cpu(), causal=True)
    assert_close("out", again.detach().cpu(), ref, KTOL)


@needs_kernels
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 64), (64, 16)])
def test_triton_keep_tiles_of_several_row_groups(block_m, block_n):
    # The kernels' tiles hold several 16-row groups (the interpreter's 16x16 tiles hold one)
    # and any keys (key tiles, gathered lists, key-interval picks): the packed bits expand to
    # the mask's own entries, in both orientations, at any tile start.
    from triton_keep_tiles import keep_tiles_kernel as kernel

    p, B, H, Lq, Lk = 0.3, 2, 3, 160, 4 * block_n
    rng = torch.tensor([0x1234_5678_9ABC, 4242], dtype=torch.int64)
    full = dense_keep_mask(rng, p, B, H, Lq, Lk)
    gen = torch.Generator().manual_seed(5)
    scattered = torch.randperm(Lk, generator=gen)[:block_n].sort().values
    for b, h, start_m, cols in ((0, 0, 0, torch.arange(block_n)),
                                (1, 2, 16, torch.arange(block_n, 2 * block_n)),
                                (1, 1, 32, torch.arange(3 * block_n, 4 * block_n)),
                                (0, 2, 96, scattered), (1, 0, 48, scattered.flip(0))):
        out = torch.zeros(block_m, block_n, dtype=torch.int8, device=KDEV)
        out_t = torch.zeros(block_n, block_m, dtype=torch.int8, device=KDEV)
        out_e = torch.zeros(block_m, block_n, dtype=torch.int8, device=KDEV)
        kernel[(1,)](rng.to(KDEV), cols.int().to(KDEV), out, out_t, out_e, start_m, b * H + h,
                     keep_threshold(p), BM=block_m, BN=block_n)
        want = full[b, h, start_m:start_m + block_m][:, cols]
        assert torch.equal(out_e.cpu().bool(), want)
        assert torch.equal(out.cpu().bool(), want)
        assert torch.equal(out_t.cpu().bool(), want.T)


@needs_kernels
def test_triton_word_bits_every_byte_and_threshold():
    # The kernels compare a Philox word's four bytes with the threshold inside the word (no
    # byte extraction): every byte value in every position, at every threshold 0..256, gives
    # the bytes' own comparisons.
    from triton_keep_tiles import word_bits_kernel as kernel

    n = 1024
    gen = torch.Generator().manual_seed(11)
    words = torch.randint(0, 2 ** 32, (n,), generator=gen, dtype=torch.int64)
    every = torch.arange(256)
    words[:256] = every * 0x01010101
    words[256:512] = every | (every.flip(0) << 8) | ((every * 7 % 256) << 16) | (
        (every * 131 % 256) << 24)
    as_int32 = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    byte = [(words >> (8 * b)) & 0xFF for b in range(4)]
    for thresh in range(257):
        out = torch.full((n,), -1, dtype=torch.int32, device=KDEV)
        kernel[(1,)](as_int32.to(KDEV), out, thresh, N=n)
        want = sum((byte[b] >= thresh).long() << b for b in range(4))
        assert torch.equal(out.cpu().long(), want), thresh


def check_varlen_per_sequence_masks(backend, device, dtype, tol, lens_q=(5, 0, 19, 1),
                                    lens_k=(7, 3, 21, 1), head_dim=16, seed=9):
    """Packed sequences with dropout (causal, a per-key bias with its gradient) on ``backend``
    against the reference run sequence by sequence on the call's keep-mask: sequence ``s``
    draws batch entry ``s``'s mask, rows and keys counted from the sequence's start."""
    lens_q, lens_k = list(lens_q), list(lens_k)
    H, Hkv, D, p = 4, 2, head_dim, 0.3
    gen = torch.Generator().manual_seed(seed)
    q, k, v = leaves((sum(lens_q), H, D), (sum(lens_k), Hkv, D), (sum(lens_k), Hkv, D),
                     dtype=dtype, device=device, gen=gen)
    bias = torch.randn(Hkv, sum(lens_k), generator=gen).to(device, dtype).requires_grad_()
    cu_q = torch.tensor([0] + lens_q).cumsum(0).int().to(device)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).int().to(device)
    inputs_args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    torch.manual_seed(13)
    rng = testing.dropout_rng(device)
    torch.manual_seed(13)
    inputs = VarlenInputs.from_args(*inputs_args, attn_bias=bias, is_causal=True, dropout_p=p)
    out = registry.check_explicit(registry.get_backend(backend), inputs).varlen_attention(inputs)
    keep = testing.dropout_mask(rng, len(lens_q), H, max(lens_q), max(lens_k), p).cpu()
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, bias), dout.to(out.dtype).to(device))
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, bias)]
    refs = []
    for i in range(len(lens_q)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        refs.append(dense_dropout_attention(
            ref_in[0][None, qs], ref_in[1][None, ks], ref_in[2][None, ks],
            keep[i:i + 1, :, :lens_q[i], :lens_k[i]], p, bias=ref_in[3][None, :, None, ks],
            causal=True)[0])
    ref = torch.cat(refs)
    assert_close("out", out.detach().cpu(), ref.detach(), tol)
    want = torch.autograd.grad(ref, ref_in, dout)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(name, a.detach().cpu(), b, tol)


@needs_kernels
def test_triton_varlen_matches_the_per_sequence_masks(poisoned):
    check_varlen_per_sequence_masks("triton", KDEV, KDTYPE, KTOL)


@needs_kernels
def test_triton_key_intervals_use_the_same_mask(poisoned):
    B, Lq, Lk, H, Hkv, D, p = 2, 19, 23, 4, 2, 16, 0.25
    gen = torch.Generator().manual_seed(10)
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), dtype=KDTYPE, device=KDEV,
                     gen=gen)
    bias = torch.randn(B, Hkv, 1, Lk, generator=gen).to(KDEV, KDTYPE).requires_grad_()
    start = torch.randint(0, Lk, (B, Hkv, Lk), generator=gen)
    end = start + torch.randint(1, 12, (B, Hkv, Lk), generator=gen)
    intervals = KeyIntervals(start.int().to(KDEV), end.int().to(KDEV))
    fn = flash_dmattn_func_auto("triton")
    out, keep = call_with_mask(fn, 14, q, k, v, p, attn_mask=intervals, attn_bias=bias,
                               is_causal=True)
    dense = intervals.to_dense(Lq).cpu()
    check_against_dense(out, keep, p, (q, k, v, bias), KTOL, mask=dense, causal=True)


@needs_kernels
def test_triton_deterministic_is_bitwise_with_dropout():
    gen = torch.Generator().manual_seed(11)
    B, Lq, Lk, H, Hkv, D = 2, 17, 20, 2, 1, 16
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), dtype=KDTYPE, device=KDEV,
                     gen=gen)
    # A bias shared across batches: its gradient is the one that would use atomics.
    bias = torch.randn(1, 1, Lq, Lk, generator=gen).to(KDEV, KDTYPE).requires_grad_()
    fn = flash_dmattn_func_auto("triton")
    runs = []
    for _ in range(2):
        torch.manual_seed(15)
        out = fn(q, k, v, attn_bias=bias, is_causal=True, deterministic=True, dropout_p=0.4)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, bias))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@needs_kernels
def test_triton_declines_dropout_with_a_kv_cache():
    q = torch.randn(1, 1, 2, 16, device=KDEV, dtype=KDTYPE)
    k = torch.randn(1, 32, 2, 16, device=KDEV, dtype=KDTYPE)
    lens = torch.tensor([20], dtype=torch.int32, device=KDEV)
    inputs = AttentionInputs.from_args(q, k, k, cache_seqlens=lens, dropout_p=0.1)
    reasons = registry._BACKENDS["triton"].not_supported_reasons(inputs)
    assert any("dropout with a KV cache" in r for r in reasons)
    # A decode-shaped call without a cache takes the dropout forward, not the split-KV kernel.
    out = flash_dmattn_func_auto("triton")(q, k, k, dropout_p=0.1)
    assert out.shape == q.shape and not out.isnan().any()


@needs_kernels
def test_triton_two_kernel_per_key_forward_keeps_the_mask(poisoned, monkeypatch):
    # A per-key mask whose uncut rows run without the mask and whose cut rows run again in a
    # second kernel (flash_dmattn.planning.plain_rows): both draw the same keep-mask.
    from flash_dmattn.planning import plain_rows

    monkeypatch.setattr(plain_rows, "_FORCED", True)
    seen = _spy_forward_launches(monkeypatch)
    B, Lq, Lk, H, Hkv, D, p = 2, 40, 48, 2, 2, 16, 0.3
    gen = torch.Generator().manual_seed(12)
    blocks = (torch.rand(B, Hkv, 1, 3, generator=gen) < 0.5).repeat_interleave(16, -1)
    blocks[..., :16] = True
    scattered = torch.rand(B, Hkv, 1, Lk, generator=gen) < 0.3
    scattered[..., : Lk // 2] = False
    scattered[:, 0] = False
    mask = (blocks | scattered).to(KDEV)  # head 0: whole tiles (uncut rows); head 1: cut rows
    q, k, v = leaves((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D), dtype=KDTYPE, device=KDEV,
                     gen=gen)
    fn = flash_dmattn_func_auto("triton")
    out, keep = call_with_mask(fn, 16, q, k, v, p, attn_mask=mask, is_causal=True)
    assert [int(m.get("CUT_ROWS", False)) for m in seen] == [0, 1]
    check_against_dense(out, keep, p, (q, k, v, None), KTOL, mask=mask.cpu(), causal=True)


@pytest.mark.gpu
def test_triton_dropout_in_a_cuda_graph():
    """The rng draw and the kernels captured in a CUDA graph: every replay draws new numbers
    from the device's generator, and its output is the formula on the mask of what it drew."""
    skip_unless_available("triton")
    from flash_dmattn.backends.triton.backend import triton_op
    from flash_dmattn.dropout import draw_rng

    B, L, H, Hkv, D, p = 1, 256, 4, 2, 64, 0.2
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, L, H, D, device="cuda", generator=g).half()
    k = torch.randn(B, L, Hkv, D, device="cuda", generator=g).half()
    v = torch.randn(B, L, Hkv, D, device="cuda", generator=g).half()

    def step():
        rng = draw_rng("cuda")
        out, _ = triton_op()(q, k, v, None, None, D ** -0.5, True, 0.0, dropout_p=p,
                             dropout_rng=rng)
        return rng, out

    for _ in range(3):  # compile and tune outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rng, out = step()
    check_graph_replays(graph, rng, out, q, k, v, p)


def check_graph_replays(graph, rng, out, q, k, v, p):
    """Two replays of a captured causal call with dropout: each draws a new ``rng`` and its
    ``out`` is the float64 formula on the mask of that draw."""
    B, L, H = q.shape[0], q.shape[1], q.shape[2]
    seen = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = testing.dropout_mask(rng, B, H, L, k.shape[1], p).cpu()
        ref = dense_dropout_attention(q.cpu(), k.cpu(), v.cpu(), keep, p, causal=True)
        assert_close("out", out.cpu(), ref, 4e-3)
        seen.append(rng.clone())
    assert not torch.equal(seen[0], seen[1])
