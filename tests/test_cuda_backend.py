"""The cuda backend's compiled kernels against the reference (GPU only; builds on first use).

Same problems as tests/test_gpu.py (outputs and every gradient in float64 on the reference
side), plus what is specific to the compiled path: head-dim buckets with padding (96 for
D=80), poisoned outputs, bitwise-deterministic backward, the second load coming from the disk
cache, and clear reasons for what the kernels do not take yet.
"""
import pytest
import torch

from flash_dmattn import registry
from flash_dmattn.backends.cuda.extension import NO_DROPOUT
from flash_dmattn.inputs import AttentionInputs
from flash_dmattn.reference import reference_attention

from test_gpu import make_problem, rel_err

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = registry.get_backend("cuda")  # raises with the reasons when unavailable
    return backend


def test_cuda_second_process_loads_from_the_disk_cache():
    # A module built (or loaded) here is loaded from the disk cache by a fresh process, which
    # must not compile: its builder raises, and the loaded module runs a forward.
    import subprocess
    import sys

    from flash_dmattn.backends.cuda import jit, toolchain
    from flash_dmattn.backends.cuda.spec import KernelSpec

    _cuda()
    spec = KernelSpec(64, "bf16", True, True)
    jit.load_kernel(spec, "fwd", toolchain.detect())
    code = (
        "import torch\n"
        "from flash_dmattn.backends.cuda import jit, toolchain\n"
        "from flash_dmattn.backends.cuda.spec import KernelSpec\n"
        "def boom(req):\n"
        "    raise SystemExit('recompiled ' + str(req.build_dir))\n"
        "mod = jit.load_kernel(KernelSpec.parse('d64-bf16-mask-bias'), 'fwd',\n"
        "                      toolchain.detect(), builder=boom)\n"
        "from flash_dmattn import flash_dmattn_func_auto\n"
        "q = torch.randn(1, 70, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
        "mask = torch.rand(1, 2, 70, 70, device='cuda') > 0.3\n"
        "bias = torch.randn(1, 2, 1, 70, device='cuda', dtype=torch.bfloat16)\n"
        "out = flash_dmattn_func_auto(backend='cuda')(q, q, q, mask, bias)\n"
        "print('ok', bool(torch.isfinite(out).all()))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok True"), res.stdout


def run_and_compare(problem, causal, softcap=0.0, bias_grad=True, tol_scale=1.0, scale=None):
    backend = _cuda()
    q, k, v, mask, bias = problem
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    if bias is not None:
        bias = bias.detach().requires_grad_(bias_grad)
    inputs = AttentionInputs.from_args(*leaves, mask, bias, scale, causal, softcap)
    assert backend.not_supported_reasons(inputs) == []
    out = backend.attention(inputs)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref_bias = None
    if bias is not None:
        ref_bias = bias.detach().double().requires_grad_(bias_grad)
    # The reference op takes 4-D masks and biases; a user's (Lq, Lk) or (B, ..) shape is
    # viewed up to 4-D here (the gradient reaches the leaf in its own shape).
    ref_mask = None if mask is None else mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    ref_bias4 = None if ref_bias is None else ref_bias.view(
        (1,) * (4 - ref_bias.dim()) + tuple(ref_bias.shape))
    ref, _ = reference_attention(*ref_leaves, ref_mask, ref_bias4, inputs.softmax_scale, causal,
                                 softcap)
    assert not out.isnan().any()
    tol = (1.5e-2 if q.dtype == torch.bfloat16 else 3e-3) * tol_scale
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    gout = torch.randn_like(ref)
    want_leaves = ref_leaves + ([ref_bias] if bias is not None and bias_grad else [])
    got_leaves = leaves + ([bias] if bias is not None and bias_grad else [])
    got = torch.autograd.grad(out, got_leaves, gout.to(out.dtype))
    want = torch.autograd.grad(ref, want_leaves, gout)
    for name, a, b, leaf in zip(["dq", "dk", "dv", "dbias"], got, want, got_leaves):
        assert a.shape == leaf.shape and a.dtype == leaf.dtype, name
        assert not a.isnan().any(), name
        assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))


_SHAPES = {"square": (1, 1024, 1024, 8, 2, 64), "lq<lk": (2, 511, 1537, 4, 4, 128),
           "lq>lk": (1, 2048, 777, 4, 1, 64), "d80": (1, 300, 333, 4, 2, 80),
           "d256": (1, 257, 190, 2, 1, 256), "d32": (2, 65, 129, 2, 2, 32)}
