"""Auto-dispatch's memo (registry.DISPATCH_MEMO) and the per-device capability cache.

A decoding loop asks auto-dispatch the same question for every layer of every token, so the
decision is made once per call signature (registry.dispatch_signature) and kept. These tests
hold what the memo must never do: answer a call whose signature, environment or backends'
answers differ from the call it remembers.
"""
import pytest
import torch

import flash_dmattn
from flash_dmattn import policy, registry
from flash_dmattn.inputs import AttentionInputs

MEMO = registry.DISPATCH_MEMO


def _inputs(B=1, Lq=4, Lk=8, H=2, Hkv=2, D=16, mask=False, grad=False, **kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Lq, H, D, generator=g, requires_grad=grad)
    k = torch.randn(B, Lk, Hkv, D, generator=g)
    v = torch.randn(B, Lk, Hkv, D, generator=g)
    m = torch.rand(B, Hkv, 1, Lk, generator=g) > 0.3 if mask else None
    return AttentionInputs.from_args(q, k, v, m, None, None, **kw)


def _counts():
    return MEMO.hits, MEMO.misses


def _delta(before):
    return MEMO.hits - before[0], MEMO.misses - before[1]


def test_a_signature_is_decided_once_and_outputs_are_unchanged():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 4, 16, generator=g) for _ in range(3))
    before = _counts()
    first = flash_dmattn.flash_dmattn_func(q, k, v, is_causal=True)
    assert _delta(before) == (0, 1) and len(MEMO) == 1
    # New tensors, same signature: the remembered choice, the same result.
    again = flash_dmattn.flash_dmattn_func(q.clone(), k.clone(), v.clone(), is_causal=True)
    assert _delta(before) == (1, 1)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("change", [
    dict(Lk=9), dict(B=2), dict(D=32), dict(Hkv=1), dict(mask=True), dict(grad=True),
    dict(is_causal=True), dict(softcap=5.0), dict(deterministic=True),
    dict(return_attn_probs=True), dict(dropout_p=0.1),
])
def test_a_call_that_changes_a_property_is_decided_again(change):
    base = _inputs()
    registry.select_backend(base)
    before = _counts()
    changed = _inputs(**change)
    assert registry.dispatch_signature(changed) != registry.dispatch_signature(base)
    assert registry.select_backend(changed).name == registry.auto_backend_name(changed)
    assert _delta(before) == (0, 1)


def test_grad_mode_is_part_of_the_signature():
    inputs = _inputs(grad=True)
    with torch.no_grad():
        off = registry.dispatch_signature(inputs)
    assert registry.dispatch_signature(inputs) != off


def test_environment_changes_are_seen(monkeypatch):
    inputs = _inputs()
    assert registry.select_backend(inputs).name == "torch-reference"  # the cpu rule
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference")
    before = _counts()
    assert registry.select_backend(inputs).name != "torch-reference"
    assert _delta(before) == (0, 1)
    monkeypatch.delenv("FLASH_DMATTN_DISABLE")
    assert registry.select_backend(inputs).name == "torch-reference"
    assert _delta(before) == (1, 1)  # the first decision again, from the memo
    for name, value in (("FLASH_DMATTN_CUDA_AUTO", "1"), ("TRITON_INTERPRET", "0")):
        with monkeypatch.context() as m:
            key = registry.dispatch_signature(inputs)
            m.setenv(name, value)
            assert registry.dispatch_signature(inputs) != key
    # A forced backend is checked on every call, memo or not.
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "flex")
    assert registry.select_backend(inputs).name == "flex"


def test_simulated_capability_is_part_of_the_signature():
    inputs = _inputs()
    key = registry.dispatch_signature(inputs)
    with policy.simulated_capability((9, 0)):
        assert registry.dispatch_signature(inputs) != key


def test_what_the_key_cannot_see_empties_the_memo():
    inputs = _inputs()
    registry.select_backend(inputs)
    assert len(MEMO) == 1
    registry.remember_decline("flex", inputs, "a test decline")
    assert len(MEMO) == 0
    registry.select_backend(inputs)
    registry.forget_declines()
    assert len(MEMO) == 0
    registry.select_backend(inputs)
    registry.reset_dispatch_notes()  # memo answers are not logged: notes and memo go together
    assert len(MEMO) == 0


def test_a_backend_whose_answer_changes_in_place_needs_clear(monkeypatch):
    inputs = _inputs()
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference")
    first = registry.select_backend(inputs).name
    monkeypatch.setattr(type(registry._BACKENDS[first]), "not_supported_reasons",
                        lambda self, inputs: ["declines now"])
    assert registry.select_backend(inputs).name == first  # remembered
    MEMO.clear()
    assert registry.select_backend(inputs).name != first


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(registry.DispatchMemo, "MAX_ENTRIES", 3)
    calls = [_inputs(Lk=n) for n in (8, 9, 10, 11)]
    for inputs in calls:
        registry.select_backend(inputs)
    assert len(MEMO) == 3
    before = _counts()
    registry.select_backend(calls[0])  # the oldest was dropped
    registry.select_backend(calls[-1])
    assert _delta(before) == (1, 1)


def test_validation_still_runs_on_every_call():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=g) for _ in range(3))
    flash_dmattn.flash_dmattn_func(q, k, v)
    with pytest.raises(ValueError, match="share one dtype"):
        flash_dmattn.flash_dmattn_func(q, k.double(), v)
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_dmattn.flash_dmattn_func(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool))


def test_compiling_bypasses_the_memo(monkeypatch):
    inputs = _inputs()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    before = _counts()
    assert registry.select_backend(inputs).name == "torch-reference"
    assert _delta(before) == (0, 0) and len(MEMO) == 0


def test_device_capability_is_asked_once_per_device_index(monkeypatch):
    asked = []

    def capability(device=None):
        asked.append(device)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    policy._capability_of.cache_clear()
    try:
        for _ in range(3):
            assert policy.device_capability(torch.device("cuda", 0)) == (9, 0)
        assert asked == [0]
        # No index: the current device, which may change, is asked every time.
        policy.device_capability(torch.device("cuda"))
        policy.device_capability(torch.device("cuda"))
        assert len(asked) == 3
        with policy.simulated_capability((8, 0)):
            assert policy.device_capability(torch.device("cuda", 0)) == (8, 0)
        assert policy.device_capability(torch.device("cpu")) is None
    finally:
        policy._capability_of.cache_clear()


def test_an_unhashable_signature_is_decided_without_the_memo(monkeypatch):
    # Symbolic sizes (tracing outside torch.compile) have no hash: no memo, same decision.
    inputs = _inputs()
    monkeypatch.setattr(registry, "dispatch_signature", lambda inputs: ([],))
    assert registry.select_backend(inputs).name == "torch-reference"
    assert len(MEMO) == 0
