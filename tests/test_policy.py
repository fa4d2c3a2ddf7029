"""The dispatch policy (flash_dmattn/policy.py) on CPU, with described calls on simulated GPU
generations: every call finds a rule, each rule's order is what auto-dispatch runs, cuda is
passed over with a reason off Hopper, and ``info --explain`` says why."""
import itertools

import pytest
import torch

from flash_dmattn import policy, registry
from flash_dmattn.__main__ import described_call, main
from flash_dmattn.backends.base import Backend
from flash_dmattn.policy import CallFeatures, PRIORITY, RULES, rank_features

GPU_GENERATIONS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]


def every_features():
    """Every combination of the features the rules read, on CPU and each GPU generation."""
    devices = [("cpu", None)] + [("cuda", cc) for cc in GPU_GENERATIONS]
    kinds = ("none", "per-key", "per-query")
    for (dev, cc), packed, decode, cache, mask, bias, training in itertools.product(
            devices, (False, True), (False, True), (False, True), kinds + ("intervals",), kinds,
            (False, True)):
        yield CallFeatures(dev, cc, packed, decode, cache, mask, bias, training,
                           training and bias != "none")


def test_every_call_has_one_rule_and_a_complete_order():
    for f in every_features():
        ranking = rank_features(f)
        assert sorted(ranking.order) == sorted(PRIORITY), (f, ranking.order)
        assert set(ranking.passed_over) == set(ranking.fallback)
        assert all(ranking.passed_over.values())


def test_rules_are_well_formed():
    keys = [r.key for r in RULES]
    assert len(keys) == len(set(keys))
    for rule in RULES:
        assert rule.arch in ("cpu", "sm_90", "other GPUs", "any")
        assert rule.prefer and set(rule.prefer) <= set(PRIORITY)
        assert len(set(rule.prefer)) == len(rule.prefer)
        assert rule.reason and rule.evidence and rule.when
        assert set(rule.passed_over) <= set(PRIORITY) - set(rule.prefer)
    text = policy.table()
    assert all(r.key in text for r in RULES)


@pytest.mark.parametrize("cc", [c for c in GPU_GENERATIONS if c != (9, 0)])
def test_cuda_is_passed_over_with_a_reason_off_hopper(cc, monkeypatch):
    for f in every_features():
        if f.capability != cc:
            continue
        ranking = rank_features(f)
        assert "cuda" not in ranking.prefer
        assert "sm_90" in ranking.passed_over["cuda"]
    monkeypatch.setenv(policy.CUDA_AUTO_ENV, "1")
    ranking = rank_features(CallFeatures("cuda", cc, training=True))
    assert ranking.prefer[0] == "cuda" and "cuda" not in ranking.passed_over


def test_cpu_prefers_the_reference_and_keeps_the_others_as_fallbacks():
    ranking = rank_features(CallFeatures("cpu", None, training=True))
    assert ranking.prefer == ("torch-reference",)
    assert ranking.fallback == ("cuda", "triton", "flex")  # priority order, as before
    assert "interpreter" in ranking.passed_over["triton"]
    assert "eagerly" in ranking.passed_over["flex"]


def test_hopper_orders():
    hop = dict(device="cuda", capability=(9, 0))
    # The case: per-key mask + per-key bias training (cuda 1.7x triton on an H100).
    assert rank_features(CallFeatures(**hop, mask="per-key", bias="per-key", training=True,
                                      bias_grad=True)).prefer[0] == "cuda"
    for mask, bias, training in itertools.product(("none", "per-key", "per-query"),
                                                  ("none", "per-key"), (False, True)):
        f = CallFeatures(**hop, mask=mask, bias=bias, training=training)
        assert rank_features(f).order == ("cuda", "flex", "triton", "torch-reference")
    # Forward only with a per-query bias: cuda; training with one: not measured, flex first.
    assert rank_features(CallFeatures(**hop, bias="per-query")).prefer[0] == "cuda"
    assert rank_features(CallFeatures(**hop, bias="per-query", training=True)).order == (
        "flex", "triton", "cuda", "torch-reference")
    assert rank_features(CallFeatures(**hop, mask="intervals", training=True)).order == (
        "cuda", "triton", "flex", "torch-reference")
    assert rank_features(CallFeatures(**hop, decode=True)).order == (
        "triton", "cuda", "flex", "torch-reference")
    assert rank_features(CallFeatures(**hop, packed=True)).prefer == (
        "cuda", "triton", "torch-reference")
    assert rank_features(CallFeatures(**hop, packed=True, training=True)).prefer == (
        "triton", "cuda", "torch-reference")


