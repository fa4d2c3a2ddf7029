"""The torch-reference backend against an independent float64 formula (tests/naive.py)."""
import pytest
import torch
from hypothesis import given, settings

from flash_dmattn import flash_dmattn_func, reference_dmattn_func
from flash_dmattn.reference import attention as ref_mod

from cases import FIXED, Case, cases
from naive import naive_attention


def _grads(out, inputs, grad_out):
    needed = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(out, needed, grad_out)


def check_against_naive(case: Case, fn=reference_dmattn_func, dtype=torch.float64, tol=1e-9):
    q, k, v, mask, bias = case.tensors(dtype=dtype, requires_grad=True)
    out, lse, probs = fn(q, k, v, mask, bias, case.scale, case.causal, case.softcap,
                         return_attn_probs=True)
    ref_out, ref_lse = naive_attention(q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    assert lse.dtype == torch.float32  # docs/contract.md §3.1: lse is fp32; -inf rows must match too
    torch.testing.assert_close(lse, ref_lse.float(), atol=max(tol, 1e-5), rtol=max(tol, 2e-6))
    assert probs.shape == (case.batch, case.heads, case.seqlen_q, case.seqlen_k)
    grad_out = torch.randn_like(ref_out)
    got = _grads(out, (q, k, v, bias), grad_out.to(out.dtype))
    want = _grads(ref_out, (q, k, v, bias), grad_out)
    for name, a, b in zip("q k v bias".split(), got, want):
        assert a.shape == b.shape, name
        assert not a.isnan().any(), f"NaN in d{name}"
        torch.testing.assert_close(a.double(), b.double(), atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"{c.seqlen_q}x{c.seqlen_k}")
def test_fixed_cases_float64(case):
    check_against_naive(case)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_random_cases_float64(case):
    check_against_naive(case)


@settings(max_examples=25, deadline=None)
@given(cases())
def test_random_cases_float32(case):
    # fp32 accumulation over <= 40 keys: errors ~1e-6; 2e-5 leaves room without hiding bugs
    check_against_naive(case, dtype=torch.float32, tol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    case = FIXED[0]
    q, k, v, mask, bias = case.tensors(dtype=dtype)
    out = flash_dmattn_func(q, k, v, mask, bias, is_causal=True)
    ref, _ = naive_attention(q, k, v, mask, bias, causal=True)
    assert out.dtype == dtype
    # the output is rounded to 8 (bf16) / 11 (fp16) mantissa bits: |out| <~ 3 -> 2e-2 / 3e-3
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def test_chunked_path_matches(monkeypatch):
    # Force several query chunks so chunk boundaries (and q-indexed mask/bias rows) are hit.
    monkeypatch.setattr(ref_mod, "CHUNK_ELEMENTS", 4 * 65 * 4)
    check_against_naive(FIXED[0])
    check_against_naive(FIXED[1])


def test_fully_masked_rows_zero_output_and_grads():
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 3, :] = False
    bias = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    bias[..., 5, :] = float("-inf")
    bias.requires_grad_()
    out, lse, _ = reference_dmattn_func(q, k, v, mask, bias, return_attn_probs=True)
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3]))
    assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5]))
    assert torch.isneginf(lse[0, :, 3]).all() and torch.isneginf(lse[0, :, 5]).all()
    out.sum().backward()
    for t in (q, k, v, bias):
        assert not t.grad.isnan().any()
    assert torch.equal(q.grad[0, 3], torch.zeros_like(q.grad[0, 3]))
    assert torch.equal(bias.grad[0, :, 5], torch.zeros_like(bias.grad[0, :, 5]))


