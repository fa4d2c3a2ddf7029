"""The flex backend against the reference: forward on CPU (Flex has no CPU backward)."""
import pytest
import torch
from hypothesis import given, settings

from flash_dmattn import flex_dmattn_func
from flash_dmattn.block_map import tile_liveness

from cases import FIXED, cases
from naive import naive_attention


def check_flex_forward(case, dtype=torch.float64, tol=1e-9):
    q, k, v, mask, bias = case.tensors(dtype=dtype)
    out = flex_dmattn_func(q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    ref, _ = naive_attention(q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"{c.seqlen_q}x{c.seqlen_k}")
def test_fixed_cases(case):
    check_flex_forward(case)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_random_cases(case):
    check_flex_forward(case)


@settings(max_examples=10, deadline=None)
@given(cases(max_len=300))
def test_multi_tile_cases(case):
    # lengths over 128 put several flex tiles (dead / full / partial) in one call
    check_flex_forward(case, dtype=torch.float32, tol=2e-5)


def test_declines_gradients_on_cpu():
    q = torch.randn(1, 4, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        flex_dmattn_func(q, q.detach(), q.detach())


def test_declines_attn_probs():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="return_attn_probs"):
        flex_dmattn_func(q, q, q, return_attn_probs=True)


def test_tile_liveness_matches_dense_definition():
    torch.manual_seed(0)
    lq, lk, bq, bk = 70, 45, 16, 8
    for shape in [(2, 3, lq, lk), (2, 1, 1, lk), (1, 3, lq, 1), (1, 1, 1, 1)]:
        mask = torch.rand(*shape) > 0.7
        for causal in (False, True):
            live, full = tile_liveness(mask, lq, lk, bq, bk, causal)
            vis = mask.expand(2, 3, lq, lk)
            if causal:
                vis = vis & (torch.arange(lk) <= torch.arange(lq)[:, None] + lk - lq)
            nq, nk = -(-lq // bq), -(-lk // bk)
            pad = torch.zeros(2, 3, nq * bq, nk * bk, dtype=torch.bool)
            pad[..., :lq, :lk] = vis
            want_live = pad.unflatten(2, (nq, bq)).unflatten(4, (nk, bk)).any(5).any(3)
            inside = torch.zeros_like(pad)
            inside[..., :lq, :lk] = True
            want_full = (pad | ~inside).unflatten(2, (nq, bq)).unflatten(4, (nk, bk)).all(5).all(3)
            assert torch.equal(full.expand(2, 3, nq, nk), want_full)
            # live may be conservative (mask and causal reduced separately), never optimistic
            got_live = live.expand(2, 3, nq, nk)
            assert not (want_live & ~got_live).any()
            if not causal:
                assert torch.equal(got_live, want_live)