def test_other_gpus_keep_flex_then_triton_and_triton_where_flex_cannot():
    # Triton yields to flex on an unmeasured generation, but where flex declines (packed
    # sequences, paged KV) it ranks before the torch-reference fallback.
    for cc in ((8, 0), (10, 0)):
        gpu = dict(device="cuda", capability=cc)
        assert rank_features(CallFeatures(**gpu)).prefer == ("flex", "triton", "torch-reference")
        assert rank_features(CallFeatures(**gpu, decode=True)).prefer[0] == "triton"
        assert rank_features(CallFeatures(**gpu, packed=True)).prefer == (
            "triton", "torch-reference")
        assert rank_features(CallFeatures(**gpu, mask="intervals")).prefer[0] == "triton"


def test_features_of_real_inputs():
    from flash_dmattn.inputs import AttentionInputs

    q = torch.randn(2, 8, 4, 16, requires_grad=True)
    k = torch.randn(2, 8, 2, 16)
    inputs = AttentionInputs.from_args(q, k, k, torch.ones(2, 2, 1, 8, dtype=torch.bool),
                                       torch.zeros(1, 1, 8, 8, requires_grad=True))
    f = policy.features_of(inputs)
    assert (f.device, f.capability, f.mask, f.bias, f.training, f.bias_grad) == (
        "cpu", None, "per-key", "per-query", True, True)
    with torch.no_grad():
        assert not policy.features_of(inputs).training
    assert not policy.features_of(inputs).plain and policy.features_of(inputs).kv_bytes == 0
    decode = AttentionInputs.from_args(torch.randn(1, 1, 8, 16), torch.randn(1, 4096, 2, 16),
                                       torch.randn(1, 4096, 2, 16))
    f = policy.features_of(decode)
    assert f.decode and f.plain and f.kv_bytes == 2 * 4096 * 2 * 16 * 4
    # Anything one SDPA call would not compute makes a call not plain: extras, a float64
    # call, and causality where SDPA's top-left diagonal is not the library's bottom-right
    # one (several queries against more keys: speculative decoding).
    for q_len, dtype, kw in ((1, torch.float32, dict(softcap=5.0)),
                             (1, torch.float32, dict(dropout_p=0.1)),
                             (1, torch.float32, dict(return_attn_probs=True)),
                             (1, torch.float32, dict(attn_bias=torch.zeros(1, 2, 1, 4096))),
                             (1, torch.float64, dict()),
                             (4, torch.float32, dict(is_causal=True)),
                             (1, torch.float32, dict(is_causal=True))):
        extra = AttentionInputs.from_args(torch.randn(1, q_len, 8, 16, dtype=dtype),
                                          torch.randn(1, 4096, 2, 16, dtype=dtype),
                                          torch.randn(1, 4096, 2, 16, dtype=dtype), **kw)
        assert not policy.features_of(extra).plain, (q_len, dtype, kw)
    square = AttentionInputs.from_args(torch.randn(1, 64, 8, 16), torch.randn(1, 64, 2, 16),
                                       torch.randn(1, 64, 2, 16), is_causal=True)
    assert policy.features_of(square).plain