def test_dbias_is_reduced_to_bias_shape():
    b, h, hkv, l = 2, 4, 2, 12
    q = torch.randn(b, l, h, 8, dtype=torch.float64)
    k, v = (torch.randn(b, l, hkv, 8, dtype=torch.float64) for _ in range(2))
    for shape in [(b, hkv, 1, l), (1, 1, l, l), (b, 1, 1, l), (l,), (1, h, 1, 1), (hkv, l, l)]:
        # the same values as a full bias, so the reduced gradient must be the full one summed
        small = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        out = flash_dmattn_func(q, k, v, attn_bias=small, is_causal=True)
        gout = torch.randn_like(out)
        (g_small,) = torch.autograd.grad(out, small, gout)
        expanded = small.detach()
        while expanded.dim() < 4:
            expanded = expanded.unsqueeze(0)
        if expanded.shape[1] == hkv:
            expanded = expanded.repeat_interleave(h // hkv, 1)
        big = expanded.expand(b, h, l, l).clone().requires_grad_()
        (g_big,) = torch.autograd.grad(flash_dmattn_func(q, k, v, attn_bias=big, is_causal=True), big, gout)
        assert g_small.shape == small.shape and g_small.dtype == small.dtype
        torch.testing.assert_close(g_small, _reduce_to(g_big, small.shape, h, hkv), atol=1e-12, rtol=1e-10)


def _reduce_to(grad_full, shape, h, hkv):
    g = grad_full
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    if shape4[1] == hkv and hkv != h:
        g = g.unflatten(1, (hkv, h // hkv)).sum(2)
    return g.sum_to_size(shape4).reshape(shape)


def test_no_grad_forward_stores_nothing():
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    with torch.no_grad():
        out = flash_dmattn_func(q, q[:, :, :1].detach(), q[:, :, :1].detach())
    assert out.grad_fn is None


def test_only_requested_grads_are_computed():
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 8, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    out = flash_dmattn_func(q, k, v)
    out.sum().backward()
    assert k.grad is not None and q.grad is None and v.grad is None


def test_empty_key_sequence():
    q = torch.randn(1, 3, 2, 8)
    k = v = torch.randn(1, 0, 2, 8)
    out, lse, _ = reference_dmattn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_softmax_scale_zero_is_uniform():
    q, k, v = (torch.randn(1, 5, 1, 8, dtype=torch.float64) for _ in range(3))
    out = flash_dmattn_func(q, k, v, softmax_scale=0.0)
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True).expand_as(out))


def check_sdpa_path(case: Case, dtype=torch.float32, tol=2e-5, monkeypatch=None, bias_grad=True):
    """A call that auto-dispatch runs on CPU through PyTorch's fused attention over query chunks
    (flash_dmattn.reference.sdpa_cpu): output and every gradient against the naive float64
    formula, and the path really taken (or not: soft cap). ``bias_grad=False``: the bias is a
    constant, so SDPA's fused kernel runs (a mask that needs a gradient takes its math kernel)."""
    from flash_dmattn.backends import reference as backend_mod

    calls = []
    real = backend_mod.sdpa_cpu_attention
    monkeypatch.setattr(backend_mod, "sdpa_cpu_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, mask, bias = case.tensors(dtype=dtype, requires_grad=True)
    q64, k64, v64, mask, b64 = case.tensors(dtype=torch.float64, requires_grad=True)
    if not bias_grad and bias is not None:
        bias, b64 = bias.detach(), b64.detach()
    out = flash_dmattn_func(q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    assert bool(calls) == (case.softcap == 0.0)
    ref_out, _ = naive_attention(q64, k64, v64, mask, b64, case.scale, case.causal, case.softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    grad_out = torch.randn_like(ref_out)
    got = _grads(out, (q, k, v, bias), grad_out.to(out.dtype))
    want = _grads(ref_out, (q64, k64, v64, b64), grad_out)
    for name, a, b in zip("q k v bias".split(), got, want):
        assert not a.isnan().any(), f"NaN in d{name}"
        torch.testing.assert_close(a.double(), b, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"{c.seqlen_q}x{c.seqlen_k}")
def test_cpu_sdpa_path_fixed_cases(case, monkeypatch):
    from flash_dmattn.reference import sdpa_cpu

    check_sdpa_path(case, monkeypatch=monkeypatch)
    check_sdpa_path(case, monkeypatch=monkeypatch, bias_grad=False)
    # Several query chunks: chunk boundaries and per-query mask / bias rows.
    monkeypatch.setattr(sdpa_cpu, "CHUNK_ELEMENTS", 4 * 65 * 4)
    check_sdpa_path(case, monkeypatch=monkeypatch)
    # One SDPA call per query-head group member wherever the mask has one head per kv head.
    monkeypatch.setattr(sdpa_cpu, "PER_MEMBER_ELEMENTS", 0)
    check_sdpa_path(case, monkeypatch=monkeypatch)
    # A torch whose SDPA does not zero rows that see no key: the chunks zero them themselves.
    monkeypatch.setattr(sdpa_cpu, "_ZEROES_EMPTY_ROWS", {torch.float32: False})
    check_sdpa_path(case, monkeypatch=monkeypatch)
    monkeypatch.setattr(sdpa_cpu, "CHUNK_ELEMENTS", 1 << 23)
    monkeypatch.setattr(sdpa_cpu, "PER_MEMBER_ELEMENTS", 1 << 19)
    check_sdpa_path(case, monkeypatch=monkeypatch)
    check_sdpa_path(case, monkeypatch=monkeypatch, bias_grad=False)


def test_sdpa_zeroes_empty_rows_is_probed_once_without_touching_the_global_rng(monkeypatch):
    """The probe behind the unguarded chunks runs once per dtype, on its own generator (a
    seeded user's random stream is unchanged), and holds on the torch CI installs: rows that
    see no key cost no extra ops there."""
    from flash_dmattn.reference import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_ZEROES_EMPTY_ROWS", {})
    torch.manual_seed(3)
    want = torch.randn(4)
    torch.manual_seed(3)
    with torch.inference_mode():  # the probe still takes gradients
        assert sdpa_cpu.sdpa_zeroes_empty_rows(torch.float32) is True
    assert torch.equal(torch.randn(4), want)
    probes = []
    monkeypatch.setattr(sdpa_cpu, "_probe_empty_rows", lambda dtype: probes.append(dtype))
    assert sdpa_cpu.sdpa_zeroes_empty_rows(torch.float32) is True and probes == []


@settings(max_examples=40, deadline=None)
@given(cases())
def test_cpu_sdpa_path_random_cases(case):
    from flash_dmattn.reference import sdpa_cpu

    with pytest.MonkeyPatch.context() as mp:
        if case.seed % 2:
            # As on a torch whose SDPA does not zero rows that see no key.
            mp.setattr(sdpa_cpu, "_ZEROES_EMPTY_ROWS", {torch.float32: False})
        check_sdpa_path(case, monkeypatch=mp, bias_grad=case.seed % 3 != 0)


def test_cpu_sdpa_path_neg_inf_bias_rows_and_key_intervals(monkeypatch):
    """Rows hidden by a -inf bias on every key (no mask) give 0 and finite gradients; key
    intervals and GQA through the same path equal the float64 oracle."""
    from flash_dmattn import KeyIntervals

    q, k, v = (torch.randn(1, 12, h, 16, requires_grad=True) for h in (4, 2, 2))
    bias = torch.randn(1, 2, 12, 12)
    bias[..., 4, :] = float("-inf")
    bias.requires_grad_()
    out = flash_dmattn_func(q, k, v, attn_bias=bias)
    assert torch.equal(out[0, 4], torch.zeros_like(out[0, 4]))
    out.sum().backward()
    for t in (q, k, v, bias):
        assert not t.grad.isnan().any()
    j = torch.arange(12)
    ki = KeyIntervals(j, j + 3)
    b = torch.randn(1, 2, 1, 12, requires_grad=True)
    got = flash_dmattn_func(q, k, v, attn_mask=ki, attn_bias=b, is_causal=True)
    ref = reference_dmattn_func(*(t.detach().double() for t in (q, k, v)), attn_mask=ki,
                                attn_bias=b.detach().double(), is_causal=True)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mask_heads,bias_shape,causal,lq", [
    (2, (2, 2, 1, 40), True, 40),    # per-key top-W with its per-key bias: the DMA call
    (1, (1, 4, 1, 40), True, 23),    # one mask for all heads, a bias per query head, Lq < Lk
    (2, (2, 4, 31, 40), False, 31),  # a full bias per query head
    (2, None, True, 47),             # no bias, Lq > Lk: the first rows see nothing
])
def test_cpu_sdpa_path_gathers_the_kept_keys_of_a_sparse_per_key_mask(
        mask_heads, bias_shape, causal, lq, monkeypatch):
    """A mask with one row that keeps few keys runs over those keys alone (K/V, bias and key
    positions gathered): output and every gradient equal the float64 formula, padding rows
    included (batch 1 keeps no key at all on one kv head)."""
    from flash_dmattn.reference import sdpa_cpu

    gathered = []
    real = sdpa_cpu._gather_kept
    monkeypatch.setattr(sdpa_cpu, "_gather_kept", lambda *a: gathered.append(1) or real(*a))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, lq, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 40, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    score = torch.randn(2, mask_heads, 1, 40, generator=g)
    mask = score >= score.topk(9, dim=-1).values[..., -1:]  # 9 of 40 keys per (batch, head)
    mask[1, -1] = False
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g, requires_grad=True)
    # As is; in several chunks with one SDPA call per group member; on a torch whose SDPA
    # does not zero rows that see no key.
    for step in range(3):
        if step == 1:
            monkeypatch.setattr(sdpa_cpu, "CHUNK_ELEMENTS", 4 * 9 * 8)
            monkeypatch.setattr(sdpa_cpu, "PER_MEMBER_ELEMENTS", 0)
        if step == 2:
            monkeypatch.setattr(sdpa_cpu, "_ZEROES_EMPTY_ROWS", {torch.float32: False})
        out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal)
        leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        b64 = None if bias is None else bias.detach().double().requires_grad_()
        ref, _ = naive_attention(*leaves64, mask, b64, None, causal)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        grad_out = torch.randn_like(ref)
        got = _grads(out, (q, k, v, bias), grad_out.float())
        want = _grads(ref, (*leaves64, b64), grad_out)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4)
    assert len(gathered) == 3


