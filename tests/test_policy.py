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
    from flash_dmattn.reference.sdpa_cpu import sdpa_plain

    assert ReferenceBackend.plain_cuda_attention is sdpa_plain
    assert ReferenceBackend.plain_attention is sdpa_plain


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