@pytest.mark.parametrize("cc", GPU_GENERATIONS)
def test_small_plain_decoding_steps_run_as_one_sdpa_call(cc):
    """A plain decoding step over little K/V goes to torch-reference's SDPA call on every GPU
    (host bound: one SDPA call against the decode kernels' Triton launches); more K/V, a
    mask, a KV cache, training or a prefill keep the kernels' order."""
    gpu = dict(device="cuda", capability=cc, decode=True, plain=True)
    small = policy.PLAIN_DECODE_SDPA_MAX_BYTES
    ranking = rank_features(CallFeatures(**gpu, kv_bytes=small))
    assert ranking.rule.key == "gpu-plain-decode"
    assert ranking.prefer == ("torch-reference", "triton")
    assert "cuda" not in ranking.prefer and ranking.passed_over["cuda"]
    for f in (CallFeatures(**gpu, kv_bytes=small + 1),
              CallFeatures(**gpu, kv_bytes=1, training=True),
              CallFeatures(**dict(gpu, plain=False), kv_bytes=0, mask="per-key"),
              CallFeatures(**dict(gpu, decode=False), kv_bytes=1),
              CallFeatures(**gpu, kv_bytes=1, kv_cache=True)):
        assert rank_features(f).rule.key != "gpu-plain-decode", f
        assert rank_features(f).prefer[0] != "torch-reference", f
    assert rank_features(CallFeatures("cpu", None, decode=True, plain=True,
                                      kv_bytes=1)).rule.key == "cpu"


def test_the_reference_backend_serves_plain_cuda_calls_with_sdpa():
    from flash_dmattn.backends.reference import ReferenceBackend
    from flash_dmattn.reference.sdpa_cpu import sdpa_plain, sdpa_plain_cuda

    assert ReferenceBackend.plain_cuda_attention is sdpa_plain_cuda
    assert ReferenceBackend.plain_attention is sdpa_plain


# ---------------------------------------------------------------------------------------------
# hopper-plain-training: plain training calls of cuDNN's shapes run as one SDPA call
# ---------------------------------------------------------------------------------------------

def _plain_training_rule(capability=(9, 0), shape="B=2,H=8,Lq=512,D=128", dtype="bf16",
                         **call):
    """The rule auto-dispatch applies to a described call on a simulated GPU generation."""
    call.setdefault("train", True)
    with policy.simulated_capability(capability):
        inputs = described_call(shape=shape, dtype=dtype, capability=capability, **call)
        return policy.rank(inputs)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_plain_training_prefers_one_sdpa_call(dtype, d, causal):
    ranking = _plain_training_rule(shape=f"B=2,H=8,Hkv=8,Lq=512,D={d}", dtype=dtype,
                                   causal=causal)
    assert ranking.rule.key == "hopper-plain-training"
    assert ranking.order == ("torch-reference", "cuda", "flex", "triton")
    assert ranking.fallback == () and ranking.rule.reference_fast
    # Lq != Lk without causality is still one SDPA call.
    ranking = _plain_training_rule(shape=f"B=1,H=4,Lq=300,Lk=700,D={d}", dtype=dtype)
    assert ranking.rule.key == "hopper-plain-training"


DENSE = "hopper-dense"


@pytest.mark.parametrize("case,rule", [
    (dict(deterministic=True), DENSE),                    # SDPA's backward uses atomics
    (dict(shape="B=2,H=8,Hkv=2,Lq=512,D=128"), DENSE),    # grouped heads
    (dict(shape="B=2,H=8,Hkv=1,Lq=512,D=64"), DENSE),
    (dict(shape="B=2,H=8,Lq=512,D=256"), DENSE),          # head dim over 128
    (dict(shape="B=2,H=8,Lq=512,D=60"), DENSE),           # head dim not a multiple of 8
    (dict(dtype="fp32"), DENSE),
    (dict(dtype="fp64"), DENSE),
    (dict(train=False), DENSE),                           # inference
    (dict(mask="B,1,1,Lk"), DENSE),
    (dict(mask="B,H,Lq,Lk"), DENSE),
    (dict(bias="B,H,1,Lk", bias_grad=True), DENSE),
    (dict(bias="B,H,Lq,Lk", bias_grad=True), "hopper-per-query-bias-training"),
    (dict(softcap=30.0), DENSE),
    (dict(shape="B=2,H=8,Lq=300,Lk=700,D=128", causal=True), DENSE),  # not one SDPA call
    (dict(mask="intervals"), "hopper-key-intervals"),
    (dict(cache_seqlens=True), "hopper-decode"),
    (dict(shape="B=1,H=8,Lq=1,Lk=4096,D=128"), "hopper-decode"),  # a decoding shape
    (dict(varlen=True), "hopper-packed-training"),
    (dict(capability=(8, 0)), "gpu-dense"),
    (dict(capability=(8, 9)), "gpu-dense"),
    (dict(capability=(10, 0)), "gpu-dense"),
    (dict(capability=(12, 0)), "gpu-dense"),
], ids=str)
def test_hopper_plain_training_is_not_chosen_outside_it(case, rule):
    """Such calls keep the rule they had: on Hopper cuda first (hopper-dense, as before)."""
    ranking = _plain_training_rule(**case)
    assert ranking.rule.key == rule
    assert ranking.prefer[0] != "torch-reference"
    if rule == DENSE:
        assert ranking.order == ("cuda", "flex", "triton", "torch-reference")