def test_cpu_sdpa_path_ignores_nan_and_inf_bias_on_hidden_keys(monkeypatch):
    """A bias's NaN and +inf entries on keys that the causal diagonal or the mask hides reach
    nothing (the contract masks after adding the bias), forward and backward."""
    from flash_dmattn.reference import sdpa_cpu

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 12, h, 16, generator=g) for h in (4, 2, 2))
    bias = torch.randn(1, 2, 12, 12, generator=g)
    hidden = torch.ones(12, 12, dtype=torch.bool).triu(1)
    bias[..., hidden] = torch.tensor([float("nan"), float("inf")]).repeat(33)
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    mask[..., 3] = False
    bias[..., 3] = float("nan")
    for guard in (None, {torch.float32: False}):
        if guard is not None:
            monkeypatch.setattr(sdpa_cpu, "_ZEROES_EMPTY_ROWS", guard)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = flash_dmattn_func(*leaves[:3], attn_mask=mask, attn_bias=leaves[3], is_causal=True)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
        ref, _ = naive_attention(*ref_leaves[:3], mask, ref_leaves[3], None, True)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        grad_out = torch.randn_like(ref)
        got = torch.autograd.grad(out, leaves, grad_out.float())
        want = torch.autograd.grad(ref, ref_leaves, grad_out)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4)


def test_float64_and_softcap_stay_on_the_oracle():
    from flash_dmattn.inputs import AttentionInputs
    from flash_dmattn.reference.sdpa_cpu import sdpa_cpu_reasons

    q = torch.randn(1, 8, 2, 16)
    assert sdpa_cpu_reasons(AttentionInputs.from_args(q, q, q)) == []
    assert sdpa_cpu_reasons(AttentionInputs.from_args(q.double(), q.double(), q.double()))
    assert sdpa_cpu_reasons(AttentionInputs.from_args(q, q, q, softcap=5.0))
    h = q.half()
    assert sdpa_cpu_reasons(AttentionInputs.from_args(h, h, h, attn_bias=torch.randn(8, 8)))


def test_cpu_sdpa_path_causal_with_softmax_scale_zero():
    """softmax_scale 0 makes every visible key equally likely; causal rows average their
    prefix's values (SDPA's own causal path would give NaN: it scales its -inf by 0)."""
    q, k, v = (torch.randn(1, 9, h, 8) for h in (4, 2, 2))
    out = flash_dmattn_func(q, k, v, softmax_scale=0.0, is_causal=True)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), None, None, 0.0, True, 0.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