_BOTH_OR_NEITHER = [(None, None), ("topk", "per_key"), ("block_sparse", "full")]
_ONE_SIDED = [("padding", None), (None, "per_key"), ("topk", None)]
# Every kernel module this suite needs is built in the device call that runs it (issue 4: the
# suite with its compiles in one 10-minute call), and each distinct (head dim, mask, bias)
# is a module of its own. Mask-only and bias-only modules are tested at head dim 128, the
# head-dim buckets at none and mask + bias: what the flags change does not depend on the
# bucket, what the bucket changes (tile shapes, shared memory) does not depend on the flags.
_MATRIX = [pytest.param(shape, m, b, id=f"{name}-{m}-{b}") for name, shape in _SHAPES.items()
           for m, b in _BOTH_OR_NEITHER + (_ONE_SIDED if shape[-1] == 128 else [])]


@pytest.mark.parametrize("shape,mask_kind,bias_kind", _MATRIX)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_reference(shape, mask_kind, bias_kind, causal):
    run_and_compare(make_problem(*shape, torch.bfloat16, mask_kind, bias_kind), causal)


@pytest.mark.parametrize("scale", [0.3, 0.0, -0.07])
def test_cuda_softmax_scale_of_any_sign(scale):
    # Zero and negative scales are legal (softmax_scale is any finite number): the row max
    # must be taken on the scaled logits, not on raw scores. The backward reads the forward's
    # lse, so the gradients check it too.
    run_and_compare(make_problem(1, 300, 333, 4, 2, 128, torch.bfloat16, None, None), True,
                    scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_long_sequence_and_softcap(dtype):
    problem = make_problem(1, 4096, 4096, 4, 2, 128, dtype, "topk", "per_key", seed=3)
    run_and_compare(problem, causal=True, softcap=30.0)


def test_cuda_neg_inf_bias_rows_give_zero():
    # -inf biases on whole rows and columns (bias in q's dtype, no grad: shared by all heads).
    q, k, v, mask, _ = make_problem(1, 300, 400, 4, 2, 64, torch.bfloat16, "padding", None)
    bias = torch.randn(1, 1, 300, 400, device="cuda").to(torch.bfloat16)
    bias[..., ::7, :] = float("-inf")
    bias[..., :, ::3] = float("-inf")
    run_and_compare((q, k, v, mask, bias), causal=False, bias_grad=False)
    backend = _cuda()
    inputs = AttentionInputs.from_args(q, k, v, mask, bias, None, False)
    out = backend.attention(inputs)
    assert torch.count_nonzero(out[0, ::7].float()) == 0


def test_cuda_poisoned_output_is_fully_written():
    from flash_dmattn.backends.cuda.kernels import kernel_module

    _cuda()
    q, k, v, mask, bias = make_problem(1, 333, 200, 4, 2, 80, torch.bfloat16, "topk", "per_key")
    mask = mask.clone()
    mask[0, 0, 7] = False  # a fully masked row
    mod = kernel_module(q, True, True, op="fwd")
    poison = torch.full_like(q, float("nan"))
    from flash_dmattn.planning.tiles import build_tile_lists

    bm, bn = mod.block_sizes()
    lists = build_tile_lists(mask, 333, 200, 4, False, bm, bn, q.device)
    out, lse = mod.fwd(q, k, v, mask, bias, poison, q.shape[-1] ** -0.5, False, 0.0,
                       lists.fwd_idx, lists.fwd_cnt, lists.head_div, None, None, None, 0, 0,
                       *NO_DROPOUT)
    assert out.data_ptr() == poison.data_ptr()
    assert not out.isnan().any()
    assert lse[0, 0, 7] == float("-inf") and torch.count_nonzero(out[0, 7, 0].float()) == 0


def test_cuda_backward_is_bitwise_deterministic():
    backend = _cuda()
    q, k, v, mask, bias = make_problem(1, 1024, 1024, 8, 2, 128, torch.bfloat16, "topk", "per_key")
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, bias)]
        inputs = AttentionInputs.from_args(*leaves[:3], mask, leaves[3], None, True,
                                           deterministic=True)
        out = backend.attention(inputs)
        grads.append(torch.autograd.grad(out.float().square().sum(), leaves))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(1, 1000, 1100, 8, 2, 128), (2, 333, 257, 4, 4, 64),
                                   (1, 200, 300, 4, 1, 96)], ids=["d128-gqa", "d64", "d96-mqa"])