def test_hopper_plain_training_needs_sdpa_kernel_priorities(monkeypatch):
    """A torch whose sdpa_kernel cannot put cuDNN's attention first keeps hopper-dense's order:
    SDPA's own order would take its flash kernel."""
    monkeypatch.setattr(policy, "SDPA_SETS_PRIORITY", False)
    monkeypatch.setattr(policy, "_RANKINGS", {})
    ranking = _plain_training_rule()
    assert ranking.rule.key == "hopper-dense" and ranking.prefer[0] == "cuda"


def test_hopper_plain_training_with_cuda_first_everywhere(monkeypatch):
    # FLASH_DMATTN_CUDA_AUTO=1 puts cuda first in every rule, this one too.
    monkeypatch.setenv(policy.CUDA_AUTO_ENV, "1")
    ranking = _plain_training_rule()
    assert ranking.rule.key == "hopper-plain-training"
    assert ranking.order == ("cuda", "torch-reference", "flex", "triton")


def test_features_of_fills_deterministic_and_cudnn_shape():
    from flash_dmattn.inputs import AttentionInputs

    def features(H=4, Hkv=4, D=64, dtype=torch.bfloat16, **kw):
        q = torch.randn(1, 16, H, D).to(dtype).requires_grad_()
        k, v = (torch.randn(1, 16, Hkv, D).to(dtype) for _ in range(2))
        return policy.features_of(AttentionInputs.from_args(q, k, v, **kw))

    f = features()
    assert f.cudnn_shape and f.plain and f.training and not f.deterministic
    assert features(deterministic=True).deterministic
    assert features(dtype=torch.float16, D=128).cudnn_shape
    for kw in (dict(Hkv=2), dict(Hkv=1), dict(D=256), dict(D=136), dict(D=60), dict(D=4),
               dict(dtype=torch.float32), dict(dtype=torch.float64)):
        assert not features(**kw).cudnn_shape, kw
    # cudnn_shape reads the shape and dtype alone: a masked call of such a shape has it too
    # (and is not plain).
    f = features(attn_mask=torch.ones(1, 4, 16, 16, dtype=torch.bool))
    assert f.cudnn_shape and not f.plain
    assert "deterministic" in features(deterministic=True).describe()
    assert policy.cudnn_attention_shape(torch.bfloat16, 8, 8, 128)
    assert not policy.cudnn_attention_shape(torch.bfloat16, 8, 8, 129)


