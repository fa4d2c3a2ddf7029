"""Packed sequences: reference varlen against per-sequence dense calls (outputs and grads)."""
import pytest
import torch

from flash_dmattn import flash_dmattn_func, flash_dmattn_varlen_func
from flash_dmattn.utils.padding import cu_seqlens_from_lengths

H, HKV, D = 4, 2, 8


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("aux_heads", [None, 1, HKV, H])
def test_varlen_matches_per_sequence(causal, aux_heads):
    torch.manual_seed(0)
    lens_q, lens_k = [1, 7, 20, 0, 5], [3, 7, 25, 4, 5]  # length 1, odd, long, empty, Lq == Lk
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q), cu_seqlens_from_lengths(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, HKV, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, HKV, D, dtype=torch.float64, requires_grad=True)
    mask = bias = None
    if aux_heads is not None:
        shape = (tk,) if aux_heads == 1 else (aux_heads, tk)
        mask = torch.rand(shape) > 0.2
        bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                   attn_mask=mask, attn_bias=bias, is_causal=causal)
    assert out.shape == (tq, H, D)
    gout = torch.randn_like(out)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    got = torch.autograd.grad(out, leaves, gout)

    parts = []
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        m = None if mask is None else mask.view(-1, tk)[:, ks][None, :, None]
        b = None if bias is None else bias.view(-1, tk)[:, ks][None, :, None]
        if lens_q[i] == 0:
            continue
        parts.append((qs, flash_dmattn_func(q[None, qs], k[None, ks], v[None, ks], m, b, is_causal=causal)[0]))
    want_out = torch.zeros_like(out)
    for qs, o in parts:
        want_out = want_out.index_put((torch.arange(qs.start, qs.stop),), o)
    want = torch.autograd.grad(want_out, leaves, gout)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_varlen_no_cross_sequence_leakage():
    # Changing keys of sequence 1 must not change outputs of sequence 0.
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 8) for _ in range(3))
    out1 = flash_dmattn_varlen_func(q, k, v, cu, cu, 7, 7)
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 10
    v2[5:] -= 3
    out2 = flash_dmattn_varlen_func(q, k2, v2, cu, cu, 7, 7)
    torch.testing.assert_close(out1[:5], out2[:5], rtol=0, atol=0)
    assert not torch.allclose(out1[5:], out2[5:])


def test_varlen_lse_and_probs():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 8) for _ in range(3))
    out, lse, probs = flash_dmattn_varlen_func(q, k, v, cu, cu, 5, 5, is_causal=True, return_attn_probs=True)
    assert lse.shape == (2, 8) and probs.shape == (2, 2, 5, 5)
    torch.testing.assert_close(probs.sum(-1)[0, :, :3], torch.ones(2, 3))