@pytest.mark.parametrize("only_dq", [False, True])
def test_cuda_fused_dq_matches_split_dq(shape, only_dq):
    # deterministic=False lets the Hopper backward add dQ inside the dK/dV kernel with atomics;
    # deterministic=True keeps the separate dQ kernel. Same gradients up to summation order,
    # both against the float64 reference (only_dq: dK/dV not requested, the fused kernel still
    # runs for dQ alone).
    backend = _cuda()
    q, k, v, mask, bias = make_problem(*shape, torch.bfloat16, "topk", "per_key", seed=11)
    gout = torch.randn_like(q)
    grads = {}
    for det in (True, False):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        if only_dq:
            leaves[1].requires_grad_(False)
            leaves[2].requires_grad_(False)
        inputs = AttentionInputs.from_args(*leaves, mask, bias, None, True, deterministic=det)
        out = backend.attention(inputs)
        grads[det] = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], gout)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = reference_attention(*ref_leaves, mask, bias.double(), shape[-1] ** -0.5, True, 0.0)
    want = torch.autograd.grad(ref, ref_leaves, gout.double())
    for split, fused, w in zip(grads[True], grads[False], want):
        assert not fused.isnan().any()
        assert rel_err(fused, w) < 3e-2, rel_err(fused, w)
        assert rel_err(fused, split.double()) < 1e-2, rel_err(fused, split.double())


