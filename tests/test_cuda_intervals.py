"""Key-interval masks on the cuda backend's Hopper kernels: outputs and every gradient against
the float64 reference on the same mask in dense form (the error of the reference run at the
same low precision as the yardstick), with poisoned outputs, segmented key blocks, rows that
see no key, ``-inf`` biases and the library's own top-W selections.
"""
import pytest
import torch

import flash_dmattn as fd
from flash_dmattn import KeyIntervals
from flash_dmattn.backends.cuda.extension import NO_DROPOUT

from test_triton_intervals import check_case

pytestmark = pytest.mark.gpu


def cuda_func(*args, **kwargs):
    return fd.flash_dmattn_func_auto(backend="cuda")(*args, **kwargs)


@pytest.fixture
def hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda key-interval kernels are built for sm_90")
    fd.registry.get_backend("cuda")  # raises with the reasons when unavailable


CASES = [
    # (B, Lq, Lk, H, Hkv, D, bounds shape, bias shape, causal)
    (2, 1000, 1000, 8, 2, 128, (2, 2, 1000), (2, 2, 1, 1000), True),
    (1, 777, 1500, 8, 2, 64, (1, 2, 1500), (1, 8, 1, 1500), True),   # Lq < Lk, bias per head
    (2, 513, 300, 4, 4, 128, (1, 1, 300), None, False),              # Lq > Lk, no bias
    (1, 300, 333, 4, 1, 96, (333,), (1, 1, 1, 333), False),          # MQA, padded head dim
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_intervals_match_reference(hopper, case, dtype):
    check_case(*case, device="cuda", dtype=dtype, fn=cuda_func)


def test_cuda_intervals_softcap_empty_rows_neg_inf_bias(hopper, monkeypatch):
    from flash_dmattn.backends.cuda import intervals

    monkeypatch.setattr(intervals, "SEGMENT_ROWS", 128)  # several segments a key block
    check_case(1, 700, 700, 4, 2, 128, (1, 2, 700), (1, 2, 1, 700), True, softcap=5.0,
               device="cuda", dtype=torch.bfloat16, empty_rows=True, neg_inf_bias=True,
               fn=cuda_func)


@pytest.mark.parametrize("causal_selection", [False, True])
def test_cuda_topk_selection(hopper, causal_selection, monkeypatch):
    from flash_dmattn.backends.cuda import intervals
    from flash_dmattn.utils.mask import topk_intervals

    monkeypatch.setattr(intervals, "ITEM_SEGMENT_ROWS", 256)  # segment items, 12 segments
    B, L, H, Hkv, D, W = 1, 3000, 8, 2, 128, 256
    bias = torch.randn(B, Hkv, 1, L, device="cuda")
    ki = topk_intervals(bias, W, is_causal=causal_selection)
    check_case(B, L, L, H, Hkv, D, None, (B, Hkv, 1, L), True, device="cuda",
               dtype=torch.bfloat16, intervals=ki.to("cpu"), fn=cuda_func)


@pytest.mark.parametrize("W", [100, 130, 700, 2048])
def test_cuda_topk_selection_list_tails(hopper, W):
    """Causal top-W lists whose last step holds few keys (most of the step's rows past the list)
    and lists whose last step is wide, against the reference."""
    from flash_dmattn.backends.cuda.intervals import plan_for
    from flash_dmattn.utils.mask import topk_intervals

    B, L, H, Hkv, D = 1, 2600, 4, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(W)
    bias = torch.randn(B, Hkv, 1, L, device="cuda", generator=gen)
    ki = topk_intervals(bias, W, is_causal=True)
    q = torch.empty(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
    plan, _ = plan_for(q, k, bias.bfloat16(), ki.bounds, True, backward=False, window=ki.window)
    lens = plan.tile_len.flatten().cpu().long()
    steps = (lens + plan.block_n - 1) // plan.block_n
    tails = lens - (steps - 1) * plan.block_n
    assert ((steps > 1) & (tails <= 64)).any(), tails  # some list ends in a short step
    check_case(B, L, L, H, Hkv, D, None, (B, Hkv, 1, L), True, device="cuda",
               dtype=torch.bfloat16, intervals=ki.to("cpu"), fn=cuda_func)


def test_cuda_intervals_write_every_output(hopper):
    """The forward writes every row (0 and lse -inf where no key is seen) into a NaN-poisoned
    output buffer."""
    from flash_dmattn.backends.cuda.intervals import plan_for
    from flash_dmattn.backends.cuda.kernels import kernel_module

    gen = torch.Generator(device="cuda").manual_seed(3)
    B, L, H, Hkv, D = 1, 555, 4, 2, 128
    q, k, v = (torch.randn(B, L, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (H, Hkv, Hkv))
    start = torch.randint(200, L, (B, Hkv, L), device="cuda", generator=gen)
    end = start + torch.randint(0, 100, (B, Hkv, L), device="cuda", generator=gen)
    bounds = KeyIntervals(start, end).bounds
    (ivp, fb) = plan_for(q, k, None, bounds, True, backward=False)
    mod = kernel_module(q, True, False, op="fwd")
    poison = torch.full_like(q, float("nan"))
    out, lse = mod.fwd_intervals(q, k, v, poison, None, fb, ivp.tile_start, ivp.tile_len,
                                 ivp.tile_full, ivp.keys, D ** -0.5, True, 0.0, *NO_DROPOUT)
    assert out.data_ptr() == poison.data_ptr()
    assert not out.isnan().any()
    assert (lse[:, :, :200] == float("-inf")).all()
    assert torch.count_nonzero(out[:, :200].float()) == 0


def test_cuda_runs_intervals_itself(hopper, monkeypatch):
    """A key-interval call on the cuda backend runs its own interval kernels, forward and
    backward (not a fallback), and plain causal written as intervals runs the dense ones."""
    from flash_dmattn.backends.cuda import intervals

    calls = []
    for name in ("interval_forward", "interval_backward"):
        real = getattr(intervals, name)
        monkeypatch.setattr(intervals, name,
                            lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    L = 300
    q = torch.randn(1, L, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, L, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    j = torch.arange(L, device="cuda")
    out = cuda_func(q, k, k, attn_mask=KeyIntervals(j, torch.full_like(j, L)), is_causal=True)
    torch.autograd.grad(out.float().sum(), (q, k))
    assert not calls
    out = cuda_func(q, k, k, attn_mask=KeyIntervals(j, j + 50), is_causal=True)
    torch.autograd.grad(out.float().sum(), (q, k))
    assert calls == ["interval_forward", "interval_backward"]


def test_cuda_declines_what_it_does_not_run(hopper):
    from flash_dmattn.inputs import AttentionInputs

    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    j = torch.arange(64, device="cuda")
    per_qhead = KeyIntervals(j.expand(4, 64), (j + 8).expand(4, 64))
    backend = fd.registry.get_backend("cuda")
    for inputs, words in (
        (AttentionInputs.from_args(q, k, k, per_qhead, None), "per query head"),
        (AttentionInputs.from_args(q, k, k, KeyIntervals(j, j + 8),
                                   torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)),
         "per-key bias"),
        (AttentionInputs.from_args(q.detach().requires_grad_(), k, k, KeyIntervals(j, j + 8),
                                   None, deterministic=True),
         "deterministic"),  # with a backward to run
    ):
        assert any(words in r for r in backend.not_supported_reasons(inputs)), words
