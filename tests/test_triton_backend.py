"""The triton backend through the public API: dispatch, autograd, custom ops, torch.compile.

Kernel numerics are covered in depth by test_triton_kernels.py (interpreter) and test_gpu.py
(CUDA); this file checks the wiring on whatever device the kernels can run on here.
"""
import os

import pytest
import torch

from flash_dmattn import get_available_backends, registry, triton_dmattn_func

from cases import FIXED
from naive import naive_attention

pytestmark = pytest.mark.skipif(
    "triton" not in get_available_backends(),
    reason=f"triton backend unavailable here: {registry.unavailable_reason(registry._BACKENDS['triton'])}"
    if "triton" in registry._BACKENDS else "triton backend unavailable here: not registered",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
# fp32 under the interpreter: fp32 accumulation, errors ~1e-6; bf16 on GPU: output rounding
TOL = 2e-5 if DTYPE == torch.float32 else 2e-2


@pytest.mark.parametrize("case", FIXED[:4], ids=lambda c: f"{c.seqlen_q}x{c.seqlen_k}")
def test_public_api_outputs_and_grads(case):
    q, k, v, mask, bias = case.tensors(dtype=DTYPE, device=DEVICE, requires_grad=True)
    out = triton_dmattn_func(q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    ref, _ = naive_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                             None if bias is None else bias.cpu(), case.scale, case.causal, case.softcap)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    gout = torch.randn_like(ref)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    got = torch.autograd.grad(out, leaves, gout.to(out.dtype).to(DEVICE))
    want = torch.autograd.grad(ref, leaves, gout)
    for a, b in zip(got, want):
        assert a.shape == b.shape and not a.isnan().any()
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=10 * TOL, rtol=10 * TOL)


def test_deterministic_backward_is_bitwise_reproducible():
    case = FIXED[0]
    grads = []
    for _ in range(2):
        q, k, v, mask, bias = case.tensors(dtype=DTYPE, device=DEVICE, requires_grad=True)
        out = triton_dmattn_func(q, k, v, mask, bias, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, bias)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_compiles_without_graph_breaks():
    case = FIXED[3]
    q, k, v, mask, bias = case.tensors(dtype=DTYPE, device=DEVICE, requires_grad=True)

    def f(q, k, v, bias):
        return triton_dmattn_func(q, k, v, mask, bias, softcap=case.softcap).square().sum()

    eager = f(q, k, v, bias)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, bias)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU dispatch preference")
def test_auto_dispatch_on_cpu_prefers_reference():
    from flash_dmattn import registry
    from flash_dmattn.inputs import AttentionInputs

    q = torch.randn(1, 8, 2, 16)
    assert registry.select_backend(AttentionInputs.from_args(q, q, q)).name == "torch-reference"