def _shared_keys_mask(b, lq, lk, hkv, keep, seed):
    """Per-query masks whose rows mostly keep the same keys (the dynamic-mask case gather mode
    is for): the top ``keep`` keys of a per-key score, each dropped per query with p = 0.2,
    plus a few scattered keys per query; the first 3 rows keep nothing."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    score = torch.rand(b, hkv, 1, lk, device="cuda", generator=g)
    top = torch.zeros_like(score, dtype=torch.bool).scatter_(
        -1, score.topk(keep, dim=-1).indices, True)
    mask = top & (torch.rand(b, hkv, lq, lk, device="cuda", generator=g) > 0.2)
    mask |= torch.rand(b, hkv, lq, lk, device="cuda", generator=g) < 0.01
    mask[:, :, :3] = False
    return mask


@pytest.mark.parametrize("shape,bias_kind", [
    ((2, 511, 1537, 4, 4, 128), "per_key"), ((2, 511, 1537, 4, 4, 128), None),
    ((1, 1000, 1100, 8, 2, 128), "per_key"), ((1, 300, 333, 4, 2, 256), "per_key"),
    ((2, 200, 129, 2, 2, 64), "per_key")], ids=["d128", "d128-nobias", "d128-gqa", "d256", "d64"])
@pytest.mark.parametrize("mask_kind", ["topk", "shared"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_gathered_forward_matches_reference(monkeypatch, shape, bias_kind, mask_kind,
                                                 causal):
    # Gathering forced: the forward walks each query tile's gathered key list
    # (K/V rows by index, the mask as the list's bits). "topk" masks share few keys between
    # rows (the lists are most keys), "shared" ones many (short lists, partial last step).
    from flash_dmattn.backends.cuda import kernels

    _cuda()
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")
    plans = []
    real_plan = kernels._gather_plan
    monkeypatch.setattr(kernels, "_gather_plan",
                        lambda *a: plans.append(real_plan(*a)) or plans[-1])
    q, k, v, mask, bias = make_problem(*shape, torch.bfloat16, "topk", bias_kind, seed=5)
    if mask_kind == "shared":
        b, lq, lk, _, hkv, _ = shape
        mask = _shared_keys_mask(b, lq, lk, hkv, keep=max(1, lk // 6), seed=6)
    run_and_compare((q, k, v, mask, bias), causal)
    assert plans and plans[0] is not None, "the forward did not gather"


def test_cuda_gathered_forward_writes_every_output():
    from flash_dmattn.backends.cuda.kernels import kernel_module
    from flash_dmattn.planning.gather import plan_key_gather

    _cuda()
    q, k, v, _, bias = make_problem(1, 333, 400, 4, 2, 128, torch.bfloat16, None, "per_key")
    mask = _shared_keys_mask(1, 333, 400, 2, keep=70, seed=2)
    mask[0, 1, 100:140] = False  # fully masked rows inside a tile
    mod = kernel_module(q, True, True, op="fwd")
    bm, bn = mod.block_sizes()
    plan = plan_key_gather(mask, bias, 333, 400, 4, True, bm, bn, policy="always")
    poison = torch.full_like(q, float("nan"))
    out, lse = mod.fwd_gathered(q, k, v, poison, q.shape[-1] ** -0.5, True, 0.0, plan.idx,
                                plan.cnt, plan.head_div, plan.gbits, plan.head_div, plan.gbias,
                                4 // plan.gbias.size(1), *NO_DROPOUT)
    assert out.data_ptr() == poison.data_ptr()
    assert not out.isnan().any() and not lse.isnan().any()
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mask, bias.double(),
                                 q.shape[-1] ** -0.5, True, 0.0)
    assert rel_err(out, ref) < 1.5e-2
    # Query heads 2 and 3 read kv / mask head 1.
    assert torch.count_nonzero(out[0, 100:140, 2:].float()) == 0
    assert (lse[0, 2:, 100:140] == float("-inf")).all()


@pytest.mark.parametrize("lq,lk,h,hkv,bias_kind,causal,softcap", [
    (333, 400, 4, 2, "per_key", True, 0.0), (333, 400, 4, 2, None, False, 0.0),
    (257, 1100, 8, 2, "per_key", True, 0.0), (190, 190, 2, 1, "per_key", True, 5.0)],
    ids=["gqa-causal", "nobias", "lq<lk", "softcap"])
def test_cuda_gathered_dq_matches_reference_and_writes_every_row(lq, lk, h, hkv, bias_kind,
                                                                causal, softcap):
    # The backward's dQ kernel over the forward's gathered lists (64 listed keys a step, a
    # partial last step, tiles whose list is empty, fully masked rows), called through the
    # extension; dq's memory is recycled NaN so rows the kernel does not write show.
    from flash_dmattn.backends.cuda.kernels import _gather_args, kernel_modules
    from flash_dmattn.planning.gather import plan_key_gather

    _cuda()
    q, k, v, _, bias = make_problem(1, lq, lk, h, hkv, 128, torch.bfloat16, None, bias_kind,
                                    seed=lq)
    mask = _shared_keys_mask(1, lq, lk, hkv, keep=max(1, lk // 5), seed=3)
    g = h // hkv
    mask[0, -1, 128:256] = False  # a whole query tile of the last kv head without keys
    mask[0, 0, 100:110] = False  # fully masked rows inside a tile
    mods = kernel_modules(q, True, bias is not None, ops=("fwd", "bwd"))
    assert mods["bwd"].bwd_gathers()
    bm, bn = mods["fwd"].block_sizes()
    plan = plan_key_gather(mask, bias, lq, lk, h, causal, bm, bn, policy="always")
    assert plan is not None and int(plan.cnt.min()) == 0
    scale = 128 ** -0.5
    out, lse = mods["fwd"].fwd_gathered(q, k, v, None, scale, causal, softcap,
                                        *_gather_args(plan, h), *NO_DROPOUT)
    dout = torch.randn_like(out)
    torch.full_like(q, float("nan"))  # freed at once: its block is dq's next
    dq = mods["bwd"].bwd(dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, True,
                         False, 0, None, None, None, None, 1, False, None, None, None, 0, 0,
                         *_gather_args(plan, h), None, 1, *NO_DROPOUT)[0]
    assert not dq.isnan().any()
    leaves = [t.detach().double().requires_grad_(i == 0) for i, t in enumerate((q, k, v))]
    ref, _ = reference_attention(*leaves, mask, bias.double() if bias is not None else None,
                                 scale, causal, softcap)
    (want,) = torch.autograd.grad(ref, leaves[0], dout.double())
    assert rel_err(dq, want) < 3e-2, rel_err(dq, want)
    assert torch.count_nonzero(dq[0, 128:256, h - g:].float()) == 0
    assert torch.count_nonzero(dq[0, 100:110, :g].float()) == 0


@pytest.mark.parametrize("shape,mask_kind,bias_kind,causal", [
    ((2, 333, 700, 4, 2, 128), "block_sparse", "per_key", True),
    ((1, 700, 300, 8, 2, 128), "scattered_key", None, True),
    ((2, 129, 65, 4, 4, 64), "scattered_key", "per_key", False)],
    ids=["blocks-gqa-lq<lk", "scattered-lq>lk", "d64-noncausal"])
def test_cuda_per_key_mask_dq_walks_the_live_keys(monkeypatch, shape, mask_kind, bias_kind,
                                                   causal):
    # A per-key mask's backward runs dQ over its live keys (key_list_gather: no bits, causality
    # from the listed indices), every gradient against the reference.
    from flash_dmattn.backends.cuda import kernels

    _cuda()
    built = []
    real = kernels.key_list_gather
    monkeypatch.setattr(kernels, "key_list_gather",
                        lambda *a: built.append(real(*a)) or built[-1])
    run_and_compare(make_problem(*shape, torch.bfloat16, mask_kind, bias_kind, seed=9), causal)
    assert built and built[0] is not None, "dQ did not walk the key list"


@pytest.mark.parametrize("shape,causal,one_mask_head", [
    ((1, 333, 400, 4, 2, 128), True, False), ((2, 200, 130, 4, 1, 64), False, True),
    ((1, 129, 700, 8, 2, 128), True, True)], ids=["gqa-lq<lk", "d64-lq>lk", "mask-head-1"])
def test_cuda_dkdv_reads_key_bits_like_the_mask(monkeypatch, shape, causal, one_mask_head):
    # A per-query mask's dK/dV kernel reads the key bits that the forward's one pass over the
    # mask wrote, instead of transposing each step's mask tile: the same gradients bit for
    # bit, planned in the forward or (custom-op path, no plan) in the backward, and one
    # summary pass per training step.
    from flash_dmattn.backends.cuda import kernels

    _cuda()
    q, k, v, mask, bias = make_problem(*shape, torch.bfloat16, "topk", "per_key", seed=5)
    if one_mask_head:
        mask = mask[:, :1]
    made = []
    real = kernels._summary
    monkeypatch.setattr(kernels, "_summary", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    scale = shape[-1] ** -0.5
    dout = torch.randn_like(q)

    def planned():
        out, lse, plan = kernels.cuda_planned_forward(q, k, v, mask, bias, scale, causal, 0.0)
        return kernels.cuda_backward(dout, q, k, v, mask, bias, out, lse, scale, causal, 0.0,
                                     True, (True, True, True, True), plan=plan)

    def unplanned():
        out, lse = kernels.cuda_forward(q, k, v, mask, bias, scale, causal, 0.0)
        return kernels.cuda_backward(dout, q, k, v, mask, bias, out, lse, scale, causal, 0.0,
                                     True, (True, True, True, True))

    made.clear()
    with_bits = planned()
    assert len(made) == 1 and made[0].key_bits is not None, "the step did not summarise once"
    assert torch.equal(unplanned()[1], with_bits[1])
    monkeypatch.setattr(kernels, "_KEY_BITS", False)
    transposed = planned()
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), with_bits, transposed):
        assert torch.equal(a, b), name
    run_and_compare((q, k, v, mask, bias), causal)


def test_cuda_inference_gather_reads_key_bits_like_the_mask(monkeypatch):
    # An inference forward's summary carries key bits and the gathered forward's bits are
    # made from them; without them (the test hook) they are made from the mask rows: the
    # same output and lse bit for bit.
    from flash_dmattn.backends.cuda import kernels

    _cuda()
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")
    q, k, v, _, bias = make_problem(1, 333, 400, 4, 2, 128, torch.bfloat16, None, "per_key")
    mask = _shared_keys_mask(1, 333, 400, 2, keep=70, seed=3)
    made, plans = [], []
    real_summary, real_plan = kernels._summary, kernels._gather_plan
    monkeypatch.setattr(kernels, "_summary", lambda *a, **kw: made.append(real_summary(*a, **kw)) or made[-1])
    monkeypatch.setattr(kernels, "_gather_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    got = {}
    for bits in (True, False):
        monkeypatch.setattr(kernels, "_KEY_BITS", bits)
        made.clear()
        plans.clear()
        got[bits] = kernels.cuda_forward(q, k, v, mask, bias, q.shape[-1] ** -0.5, True, 0.0)
        assert len(made) == 1 and (made[0].key_bits is not None) == bits, bits
        assert plans[0] is not None, "the forward did not gather"
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mask, bias.double(),
                                 q.shape[-1] ** -0.5, True, 0.0)
    assert rel_err(got[True][0], ref) < 1.5e-2


def test_cuda_reasons_for_what_it_does_not_take():
    backend = _cuda()
    q, k, v, mask, _ = make_problem(1, 128, 128, 4, 2, 64, torch.bfloat16, "topk", None)
    # A float32 bias is taken (converted for the kernels, tests/test_cuda_host_inputs.py);
    # float64 inputs are not.
    bias32 = torch.randn(1, 4, 128, 128, device="cuda")
    assert backend.not_supported_reasons(AttentionInputs.from_args(q, k, v, mask, bias32)) == []
    q64, k64, v64 = (t.double() for t in (q, k, v))
    reasons = backend.not_supported_reasons(AttentionInputs.from_args(q64, k64, v64, mask))
    assert any("float64 is not supported" in r for r in reasons)


@pytest.mark.parametrize("d,causal", [(256, True), (32, False), (64, True)])
def test_cuda_varlen_per_sequence_with_tail_rows(d, causal):
    """Packed sequences against the dense reference run sequence by sequence, with packed rows
    past cu_seqlens[-1] (owned by no sequence: zero output and gradients) and causal with
    Lq != Lk inside sequences; d256 runs the sm80 backward on Hopper, d32 the smallest bucket."""
    backend = _cuda()
    from flash_dmattn.inputs import VarlenInputs
    from flash_dmattn.utils.padding import cu_seqlens_from_lengths

    g = torch.Generator().manual_seed(d)
    h, hkv = 4, 2
    lens_q = torch.tensor([1, 70, 200, 129, 5])
    lens_k = torch.tensor([3, 64, 333, 128, 5])
    tail = 7
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q).cuda(), cu_seqlens_from_lengths(lens_k).cuda()
    tq, tk = int(lens_q.sum()) + tail, int(lens_k.sum()) + tail
    q, k, v = (torch.randn(t, hh, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for t, hh in ((tq, h), (tk, hkv), (tk, hkv)))
    mask = (torch.rand(hkv, tk, generator=g) > 0.4).cuda()
    bias = torch.randn(1, tk, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    inputs = VarlenInputs.from_args(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                                    mask, bias, None, causal)
    assert backend.varlen_not_supported_reasons(inputs) == []
    out = backend.varlen_attention(inputs)
    gout = torch.randn(out.shape, generator=g).to(out)
    got = torch.autograd.grad(out, (q, k, v, bias), gout)
    assert not out.isnan().any() and torch.count_nonzero(out[-tail:]) == 0
    for name, a in zip(["dq", "dk", "dv", "dbias"], got):
        rows = a[-tail:] if a.dim() == 3 else a[:, -tail:]
        assert not a.isnan().any() and torch.count_nonzero(rows) == 0, name

    want = [torch.zeros(t.shape, dtype=torch.float64, device="cuda") for t in (q, k, v, bias)]
    for i in range(len(lens_q)):
        sq = slice(int(cu_q[i]), int(cu_q[i + 1]))
        sk = slice(int(cu_k[i]), int(cu_k[i + 1]))
        leaves = [t[s].detach().double().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk))]
        b = bias[:, sk].detach().double().requires_grad_()
        m4 = mask[:, sk][None, :, None, :].repeat_interleave(h // hkv, 1)
        ref, _ = reference_attention(*(t[None] for t in leaves), m4, b[None, :, None, :],
                                     inputs.softmax_scale, causal, 0.0)
        assert rel_err(out[sq], ref[0]) < 1.5e-2, (i, rel_err(out[sq], ref[0]))
        grads = torch.autograd.grad(ref, leaves + [b], gout[sq][None].double())
        for w, s, gr in zip(want, (sq, sk, sk, sk), grads):
            if w.dim() == 2:
                w[:, s] = gr
            else:
                w[s] = gr
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert rel_err(a, b) < 3e-2, (name, rel_err(a, b))


# ---------------------------------------------------------------------------------------------
# Split-KV decode (KV cache, paged or not)


def _decode_aux(kind, B, Lq, H, Hkv, Lk, dtype, g):
    """(mask, bias) of a named broadcast shape, on the GPU."""
    dev = "cuda"
    if kind == "none":
        return None, None
    if kind == "per_key":  # the dynamic-mask decode case: one row per kv head
        bias = torch.randn(B, Hkv, 1, Lk, device=dev, generator=g).to(dtype)
        return bias > -0.5, bias
    if kind == "full":  # per query head and query: a row per CTA row
        bias = torch.randn(B, H, Lq, Lk, device=dev, generator=g).to(dtype)
        return torch.rand(B, H, Lq, Lk, device=dev, generator=g) > 0.3, bias
    if kind == "padding":  # key padding only, shared by every head
        return torch.rand(B, 1, 1, Lk, device=dev, generator=g) > 0.2, None
    if kind == "bias_per_head":  # per query head, broadcast over queries (G rows per CTA)
        return None, torch.randn(B, H, 1, Lk, device=dev, generator=g).to(dtype)
    raise ValueError(kind)


def _decode_reference(q, k, v, mask, bias, scale, causal, softcap, cs):
    """float64 reference attention with the KV cache's used lengths."""
    return reference_attention(q.double(), k.double(), v.double(), mask,
                               None if bias is None else bias.double(), scale, causal, softcap,
                               cache_seqlens=cs)