def test_hopper_plain_training_runs_the_reference_without_a_fallback_warning(fake_backends):
    import warnings

    with policy.simulated_capability((9, 0)):
        inputs = _gpu_call((9, 0), shape="B=1,H=4,Lq=256,D=64", train=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert registry.select_backend(inputs).name == "torch-reference"
        # Where torch-reference cannot run, cuda comes next, as on hopper-dense.
        registry.DISPATCH_MEMO.clear()
        fake_backends["torch-reference"].supports = False
        assert registry.select_backend(inputs).name == "cuda"
        deterministic = _gpu_call((9, 0), shape="B=1,H=4,Lq=256,D=64", train=True,
                                  deterministic=True)
        fake_backends["torch-reference"].supports = True
        assert registry.select_backend(deterministic).name == "cuda"


def test_info_explain_names_the_rule(capsys):
    t1 = ["info", "--explain", "--shape", "B=1,H=16,Lq=16384,D=128", "--causal", "--train",
          "--capability", "9.0"]
    assert main(t1) == 0
    out = capsys.readouterr().out
    assert "dispatch rule: hopper-plain-training" in out and "auto takes: torch-reference" in out
    assert "a cuDNN attention shape" in out
    assert main(t1 + ["--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "dispatch rule: hopper-dense" in out and "auto takes: cuda" in out
    assert main(["info", "--explain", "--rules"]) == 0
    assert "hopper-plain-training [sm_90]" in capsys.readouterr().out


def test_sdpa_plain_cuda_asks_for_cudnn_first_when_training(monkeypatch):
    """The torch-reference backend's plain CUDA entry (the CPU plays the GPU here): a call that
    needs a gradient runs SDPA inside sdpa_kernel with cuDNN's attention first and
    set_priority (every kernel enabled now, in the rule's order); a forward-only call, as
    before, without it. Outputs and gradients are sdpa_plain's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_dmattn.reference import sdpa_cpu

    if not sdpa_cpu.SDPA_SETS_PRIORITY:
        pytest.skip("this torch's sdpa_kernel takes no set_priority")
    asked = []
    real = sdpa_cpu.sdpa_kernel

    def spy(backends, set_priority=False):
        asked.append((list(backends), set_priority))
        return real(backends, set_priority=set_priority)

    monkeypatch.setattr(sdpa_cpu, "sdpa_kernel", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 32, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    out = sdpa_cpu.sdpa_plain_cuda(q, k, v, None, True, 64, 64)
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert asked == [(order, True)]
    want = sdpa_cpu.sdpa_plain(q, k, v, None, True, 64, 64)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A kernel the caller switched off stays off.
    del asked[:]
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        sdpa_cpu.sdpa_plain_cuda(q, k, v, None, False, 64, 64)
    assert asked[-1] == ([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], True)
    # Forward only (decoding steps: host time) and what SDPA does not compute: no context.
    del asked[:]
    with torch.no_grad():
        sdpa_cpu.sdpa_plain_cuda(q, k, v, None, True, 64, 64)
    assert sdpa_cpu.sdpa_plain_cuda(q, k[:, :32], v[:, :32], None, True, 64, 32) is None
    assert asked == []


class _Fake(Backend):
    """A backend that supports what ``supports`` says and records that it ran."""

    def __init__(self, name, supports=True):
        super().__init__()
        self.name = name
        self.supports = supports

    def probe(self):
        return None

    def not_supported_reasons(self, inputs):
        return [] if self.supports else [f"{self.name} cannot"]

    def attention(self, inputs):
        raise AssertionError("not run in these tests")


@pytest.fixture
def fake_backends(monkeypatch):
    fakes = {name: _Fake(name) for name in PRIORITY}
    monkeypatch.setattr(registry, "_BACKENDS", fakes)
    return fakes


def _gpu_call(capability, **kw):
    return described_call(capability=capability, **kw)


def test_select_follows_the_rule_and_falls_back_to_passed_over(fake_backends):
    with policy.simulated_capability((8, 0)):
        inputs = _gpu_call((8, 0), shape="B=1,H=4,Lq=256,D=64", train=True)
        assert registry.select_backend(inputs).name == "flex"
        fake_backends["flex"].supports = False
        assert registry.select_backend(inputs).name == "triton"
        fake_backends["triton"].supports = False
        fake_backends["torch-reference"].supports = False
        # Every preferred one declines: the passed-over cuda still runs.
        assert registry.select_backend(inputs).name == "cuda"
        fake_backends["cuda"].supports = False
        with pytest.raises(RuntimeError, match="no flash_dmattn backend can run"):
            registry.select_backend(inputs)
    with policy.simulated_capability((9, 0)):
        for fake in fake_backends.values():
            fake.supports = True
        inputs = _gpu_call((9, 0), shape="B=1,H=4,Lq=256,D=64", train=True, mask="per-key",
                           bias="per-key", bias_grad=True)
        assert registry.select_backend(inputs).name == "cuda"
        assert registry.auto_backend_name(inputs) == "cuda"


def test_explain_says_why_each_backend_was_not_taken(fake_backends):
    fake_backends["flex"].supports = False
    with policy.simulated_capability((8, 9)):
        inputs = _gpu_call((8, 9), shape="B=1,H=4,Lq=256,D=64")
        result = registry.explain(inputs)
    assert result.taken == "triton"
    status = {name: (st, reasons) for name, st, reasons in result.rows}
    assert status["flex"] == ("declined", ["flex cannot"])
    assert status["triton"][0] == "taken"
    assert status["torch-reference"][0] == "not reached"
    assert status["cuda"][0] == "passed over" and "sm_90" in status["cuda"][1][0]
    text = "\n".join(result.lines())
    assert "dispatch rule: gpu-dense" in text and "auto takes: triton" in text


def test_info_explain_cli(capsys):
    # The first call (H100, per-key mask and bias, causal, training): cuda.
    assert main(["info", "--explain", "--shape", "B=1,H=16,Hkv=4,Lq=32768,D=128", "--mask",
                 "per-key", "--bias", "per-key", "--causal", "--train", "--bias-grad",
                 "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "auto takes: cuda" in out and "hopper-dense" in out
    # An Ampere card: cuda passed over, with the reason.
    assert main(["info", "--explain", "--shape", "B=2,H=4,Hkv=1,Lq=100,D=64", "--dtype", "fp16",
                 "--mask", "B,Hkv,1,Lk", "--bias", "full", "--capability", "8.0"]) == 0
    out = capsys.readouterr().out
    assert "cuda: passed over" in out and "sm_90" in out and "auto takes: flex" in out
    # This machine (CPU): the reference, flex passed over.
    assert main(["info", "--explain", "--shape", "B=1,H=4,Lq=65,D=64", "--causal",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "auto takes: torch-reference" in out and "flex: passed over" in out
    # Packed sequences on Hopper: forward-only on cuda, training on triton.
    packed = ["info", "--explain", "--varlen", "--shape", "B=4,H=16,Hkv=4,Lq=2048,D=128",
              "--bias", "per-key", "--causal", "--capability", "9.0"]
    assert main(packed) == 0
    out = capsys.readouterr().out
    assert "hopper-packed-forward" in out and "auto takes: cuda" in out
    assert main(packed + ["--train"]) == 0
    out = capsys.readouterr().out
    assert "hopper-packed-training" in out and "auto takes: triton" in out
    assert "flex: declined" in out
    assert main(packed[:-2] + ["--mask", "per-query", "--device", "cpu"]) == 2
    assert "per-key --mask" in capsys.readouterr().err
    assert main(["info", "--explain", "--rules"]) == 0
    assert "hopper-dense" in capsys.readouterr().out
    assert main(["info", "--explain", "--mask", "diagonal", "--device", "cpu"]) == 2
    assert "--mask takes" in capsys.readouterr().err


def test_deterministic_default_follows_torch_use_deterministic_algorithms():
    from flash_dmattn.inputs import AttentionInputs, resolve_deterministic

    q = torch.randn(1, 16, 4, 64).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 16, 4, 64).to(torch.bfloat16) for _ in range(2))
    assert not AttentionInputs.from_args(q, k, v).deterministic
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert resolve_deterministic(None) and not resolve_deterministic(False)
        inputs = AttentionInputs.from_args(q, k, v)
        assert inputs.deterministic and policy.features_of(inputs).deterministic
        # An explicit argument wins over the global setting.
        assert not AttentionInputs.from_args(q, k, v, deterministic=False).deterministic
        with policy.simulated_capability((9, 0)):
            # Not hopper-plain-training (SDPA's backward accumulates with atomics).
            call = _gpu_call((9, 0), shape="B=1,H=4,Lq=256,D=64", train=True,
                             deterministic=None)
            assert call.deterministic
            assert policy.rank(call).rule.key != "hopper-plain-training"
    finally:
        torch.use_deterministic_algorithms(previous)
    assert not resolve_deterministic(None)
