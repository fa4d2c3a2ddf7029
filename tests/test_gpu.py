"""GPU equivalence: every backend available on CUDA against the reference, fwd and bwd."""
import pytest
import torch

from flash_dmattn import flash_dmattn_func, get_available_backends, registry
from flash_dmattn.inputs import AttentionInputs
from flash_dmattn.reference import reference_attention

from cases import FIXED

pytestmark = pytest.mark.gpu

FAST_BACKENDS = ["triton", "flex", "cuda"]
# Inputs a backend documents declining (docs/contract.md: an explicit backend never falls back): the test
# asserts the decline and its reason instead of skipping the case. (cuda takes the float32
# "neg_inf" bias: it converts it for its kernels.)
DECLINED = {}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_problem(b, lq, lk, h, hkv, d, dtype, mask_kind, bias_kind, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(b, lq, h, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(b, lk, hkv, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(b, lk, hkv, d, device=dev, dtype=dtype, generator=g)
    bias = None
    if bias_kind == "per_key":
        bias = torch.randn(b, hkv, 1, lk, device=dev, dtype=dtype, generator=g)
    elif bias_kind == "full":
        bias = torch.randn(b, h, lq, lk, device=dev, dtype=dtype, generator=g)
    elif bias_kind == "neg_inf":
        bias = torch.randn(1, 1, lq, lk, device=dev, dtype=torch.float32, generator=g)
        bias[..., ::7, :] = float("-inf")  # whole rows: output 0, no NaN
        bias[..., :, ::3] = float("-inf")
    mask = None
    if mask_kind == "topk":  # per-query top-w keys, the dynamic-mask workload
        w = max(1, lk // 8)
        scores = torch.rand(b, hkv, lq, lk, device=dev, generator=g)
        idx = scores.topk(w, dim=-1).indices
        mask = torch.zeros(b, hkv, lq, lk, device=dev, dtype=torch.bool).scatter_(-1, idx, True)
        mask[:, :, : min(lq, 5)] = False  # fully masked rows
    elif mask_kind == "block_sparse":  # per-key, 128-key blocks ~25% live
        live = torch.rand(b, 1, 1, -(-lk // 128), device=dev, generator=g) < 0.25
        mask = live.repeat_interleave(128, dim=-1)[..., :lk]
    elif mask_kind == "scattered_key":  # per-kv-head per-key: live blocks + scattered keys
        blocks = torch.rand(b, hkv, 1, -(-lk // 64), device=dev, generator=g) < 0.3
        mask = blocks.repeat_interleave(64, dim=-1)[..., :lk]
        mask |= torch.rand(b, hkv, 1, lk, device=dev, generator=g) < 0.05
    elif mask_kind == "padding":
        mask = torch.ones(b, 1, 1, lk, device=dev, dtype=torch.bool)
        mask[0, ..., lk // 2:] = False
    return q, k, v, mask, bias


def check(backend, problem, causal, softcap=0.0, grads=True):
    q, k, v, mask, bias = problem
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    leaves = [t.detach().requires_grad_(grads) for t in leaves]
    q, k, v = leaves[:3]
    bias = leaves[3] if bias is not None else None
    fn = flash_dmattn_func if backend == "auto" else registry.get_backend(backend)
    inputs = AttentionInputs.from_args(q, k, v, mask, bias, None, causal, softcap)
    out = fn(q, k, v, mask, bias, is_causal=causal, softcap=softcap) if backend == "auto" else fn.attention(inputs)
    ref_leaves = [t.detach().float().requires_grad_(grads) for t in leaves]
    ref, _ = reference_attention(*ref_leaves[:3], mask, ref_leaves[3] if bias is not None else None,
                                 inputs.softmax_scale, causal, softcap)
    assert not out.isnan().any()
    # bf16 inputs, fp32 accumulation on both sides: relative error ~ 2^-8 from output rounding
    tol = 1.5e-2 if q.dtype == torch.bfloat16 else 3e-3
    assert rel_err(out, ref) < tol
    if not grads:
        return
    gout = torch.randn_like(ref)
    got = torch.autograd.grad(out, leaves, gout.to(out.dtype))
    want = torch.autograd.grad(ref, ref_leaves, gout)
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert a.shape == b.shape and a.dtype == leaves[["dq", "dk", "dv", "dbias"].index(name)].dtype
        assert not a.isnan().any(), name
        # gradients sum over up to Lq*Lk bf16 products: allow 2x the forward tolerance
        assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [(1, 1024, 1024, 8, 2, 64), (2, 511, 1537, 4, 4, 128), (1, 2048, 777, 4, 1, 64)],
    ids=["square", "lq<lk", "lq>lk"],
)
@pytest.mark.parametrize("mask_kind,bias_kind", [
    (None, None), ("topk", "per_key"), ("block_sparse", "full"), ("padding", "neg_inf"),
    ("scattered_key", "per_key"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_backend_matches_reference(backend, shape, mask_kind, bias_kind, causal):
    if backend not in get_available_backends():
        pytest.skip(f"{backend} unavailable here")
    problem = make_problem(*shape, torch.bfloat16, mask_kind, bias_kind)
    declined = DECLINED.get((backend, bias_kind))
    if declined is not None:
        q, k, v, mask, bias = problem
        inputs = AttentionInputs.from_args(q, k, v, mask, bias.requires_grad_(), None, causal)
        reasons = registry.get_backend(backend).not_supported_reasons(inputs)
        assert any(declined in r for r in reasons), reasons
        return
    check(backend, problem, causal)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backend_long_sequence_and_softcap(backend, dtype):
    problem = make_problem(1, 8192, 8192, 4, 2, 128, dtype, "topk", "per_key", seed=3)
    check(backend, problem, causal=True, softcap=30.0)


@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"{c.seqlen_q}x{c.seqlen_k}")
def test_reference_on_cuda_matches_cpu(case):
    cpu = case.tensors(dtype=torch.float64)
    gpu = case.tensors(dtype=torch.float64, device="cuda")
    a = flash_dmattn_func(*cpu, case.scale, case.causal, case.softcap)
    registry_warns = pytest.warns(RuntimeWarning, match="torch-reference")
    with registry_warns:  # fp64 on CUDA: the fast backends decline, the reference warns
        b = flash_dmattn_func(*gpu, case.scale, case.causal, case.softcap)
    torch.testing.assert_close(b.cpu(), a, atol=1e-10, rtol=1e-10)


def test_auto_dispatch_picks_a_fast_backend_on_cuda():
    q, k, v, mask, bias = make_problem(1, 256, 256, 4, 2, 64, torch.bfloat16, "topk", "per_key")
    inputs = AttentionInputs.from_args(q, k, v, mask, bias, None, True)
    assert registry.select_backend(inputs).name != "torch-reference"


@pytest.mark.parametrize("policy", ["always", "auto"])
@pytest.mark.parametrize("d", [64, 128])
def test_triton_gather_mode_dynamic_mask(policy, d, monkeypatch):
    """The dynamic-mask workload's mask (per-query top-k of a per-key bias among the causally
    visible keys) in the Triton backend's gather mode, which `auto` must choose for it."""
    if "triton" not in get_available_backends():
        pytest.skip("triton unavailable here")
    from flash_dmattn.planning.gather import plan_key_gather
    from flash_dmattn.utils.mask import create_mask

    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", policy)
    b, lq, lk, h, hkv = 2, 4093, 4096, 8, 2
    q, k, v, _, bias = make_problem(b, lq, lk, h, hkv, d, torch.bfloat16, None, "per_key", seed=5)
    i = torch.arange(lq, device="cuda")[:, None]
    j = torch.arange(lk, device="cuda")[None, :]
    visible = (j <= i + (lk - lq))[None, None]
    mask = create_mask(bias, visible, b, lq, lk, 512, torch.finfo(bias.dtype).min)
    mask[0, 1, 100:300] = False  # fully masked rows, including whole query tiles
    plan = plan_key_gather(mask, bias, lq, lk, h, True, 128, 64)
    assert plan is not None and int(plan.cnt.max()) < lk // 2
    check("triton", (q, k, v, mask, bias), causal=True)


def test_triton_lagged_gather_decisions_stay_exact():
    """Auto gather decisions taken from the previous call of the same shapes (the planner's
    lagged policy): a dense per-query mask after a sparse one runs gathered, a sparse one
    after a dense one on tile lists (its totals decide the next call); every call matches
    the reference."""
    if "triton" not in get_available_backends():
        pytest.skip("triton unavailable here")
    from flash_dmattn.planning import gather, gather_verdicts

    gather_verdicts._LAGGED_TOTALS.clear()
    b, lq, lk, h, hkv = 1, 1000, 1024, 4, 2
    q, k, v, _, bias = make_problem(b, lq, lk, h, hkv, 64, torch.bfloat16, "none", "per_key",
                                    seed=7)
    g = torch.Generator(device="cuda").manual_seed(7)
    # Sparse: each query keeps most of one shared 10 % of the keys, so a query tile's union
    # stays small (make_problem's top-k rows pick keys independently: their union is every
    # key, which the auto policy rightly runs on tile lists).
    shared = torch.rand(b, hkv, 1, lk, device="cuda", generator=g) < 0.1
    sparse = shared & (torch.rand(b, hkv, lq, lk, device="cuda", generator=g) < 0.9)
    sparse[:, :, :3] = False  # fully masked rows
    dense = torch.rand(b, hkv, lq, lk, device="cuda", generator=g) < 0.7
    gathers = lambda m: gather.plan_key_gather(m, bias, lq, lk, h, True, 128, 64,
                                               policy="auto") is not None
    assert gathers(sparse) and not gathers(dense)  # each one's own choice
    for mask in (sparse, dense, sparse, sparse):
        check("triton", (q, k, v, mask, bias), causal=True)
    gather_verdicts._LAGGED_TOTALS.clear()


@pytest.mark.parametrize("warm", [True, False])
def test_triton_gather_plan_in_a_cuda_graph(warm):
    """A per-query-mask forward captured in a CUDA graph (the auto gather policy, lagged):
    after eager calls the plan follows the verdict the host already read, with none it takes
    tile lists; either way no event is waited on while capturing, and the replay matches the
    eager result."""
    if "triton" not in get_available_backends():
        pytest.skip("triton unavailable here")
    from flash_dmattn.backends.triton import forward as fwd_mod
    from flash_dmattn.planning import gather_verdicts

    gather_verdicts._LAGGED_TOTALS.clear()
    b, l, h, hkv = 1, 1024, 4, 2
    q, k, v, _, bias = make_problem(b, l, l, h, hkv, 64, torch.bfloat16, "none", "per_key",
                                    seed=8)
    g = torch.Generator(device="cuda").manual_seed(8)
    shared = torch.rand(b, hkv, 1, l, device="cuda", generator=g) < 0.1
    mask = shared & (torch.rand(b, hkv, l, l, device="cuda", generator=g) < 0.9)
    fwd = lambda: fwd_mod.attention_forward(q, k, v, mask, bias, 64 ** -0.5, True, 0.0)
    for _ in range(3):  # compiles both plans' kernels; the verdicts settle on gathering
        want = fwd()
    torch.cuda.synchronize()
    if not warm:
        gather_verdicts._LAGGED_TOTALS.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fwd()
    graph.replay()
    torch.cuda.synchronize()
    if warm:  # the same plan as the eager calls: the same bits
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref, _ = reference_attention(q.float(), k.float(), v.float(), mask, bias.float(),
                                 64 ** -0.5, True, 0.0)
    assert not got[0].isnan().any()
    assert rel_err(got[0], ref) < 1.5e-2  # bf16 output rounding, as check()
    gather_verdicts._LAGGED_TOTALS.clear()


def _plain_rows_auto(monkeypatch):
    """The Triton forward module, with plain_rows in ``auto`` on fresh verdicts that sample
    every call and split calls of any size (skips where Triton cannot run)."""
    if "triton" not in get_available_backends():
        pytest.skip("triton unavailable here")
    from flash_dmattn.backends.triton import forward as fwd_mod
    from flash_dmattn.planning import plain_rows

    monkeypatch.setattr(plain_rows, "VERDICTS", plain_rows.VerdictMemo())
    monkeypatch.setattr(plain_rows, "SAMPLE_EVERY", 1)
    monkeypatch.setattr(plain_rows, "MIN_WAVES", 0)  # small enough to run quickly
    return fwd_mod


@pytest.mark.parametrize("causal", [False, True])
def test_triton_plain_rows_are_exact(causal, monkeypatch):
    """A per-key mask's uncut rows run without the mask, its cut rows in the net kernel
    (plain_rows, ``auto``): block-sparse masks (whole 128-key blocks: no row cut) alternate
    with ones whose second head adds scattered keys in the second half (cut rows beside
    uncut ones), so the two-kernel forward meets cut rows it did not predict. Poisoned
    outputs; every call matches the reference, outputs and gradients."""
    _plain_rows_auto(monkeypatch)
    from flash_dmattn.backends.triton import common, forward_kernel

    monkeypatch.setattr(common, "DEBUG_POISON", True)
    guards = []
    real = forward_kernel.launch_fwd_untuned

    def spy(grid, args, meta):
        guards.append(int(meta.get("CUT_ROWS", False)))
        return real(grid, args, meta)
    monkeypatch.setattr(forward_kernel, "launch_fwd_untuned", spy)
    b, lq, lk, h, hkv = 2, 1500, 2000, 8, 2  # a ragged last key tile, Lq != Lk
    q, k, v, _, bias = make_problem(b, lq, lk, h, hkv, 128, torch.bfloat16, "none", "per_key",
                                    seed=9)
    g = torch.Generator(device="cuda").manual_seed(9)
    blocks = torch.rand(b, hkv, 1, -(-lk // 128), device="cuda", generator=g) < 0.3
    blocks[..., -1] = True
    aligned = blocks.repeat_interleave(128, -1)[..., :lk]
    scattered = torch.rand(b, hkv, 1, lk, device="cuda", generator=g) < 0.2
    scattered[..., : lk // 2] = False
    scattered[:, 0] = False
    mixed = aligned | scattered
    for mask in (aligned, mixed, aligned, aligned):
        check("triton", (q, k, v, mask, bias), causal=causal)
        torch.cuda.synchronize()  # the verdict of this call reaches the host before the next
    # The net ran for the second and fourth calls (after a call with no cut row).
    assert guards == [1, 1]


def test_triton_plain_rows_in_a_cuda_graph(monkeypatch):
    """A per-key forward captured in a CUDA graph after eager calls settled the lagged verdict
    (no cut row: the split is captured) replays to the eager result, and capturing does not
    query events (not permitted while a stream captures)."""
    fwd_mod = _plain_rows_auto(monkeypatch)
    b, l, h, hkv = 1, 1024, 4, 2
    q, k, v, _, _ = make_problem(b, l, l, h, hkv, 64, torch.bfloat16, "none", None, seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    blocks = torch.rand(b, hkv, 1, l // 128, device="cuda", generator=g) < 0.5
    blocks[..., 0] = True
    mask = blocks.repeat_interleave(128, -1)
    scale = 64 ** -0.5
    fwd = lambda: fwd_mod.attention_forward(q, k, v, mask, None, scale, True, 0.0)
    for _ in range(2):
        want = fwd()
        torch.cuda.synchronize()
    from flash_dmattn.backends.triton import forward_kernel

    nets = []
    real = forward_kernel.launch_fwd_untuned
    monkeypatch.setattr(forward_kernel, "launch_fwd_untuned",
                        lambda *a: (nets.append(1), real(*a)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fwd()
    assert nets == [1]  # the split was captured
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("d,mask_heads,bias_heads",
                         [(64, "1", "K"), (128, "K", "H"), (128, "H", "1"), (128, "-", "-"),
                          (64, "-", "H")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend_name", ["triton", "cuda"])
def test_varlen_kernels_match_reference(backend_name, d, mask_heads, bias_heads, causal):
    """Packed sequences on the Triton / CUDA kernels (bf16) vs the fp32 per-sequence reference:
    16 sequences of random lengths 1..2048 (Lq != Lk for half; lengths 1, 1 and 129 among
    them), GQA 8/2, per-key mask + bias ("-": none), one fully masked sequence; gradients incl.
    dbias, and a bitwise-deterministic backward."""
    if backend_name not in get_available_backends():
        pytest.skip(f"{backend_name} unavailable here")
    from flash_dmattn.inputs import VarlenInputs
    from flash_dmattn.reference import reference_varlen_attention
    from flash_dmattn.utils.padding import cu_seqlens_from_lengths

    g = torch.Generator().manual_seed(11 + d)
    n, h, hkv = 16, 8, 2
    lens_q = torch.randint(1, 2049, (n,), generator=g)
    lens_k = torch.where(torch.arange(n) % 2 == 0, lens_q, torch.randint(1, 2049, (n,), generator=g))
    lens_q[1], lens_k[1], lens_q[2] = 1, 1, 129  # one-token sequence; odd, just over a tile
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q).cuda(), cu_seqlens_from_lengths(lens_k).cuda()
    tq, tk = int(lens_q.sum()), int(lens_k.sum())
    q, k, v = (torch.randn(t, hh, d, generator=g).to("cuda", torch.bfloat16)
               for t, hh in ((tq, h), (tk, hkv), (tk, hkv)))
    heads = {"1": (), "K": (hkv,), "H": (h,)}
    mask = bias = None
    if mask_heads != "-":
        mask = torch.rand(*heads[mask_heads], tk, generator=g) > 0.3
        mask[..., int(cu_k[3]):int(cu_k[4])] = False  # sequence 3: every key masked
        mask = mask.cuda()
    if bias_heads != "-":
        bias = torch.randn(*heads[bias_heads], tk, generator=g).to("cuda", torch.bfloat16)
    max_q, max_k = int(lens_q.max()), int(lens_k.max())

    backend = registry.get_backend(backend_name)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias) if t is not None]
    grads = []
    for _ in range(2):
        inputs = VarlenInputs.from_args(*leaves[:3], cu_q, cu_k, max_q, max_k, mask,
                                        leaves[3] if bias is not None else None, None, causal,
                                        deterministic=True)
        assert not backend.varlen_not_supported_reasons(inputs)
        out = backend.varlen_attention(inputs)
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        grads.append(torch.autograd.grad(out, leaves, gout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # deterministic: bitwise identical

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_inputs = VarlenInputs.from_args(*ref_leaves[:3], cu_q, cu_k, max_q, max_k, mask,
                                        ref_leaves[3] if bias is not None else None, None, causal)
    ref, _, _ = reference_varlen_attention(ref_inputs)
    assert not out.isnan().any()
    if mask is not None:
        seq3 = slice(int(cu_q[3]), int(cu_q[4]))
        assert torch.equal(out[seq3].float(), torch.zeros_like(ref[seq3]))
    tol = 1.5e-2
    assert rel_err(out, ref) < tol
    want = torch.autograd.grad(ref, ref_leaves, gout.float())
    for name, a, b, t in zip(["dq", "dk", "dv", "dbias"], grads[0], want, leaves):
        assert a.shape == t.shape and a.dtype == t.dtype, name
        assert not a.isnan().any(), name
        assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))


def _sdpa_nodes(out):
    """Names of the SDPA autograd nodes in ``out``'s graph (which SDPA kernel ran)."""
    names, todo, seen = [], [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "ScaledDotProduct" in node.name():
            names.append(node.name())
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("causal", [True, False])
def test_hopper_plain_training_is_one_sdpa_call_cudnn_first(causal, monkeypatch):
    """On sm_90 a plain bf16 training call with one kv head per query head (policy rule
    hopper-plain-training) runs on torch-reference as one SDPA call, on the library's
    (B, L, H, D) tensors as transposed views, with cuDNN's attention first: SDPA's autograd
    node is cuDNN's; output and gradients match the float32 reference within this file's
    tolerances, and the cuda kernels' (the choice before the rule) alike. The second call is
    served from the memo (registry.run_plain), the same way. A deterministic call runs no
    SDPA, also where torch-reference is all that is left."""
    from torch.nn.attention import SDPBackend

    from flash_dmattn import policy
    from flash_dmattn.reference import sdpa_cpu

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the rule is Hopper's (sm_90)")
    if not sdpa_cpu.SDPA_SETS_PRIORITY:
        pytest.skip("this torch's sdpa_kernel takes no set_priority: the rule does not apply")
    q, k, v, _, _ = make_problem(2, 1024, 1024, 8, 8, 128, torch.bfloat16, None, None, seed=5)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    inputs = AttentionInputs.from_args(*leaves, None, None, None, causal)
    assert policy.rank(inputs).rule.key == "hopper-plain-training"
    assert registry.auto_backend_name(inputs) == "torch-reference"

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    priority = getattr(torch._C, "_get_sdp_priority_order", None)

    def spy(*args, **kwargs):
        calls.append(dict(cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
                          first=priority()[0] if priority else None,
                          strides=[t.stride() for t in args[:3]]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    gout = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref, _ = reference_attention(*ref_leaves, None, None, inputs.softmax_scale, causal, 0.0)
    want = torch.autograd.grad(ref, ref_leaves, gout)
    cuda = None
    if "cuda" in get_available_backends():
        out_c = registry.get_backend("cuda").attention(inputs)
        cuda = (out_c, torch.autograd.grad(out_c, leaves, gout.to(out_c.dtype)))
    tol = 1.5e-2  # bf16, as check()
    for served in (False, True):
        del calls[:]
        hits = registry.DISPATCH_MEMO.hits
        out = flash_dmattn_func(*leaves, is_causal=causal)
        if served:  # registry.run_plain: a memo hit, no AttentionInputs
            assert registry.DISPATCH_MEMO.hits - hits == 1
        assert len(calls) == 1, calls
        call = calls[0]
        assert call["cudnn"]
        if priority is not None:
            assert call["first"] == int(SDPBackend.CUDNN_ATTENTION)
        # The (B, L, H, D) tensors' transposed views, not copies.
        assert call["strides"] == [t.transpose(1, 2).stride() for t in leaves]
        nodes = _sdpa_nodes(out)
        assert len(nodes) == 1 and "Cudnn" in nodes[0], nodes
        grads = torch.autograd.grad(out, leaves, gout.to(out.dtype))
        assert len(calls) == 1  # the backward is SDPA's own, no second call
        assert not out.isnan().any() and rel_err(out, ref) < tol
        for name, a, b in zip(("dq", "dk", "dv"), grads, want):
            assert not a.isnan().any(), name
            assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))
        if cuda is not None:
            assert rel_err(out, cuda[0]) < tol
            for name, a, b in zip(("dq", "dk", "dv"), grads, cuda[1]):
                assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))
    # deterministic=True: not this rule; with torch-reference the only backend left (its
    # choice remembered for the signature) it runs without SDPA on both paths.
    det = AttentionInputs.from_args(*leaves, None, None, None, causal, None, True)
    assert policy.rank(det).rule.key == "hopper-dense"
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "cuda,triton,flex")
    del calls[:]
    with pytest.warns(RuntimeWarning, match="torch-reference"):  # the slow fallback, as it is
        for _ in range(2):
            out = flash_dmattn_func(*leaves, is_causal=causal, deterministic=True)
            torch.autograd.grad(out, leaves, gout.to(out.dtype))
    assert calls == [] and _sdpa_nodes(out) == []


@pytest.mark.parametrize("masked", [False, True])
def test_use_deterministic_algorithms_gives_reproducible_gradients(masked, monkeypatch):
    """Under torch.use_deterministic_algorithms(True), auto-dispatch's plain and DMA training
    calls run (no internal op raises), their output and gradients are bitwise the same twice,
    and they match the float32 reference as check() asks of every backend."""
    from flash_dmattn.utils.mask import topk_intervals

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what the setting asks of users
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, L, H, D = 1, 1000, 4, 64
    Hkv = 2 if masked else H
    q = torch.randn(B, L, H, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(B, L, Hkv, D, device="cuda", generator=gen).bfloat16().requires_grad_()
            for _ in range(2))
    leaves, mask, bias = [q, k, v], None, None
    if masked:
        bias = torch.randn(B, Hkv, 1, L, device="cuda", generator=gen).bfloat16()
        mask = topk_intervals(bias, 256, is_causal=True)
        bias.requires_grad_()
        leaves.append(bias)
    gout = torch.randn(B, L, H, D, device="cuda", generator=gen)

    def run():
        out = flash_dmattn_func(q, k, v, mask, bias, is_causal=True)
        return [out] + list(torch.autograd.grad(out, leaves, gout.bfloat16()))

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    dense = mask.to_dense(L) if masked else None
    ref, _ = reference_attention(*ref_leaves[:3], dense, ref_leaves[3] if masked else None,
                                 D ** -0.5, True, 0.0)
    want = [ref] + list(torch.autograd.grad(ref, ref_leaves, gout))
    # bf16 as check(): 1.5e-2 for the output, twice that for gradients
    for i, (a, b) in enumerate(zip(first, want)):
        assert rel_err(a, b) < (1.5e-2 if i == 0 else 3e-2), i