def _to_pages(k, v, page, g):
    B, Lk, Hkv, D = k.shape
    P = Lk // page
    perm = torch.randperm(B * P, device=k.device, generator=g)
    k_pool = torch.full((B * P + 3, page, Hkv, D), float("nan"), device=k.device, dtype=k.dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    k_pool[perm] = k.reshape(B * P, page, Hkv, D)
    v_pool[perm] = v.reshape(B * P, page, Hkv, D)
    return k_pool, v_pool, perm.view(B, P).to(torch.int32)


@pytest.fixture
def decode_poison(monkeypatch):
    from flash_dmattn.backends.cuda import kernels

    monkeypatch.setattr(kernels, "DEBUG_POISON", True)


_ALL_KINDS = ("per_key", "none", "full", "padding", "bias_per_head")
_BOTH_KINDS = ("per_key", "none", "full")  # mask and bias, or neither
# Every broadcast kind at head dim 128; at 64 every kind with both or neither (mask-only and
# bias-only modules at 64 would only add kernel builds); the per-key case and no mask at the
# padded (80 -> 96) and largest buckets.
_DECODE_CASES = [
    (shape, kind) for shape, kinds in [
        ((3, 1, 32, 8, 4099, 128), _ALL_KINDS), ((2, 3, 8, 2, 1000, 64), _BOTH_KINDS),
        ((2, 4, 16, 1, 777, 64), _BOTH_KINDS), ((1, 16, 4, 4, 300, 128), _ALL_KINDS),
        ((1, 1, 2, 2, 1, 64), ("per_key", "none")), ((2, 2, 8, 4, 513, 256), ("per_key", "none")),
        ((2, 1, 4, 2, 129, 80), ("per_key", "none")),
    ] for kind in kinds
]


@pytest.mark.parametrize("shape,kind", _DECODE_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_decode_matches_reference(decode_poison, shape, kind, causal):
    B, Lq, H, Hkv, Lk, D = shape
    from flash_dmattn.backends.cuda.kernels import cuda_decode_forward

    _cuda()
    g = torch.Generator(device="cuda").manual_seed(Lk + 7 * Lq)
    dtype = torch.bfloat16
    q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(dtype)
    mask, bias = _decode_aux(kind, B, Lq, H, Hkv, Lk, dtype, g)
    # Used lengths: empty, full, short (inside the first tile) and partial caches.
    cs = torch.tensor([0, Lk, min(Lk, 5)][:B] if B > 1 else [Lk // 2 + 1], device="cuda",
                      dtype=torch.int32)
    softcap = 20.0 if causal else 0.0
    scale = D ** -0.5
    tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
    for cache in (None, cs):
        for splits in (1, 3, 64):
            out, lse = cuda_decode_forward(q, k, v, mask, bias, scale, causal, softcap, cache,
                                           num_splits=splits)
            ref, ref_lse = _decode_reference(q, k, v, mask, bias, scale, causal, softcap, cache)
            assert not out.isnan().any() and not lse.isnan().any(), (cache is None, splits)
            assert rel_err(out, ref) < tol, (cache is None, splits, rel_err(out, ref))
            empty = torch.isneginf(ref_lse)
            assert torch.equal(torch.isneginf(lse), empty)
            assert (out.transpose(1, 2)[empty] == 0).all()
            assert torch.allclose(lse[~empty].double(), ref_lse[~empty].double(), atol=2e-2,
                                  rtol=1e-3)


@pytest.mark.parametrize("kind", ["per_key", "full"])
def test_cuda_decode_either_side_of_the_warp_split(decode_poison, kind):
    # At most 16 rows (G * Lq) the four warps split each key tile and merge their softmax
    # states at the end; more rows take one warp per 16 rows. Rows 1, 12 and 16 (warp split)
    # and 17 (row tiles), one and several key splits, must match the reference.
    from flash_dmattn.backends.cuda.kernels import cuda_decode_forward

    _cuda()
    for B, Lq, H, Hkv, Lk, D in ((2, 1, 8, 8, 2000, 128), (2, 3, 16, 4, 1500, 64),
                                 (1, 4, 16, 4, 999, 128), (2, 17, 4, 4, 999, 64)):
        g = torch.Generator(device="cuda").manual_seed(Lk)
        q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
        mask, bias = _decode_aux(kind, B, Lq, H, Hkv, Lk, torch.bfloat16, g)
        cs = torch.tensor([Lk - 17, 70][:B], device="cuda", dtype=torch.int32)
        ref, ref_lse = _decode_reference(q, k, v, mask, bias, 0.1, True, 0.0, cs)
        for splits in (1, 3):
            out, lse = cuda_decode_forward(q, k, v, mask, bias, 0.1, True, 0.0, cs,
                                           num_splits=splits)
            assert not out.isnan().any() and not lse.isnan().any(), (Lq, splits)
            assert rel_err(out, ref) < 1.5e-2, (Lq, splits, rel_err(out, ref))
            assert torch.allclose(lse.double(), ref_lse.double(), atol=2e-2, rtol=1e-3)


def test_cuda_decode_half_precision(decode_poison):
    from flash_dmattn.backends.cuda.kernels import cuda_decode_forward

    _cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    B, Lq, H, Hkv, Lk, D = 2, 1, 32, 8, 5000, 128
    q, k, v = (torch.randn(B, L, n, D, device="cuda", generator=g).half()
               for L, n in ((Lq, H), (Lk, Hkv), (Lk, Hkv)))
    mask, bias = _decode_aux("per_key", B, Lq, H, Hkv, Lk, torch.float16, g)
    cs = torch.tensor([4999, 1234], device="cuda", dtype=torch.int32)
    out, _ = cuda_decode_forward(q, k, v, mask, bias, 0.09, True, 30.0, cs)
    ref, _ = _decode_reference(q, k, v, mask, bias, 0.09, True, 30.0, cs)
    assert not out.isnan().any() and rel_err(out, ref) < 3e-3, rel_err(out, ref)


@pytest.mark.parametrize("page", [16, 48, 128])
@pytest.mark.parametrize("kind", ["per_key", "full"])
def test_cuda_decode_paged_equals_contiguous(decode_poison, page, kind):
    from flash_dmattn.backends.cuda.kernels import cuda_decode_forward

    _cuda()
    g = torch.Generator(device="cuda").manual_seed(page)
    B, Lq, H, Hkv, D = 3, 2, 16, 4, 128
    Lk = page * (4096 // page)
    q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    mask, bias = _decode_aux(kind, B, Lq, H, Hkv, Lk, torch.bfloat16, g)
    k_pool, v_pool, table = _to_pages(k, v, page, g)
    cs = torch.tensor([Lk, 0, page + 3], device="cuda", dtype=torch.int32)
    for cache in (None, cs):
        for splits in (1, 5):
            paged = cuda_decode_forward(q, k_pool, v_pool, mask, bias, 0.1, True, 0.0, cache,
                                        block_table=table, num_splits=splits)
            contig = cuda_decode_forward(q, k, v, mask, bias, 0.1, True, 0.0, cache,
                                         num_splits=splits)
            # The same tiles in the same order: bitwise equal (NaN pool pages never read).
            assert torch.equal(paged[0], contig[0]) and torch.equal(paged[1], contig[1])
    ref, _ = _decode_reference(q, k, v, mask, bias, 0.1, True, 0.0, cs)
    assert rel_err(paged[0], ref) < 1.5e-2


def test_cuda_decode_neg_inf_bias_and_fully_masked_groups(decode_poison):
    from flash_dmattn.backends.cuda.kernels import cuda_decode_forward

    _cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    B, Lq, H, Hkv, Lk, D = 2, 2, 8, 2, 700, 64
    q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    mask = torch.ones(B, Hkv, Lq, Lk, device="cuda", dtype=torch.bool)
    mask[0, 1] = False  # kv head 1 of batch 0: every row of its group fully masked
    bias = torch.randn(B, H, Lq, Lk, device="cuda", generator=g).to(torch.bfloat16)
    bias[1, :, 0] = float("-inf")  # whole rows of -inf bias
    bias[:, :, :, ::3] = float("-inf")
    cs = torch.tensor([700, 333], device="cuda", dtype=torch.int32)
    for splits in (1, 4):
        out, lse = cuda_decode_forward(q, k, v, mask, bias, 0.125, False, 0.0, cs,
                                       num_splits=splits)
        assert not out.isnan().any()
        assert torch.isneginf(lse[0, 4:]).all() and (out[0, :, 4:] == 0).all()
        assert torch.isneginf(lse[1, :, 0]).all() and (out[1, 0] == 0).all()
        ref, _ = _decode_reference(q, k, v, mask, bias, 0.125, False, 0.0, cs)
        assert rel_err(out, ref) < 1.5e-2


def test_cuda_decode_through_the_public_api_with_grads():
    # cache_seqlens with gradients: decode forward, backward with the cache folded into the mask.
    backend = _cuda()
    g = torch.Generator(device="cuda").manual_seed(9)
    B, Lq, H, Hkv, Lk, D = 2, 1, 8, 2, 2000, 64
    q = torch.randn(B, Lq, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(B, Hkv, 1, Lk, device="cuda", generator=g).to(torch.bfloat16)
    mask = bias > -1
    cs = torch.tensor([1500, 2000], device="cuda", dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    inputs = AttentionInputs.from_args(*leaves[:3], mask, leaves[3], None, True,
                                       cache_seqlens=cs)
    assert backend.not_supported_reasons(inputs) == []
    out = backend.attention(inputs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref, _ = _decode_reference(*ref_leaves[:3], mask, ref_leaves[3], D ** -0.5, True, 0.0, cs)
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    assert rel_err(out, ref) < 1.5e-2
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert rel_err(a, b) < 3e-2, (name, rel_err(a, b))
    # Paged KV is forward-only; rows beyond the tile are declined, each with its reason.
    k_pool, v_pool, table = _to_pages(k, v, 16, g)
    paged = AttentionInputs.from_args(leaves[0], k_pool, v_pool, block_table=table)
    assert any("forward-only in cuda" in r for r in backend.not_supported_reasons(paged))
    qbig = torch.randn(B, 17, H, D, device="cuda", dtype=torch.bfloat16)
    many = AttentionInputs.from_args(qbig, k, v, cache_seqlens=cs)
    assert any("rows" in r for r in backend.not_supported_reasons(many))
