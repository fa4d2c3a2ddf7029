"""Dispatch rules of docs/contract.md §6: priority, env overrides, explicit backends, fallback warning."""
import warnings

import pytest
import torch

import flash_dmattn
from flash_dmattn import (
    BackendUnavailableError,
    flash_dmattn_func,
    flash_dmattn_func_auto,
    get_available_backends,
    registry,
)
from flash_dmattn.backends.flex import FlexBackend
from flash_dmattn.inputs import AttentionInputs
from flash_dmattn.backends.reference import ReferenceBackend
from flash_dmattn.backends.triton.backend import TritonBackend


@pytest.fixture
def calls(monkeypatch):
    """Record which backend ran each call."""
    seen = []
    for cls in (TritonBackend, FlexBackend, ReferenceBackend):
        original = cls.attention

        def spy(self, inputs, _orig=original):
            seen.append(self.name)
            return _orig(self, inputs)

        monkeypatch.setattr(cls, "attention", spy)
    # A plain CPU call whose signature was decided before skips attention()
    # (registry.run_plain): the reference backend's plain entry runs it.
    plain = ReferenceBackend.plain_attention

    def plain_spy(*args):
        out = plain(*args)
        if out is not None:
            seen.append(ReferenceBackend.name)
        return out

    monkeypatch.setattr(ReferenceBackend, "plain_attention", staticmethod(plain_spy))
    return seen


def small(requires_grad=False):
    q = torch.randn(1, 6, 2, 16, requires_grad=requires_grad)
    k = torch.randn(1, 6, 1, 16)
    return q, k, k.clone()


def test_available_backends_in_priority_order():
    names = get_available_backends()
    assert names == [n for n in registry.PRIORITY if n in names]
    assert "torch-reference" in names and "flex" in names
    assert flash_dmattn.FLEX_AVAILABLE is True
    assert flash_dmattn.CUDA_AVAILABLE == ("cuda" in names)
    assert flash_dmattn.TRITON_AVAILABLE == ("triton" in names)


def test_auto_on_cpu_prefers_reference_over_eager_flex(calls):
    flash_dmattn_func(*small())
    flash_dmattn_func(*small())  # the remembered decision
    assert calls == ["torch-reference", "torch-reference"]


def test_forced_backend_env(monkeypatch, calls):
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "flex")
    flash_dmattn_func(*small())
    assert calls == ["flex"]
    # forced means no fallback: flex cannot do a CPU backward
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        flash_dmattn_func(*small(requires_grad=True))


def test_forced_unknown_backend(monkeypatch):
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        flash_dmattn_func(*small())


def test_disable_env(monkeypatch, calls):
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference")
    assert "torch-reference" not in get_available_backends()
    args = small()
    flash_dmattn_func(*args)
    # Backends passed over only by preference (triton's interpreter, eager flex on CPU) still
    # run when nothing else can: the first of them that supports the inputs.
    inputs = AttentionInputs.from_args(*args)
    expected = [
        b.name for b in registry.registered_backends()
        if b.name in ("triton", "flex") and registry.unavailable_reason(b) is None
        and not b.not_supported_reasons(inputs)
    ][0]
    assert calls == [expected]
    with pytest.raises(BackendUnavailableError, match="disabled by FLASH_DMATTN_DISABLE"):
        flash_dmattn_func_auto("torch-reference")


def test_auto_function_and_explicit_functions(calls):
    assert flash_dmattn_func_auto() is flash_dmattn_func
    fn = flash_dmattn_func_auto(backend="flex")
    fn(*small())
    flash_dmattn_func_auto("torch-reference")(*small(requires_grad=True))
    assert calls == ["flex", "torch-reference"]
    with pytest.raises(BackendUnavailableError, match="'cuda' is unavailable"):
        flash_dmattn_func_auto("cuda")
    with pytest.raises(ValueError, match="unknown backend"):
        flash_dmattn_func_auto("tpu")


def test_auto_falls_through_to_reference_when_flex_declines(calls):
    q, k, v = small(requires_grad=True)
    flash_dmattn_func(q, k, v).sum().backward()
    assert calls == ["torch-reference"] and q.grad is not None


def test_fallback_warning_once_on_accelerated_device(monkeypatch):
    # Pretend the CPU is an accelerator: the warning path is device-type driven.
    monkeypatch.setattr(registry, "ACCELERATED_DEVICE_TYPES", {"cpu"})
    q, k, v = small(requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"(?s)torch-reference.*flex: FlexAttention has no backward"):
        flash_dmattn_func(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_dmattn_func(q, k, v)  # same reasons: no second warning


def test_no_warning_where_a_rule_prefers_the_reference_as_its_fast_route(monkeypatch):
    """A small plain decoding step on a GPU runs as one SDPA call on torch-reference (rule
    gpu-plain-decode): the rule's choice, not a slow fallback, so no warning (the CPU plays
    the accelerator, the policy sees an sm_90 GPU)."""
    from flash_dmattn import policy

    monkeypatch.setattr(registry, "ACCELERATED_DEVICE_TYPES", {"cpu"})
    real = policy.features_of
    monkeypatch.setattr(policy, "features_of",
                        lambda inputs: real(inputs)._replace(device="cuda",
                                                             capability=policy.HOPPER))
    q = torch.randn(2, 1, 8, 16)
    k, v = torch.randn(2, 300, 2, 16), torch.randn(2, 300, 2, 16)
    inputs = AttentionInputs.from_args(q, k, v)
    assert policy.rank_features(policy.features_of(inputs)).rule.key == "gpu-plain-decode"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = flash_dmattn_func(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_no_warning_on_cpu():
    q, k, v = small(requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_dmattn_func(q, k, v)


def test_choice_is_logged_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="flash_dmattn"):
        flash_dmattn_func(*small())
        flash_dmattn_func(*small())
    lines = [r for r in caplog.records if "using backend" in r.getMessage()]
    assert len(lines) == 1 and "torch-reference" in lines[0].getMessage()


def test_info_lists_every_backend(capsys):
    from flash_dmattn.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in registry.PRIORITY:
        assert name in out
    assert "device:" in out


def test_can_run_reports_support_and_availability(monkeypatch):
    from flash_dmattn import registry

    q = torch.randn(1, 4, 2, 8)
    inputs = AttentionInputs.from_args(q, q, q, None, None, None, False)
    assert registry.can_run("torch-reference", inputs)
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference")
    assert not registry.can_run("torch-reference", inputs)
    assert not registry.can_run("no-such-backend", inputs)
