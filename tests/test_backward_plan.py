"""The forward plans the backward (tile lists, dQ gather) and hands the plan over on the eager
autograd path; the backward must give bit-for-bit what it gives when it plans itself, and the
custom-op path (compile / tracing) must still plan for itself."""

import pytest
import torch

from interpreter_only import require_triton_interpreter

require_triton_interpreter()

from flash_dmattn.backends.triton import common  # noqa: E402
from flash_dmattn.backends.triton import forward as fwd_mod  # noqa: E402
from flash_dmattn.backends.triton.backend import triton_op  # noqa: E402
from flash_dmattn.backends.triton.backward import attention_backward  # noqa: E402
from flash_dmattn.backends.triton.forward import attention_forward  # noqa: E402
from flash_dmattn.planning.plan import BackwardPlan  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(common, "DEBUG_POISON", True)


def _topk_mask(B, Hm, Lq, Lk, keep, causal, g):
    score = torch.randn(B, Hm, 1, Lk, generator=g).expand(B, Hm, Lq, Lk).clone()
    vis = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq) if causal else None
    if causal:
        score = score.masked_fill(~vis, float("-inf"))
    top = score.topk(min(keep, Lk), dim=-1).indices
    mask = torch.zeros(B, Hm, Lq, Lk, dtype=torch.bool).scatter_(-1, top, True)
    return mask & vis if causal else mask


# (name, Lq, Lk, causal, mask kind, bias shape or None, gather policy)
CASES = [
    ("topk-gather", 40, 70, True, "topk", (2, 2, 1, 70), "always"),   # dQ reuses the gather
    ("topk-lists", 33, 33, True, "topk", (1, 4, 33, 33), "never"),    # full bias: tile lists
    ("per-key", 35, 50, False, "per-key", (2, 1, 1, 50), "auto"),
    ("causal-only", 33, 21, True, None, None, "auto"),                # Lq > Lk
    ("dense", 17, 29, False, None, (1, 1, 17, 29), "auto"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_handed_over_plan_gives_the_same_gradients(case, monkeypatch):
    name, Lq, Lk, causal, kind, bias_shape, policy = case
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", policy)
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, D = 2, 4, 2, 16
    q = torch.randn(B, Lq, H, D, generator=g)
    k, v = (torch.randn(B, Lk, Hkv, D, generator=g) for _ in range(2))
    mask = None
    if kind == "topk":
        mask = _topk_mask(B, Hkv, Lq, Lk, 9, causal, g)
    elif kind == "per-key":
        mask = torch.rand(B, 1, 1, Lk, generator=g) < 0.5
    bias = torch.randn(*bias_shape, generator=g) if bias_shape else None
    scale = D ** -0.5

    out, lse, plan = attention_forward(q, k, v, mask, bias, scale, causal, 0.0, keep_plan=True)
    out_plain, lse_plain = attention_forward(q, k, v, mask, bias, scale, causal, 0.0)
    assert isinstance(plan, BackwardPlan)
    assert torch.equal(out, out_plain) and torch.equal(lse, lse_plain)
    if policy == "always":
        # The dQ plan is the forward's, with its mask bits.
        assert plan.gather is not None and plan.gather.gbits is not None
    dout = torch.randn(out.shape, generator=g)
    args = (dout, q, k, v, out, lse, mask, bias, scale, causal, 0.0, True, bias is not None)
    handed = attention_backward(*args, plan=plan)
    planned = attention_backward(*args)
    for a, b in zip(handed, planned):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_eager_autograd_hands_the_plan_over_and_the_op_path_still_plans(monkeypatch):
    """Eager training calls run as _PlannedAttention with the forward's plan; calling the
    registered op directly (what compile and tracing use) plans in the backward instead; both
    give the same values."""
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")
    import flash_dmattn.backends.triton.backward as bwd_mod

    seen = []
    real = bwd_mod.attention_backward

    def spy(*a, plan=None, **kw):
        seen.append(plan)
        return real(*a, plan=plan, **kw)

    monkeypatch.setattr(bwd_mod, "attention_backward", spy)
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, L, D = 1, 4, 2, 48, 16
    base = [torch.randn(B, L, h, D, generator=g) for h in (H, Hkv, Hkv)]
    mask = _topk_mask(B, Hkv, L, L, 8, True, g)
    bias0 = torch.randn(B, Hkv, 1, L, generator=g)
    op = triton_op()
    results = []
    for path in ("eager", "op"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        bias = bias0.clone().requires_grad_()
        if path == "eager":
            out, _ = op(q, k, v, mask, bias, D ** -0.5, True, 0.0, True)
            assert "_PlannedAttention" in type(out.grad_fn).__name__
        else:
            out, _ = op._fwd(q, k, v, mask, bias, D ** -0.5, True, 0.0, True)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
        results.append((out.detach(), grads))
    assert isinstance(seen[0], BackwardPlan) and seen[1] is None
    for a, b in zip((results[0][0], *results[0][1]), (results[1][0], *results[1][1])):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_planned_path_with_retain_graph_and_checkpoint(monkeypatch):
    """A second backward through the same graph (retain_graph) and activation checkpointing
    (the forward re-run inside the backward) give the gradients of a plain call."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, L, D = 1, 2, 1, 40, 16
    base = [torch.randn(B, L, h, D, generator=g) for h in (H, Hkv, Hkv)]
    mask = _topk_mask(B, Hkv, L, L, 7, True, g)
    op = triton_op()

    def attn(q, k, v):
        return op(q, k, v, mask, None, D ** -0.5, True, 0.0, True)[0]

    def grads(run):
        q, k, v = (t.clone().requires_grad_() for t in base)
        return run(q, k, v), (q, k, v)

    out, leaves = grads(attn)
    first = torch.autograd.grad(out.sum(), leaves, retain_graph=True)
    second = torch.autograd.grad(out.sum(), leaves)
    out_ck, leaves_ck = grads(lambda q, k, v: checkpoint(attn, q, k, v, use_reentrant=False))
    ck = torch.autograd.grad(out_ck.sum(), leaves_ck)
    for a, b, c in zip(first, second, ck):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, c, atol=0, rtol=0)
