"""The custom-op wrapper: eager no-grad calls run the implementation directly, everything
else (gradients, fake tensors, compile) goes through the registered op."""
import pytest
import torch

from flash_dmattn import flash_dmattn_func
from flash_dmattn.ops import AttentionOp, VarlenAttentionOp, eager_inference


def _inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 4, 16, generator=g, requires_grad=requires_grad)
    k = torch.randn(1, 11, 2, 16, generator=g, requires_grad=requires_grad)
    v = torch.randn(1, 11, 2, 16, generator=g, requires_grad=requires_grad)
    return q, k, v


def _spy(monkeypatch, cls):
    """Count calls of every instance's registered op (``_fwd``)."""
    calls = []
    orig_init = cls.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        op = self._fwd

        def counted(*args):
            calls.append(1)
            return op(*args)

        self._fwd = counted

    monkeypatch.setattr(cls, "__init__", init)
    return calls


def test_eager_inference_predicate():
    t = torch.randn(3)
    assert eager_inference(t, None)
    assert not eager_inference(t.clone().requires_grad_())
    with torch.no_grad():
        assert eager_inference(t.clone().requires_grad_())
    assert not eager_inference(torch.empty(3, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not eager_inference(torch.empty(3))


def test_no_grad_call_skips_the_op_and_matches_it(monkeypatch):
    calls = _spy(monkeypatch, AttentionOp)
    op = AttentionOp("test_direct", lambda q, k, v, m, b, s, c, sc: (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
            v.repeat_interleave(2, 2).transpose(1, 2), scale=s).transpose(1, 2),
        torch.zeros(q.shape[0], q.shape[2], q.shape[1])), lambda *a: (None,) * 4)
    q, k, v = _inputs()
    out_direct, lse_direct = op(q, k, v, None, None, 0.25, False, 0.0)
    assert calls == []
    assert out_direct.is_contiguous() and lse_direct.dtype == torch.float32
    qg = q.clone().requires_grad_()
    out_op, lse_op = op(qg, k, v, None, None, 0.25, False, 0.0)
    assert calls == [1]
    assert torch.equal(out_direct, out_op.detach()) and torch.equal(lse_direct, lse_op.detach())


@pytest.mark.parametrize("backend", ["torch-reference", "triton"])
def test_public_api_same_results_with_and_without_grad(backend):
    from flash_dmattn import flash_dmattn_func_auto, get_available_backends

    if backend not in get_available_backends():
        # Only without the triton package (torch-reference is always there; triton runs
        # under the interpreter in CI and compiled on a GPU).
        pytest.skip(f"{backend} unavailable here: {backend} is not installed")
    fn = flash_dmattn_func_auto(backend)
    # CPU tensors under the interpreter (CI); on a GPU machine Triton takes CUDA bf16 tensors.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" and backend == "triton" else torch.float32
    q, k, v = (t.to(dev, dtype) for t in _inputs())
    mask = (torch.rand(1, 2, 9, 11, generator=torch.Generator().manual_seed(1)) > 0.4).to(dev)
    bias = torch.randn(1, 2, 1, 11).to(dev, dtype)
    with torch.no_grad():
        direct = fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    through_op = fn(qg, kg, vg, attn_mask=mask, attn_bias=bias, is_causal=True)
    torch.testing.assert_close(direct, through_op.detach(), rtol=0, atol=0)
    through_op.sum().backward()  # the op path still differentiates
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_varlen_no_grad_skips_the_op(monkeypatch):
    calls = _spy(monkeypatch, VarlenAttentionOp)
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    op = VarlenAttentionOp("test_varlen_direct",
                           lambda q, k, v, cq, ck, mq, mk, m, b, s, c, sc: (q * 1, torch.zeros(
                               q.shape[1], q.shape[0])), lambda *a: (None,) * 4)
    op(q, q, q, cu, cu, 4, 4, None, None, 1.0, True, 0.0)
    assert calls == []
    op(q.clone().requires_grad_(), q, q, cu, cu, 4, 4, None, None, 1.0, True, 0.0)
    assert calls == [1]


def test_compiled_call_keeps_the_op():
    q, k, v = _inputs()

    @torch.compile(backend="eager", fullgraph=True)
    def f(q, k, v):
        return flash_dmattn_func(q, k, v, is_causal=True)

    with torch.no_grad():
        torch.testing.assert_close(f(q, k, v), flash_dmattn_func(q, k, v, is_causal=True))
