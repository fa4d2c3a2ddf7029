"""Auto-dispatch's memo (registry.DISPATCH_MEMO) and the per-device capability cache.

A decoding loop asks auto-dispatch the same question for every layer of every token, so the
decision is made once per call signature (registry.dispatch_signature) and kept. These tests
hold what the memo must never do: answer a call whose signature, environment or backends'
answers differ from the call it remembers.
"""
import pytest
import torch

import flash_dmattn
from flash_dmattn import envs, policy, registry
from flash_dmattn.backends.flex import FlexBackend
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
    inputs = _inputs(mask=True)
    key = registry.dispatch_signature(inputs)
    with policy.simulated_capability((9, 0)):
        assert registry.dispatch_signature(inputs) != key
    # A plain CPU call's key leaves it out: a simulated capability is one of CUDA devices.
    plain = _inputs()
    key = registry.dispatch_signature(plain)
    assert key[0] == registry.PLAIN_CPU
    with policy.simulated_capability((9, 0)):
        assert registry.dispatch_signature(plain) == key
        assert policy.device_capability(plain.device) is None


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


# A plain CPU call whose signature the memo holds runs without AttentionInputs
# (registry.run_plain): the same output and gradients, every error still raised.

def _plain(B=2, L=9, H=4, Hkv=2, D=16, dtype=torch.float32, grad=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, L, h, D, generator=g).to(dtype).requires_grad_(grad)
            for h in (H, Hkv, Hkv)]


@pytest.fixture
def _served(monkeypatch):
    """``_served(fn)``: ``fn()``'s result and whether registry.run_plain served it (no
    AttentionInputs built, one memo hit)."""
    built = []
    real = AttentionInputs.from_args
    monkeypatch.setattr(AttentionInputs, "from_args",
                        staticmethod(lambda *a, **kw: built.append(1) or real(*a, **kw)))

    def served(fn):
        del built[:]
        before = _counts()
        out = fn()
        return out, not built and _delta(before) == (1, 0)

    return served


@pytest.mark.parametrize("kw", [
    dict(), dict(is_causal=True), dict(is_causal=False, softmax_scale=0.3),
    dict(is_causal=True, softmax_scale=0.3), dict(softmax_scale=0.0), dict(deterministic=True),
])
@pytest.mark.parametrize("dims", [dict(), dict(H=4, Hkv=4), dict(D=24), dict(B=1, L=1)])
def test_plain_calls_equal_the_full_path(kw, dims, _served):
    q, k, v = _plain(**dims)
    first = flash_dmattn.flash_dmattn_func(q, k, v, **kw)  # the full path: decided, remembered
    want = torch.autograd.grad(first.sum(), (q, k, v))
    out, served = _served(lambda: flash_dmattn.flash_dmattn_func(q, k, v, **kw))
    assert served
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # another signature (no gradient): decided once, then served
        flash_dmattn.flash_dmattn_func(q, k, v, **kw)
        out, served = _served(lambda: flash_dmattn.flash_dmattn_func(q, k, v, **kw))
    assert served and not out.requires_grad
    torch.testing.assert_close(out, first.detach(), rtol=0, atol=0)


def test_plain_key_is_the_dispatch_signature():
    q, k, v = _plain()
    inputs = AttentionInputs.from_args(q, k, v, None, None, None, True)
    flash_dmattn.flash_dmattn_func(q, k, v, is_causal=True)
    assert list(MEMO._chosen) == [registry.dispatch_signature(inputs)]
    # Arguments that normalise alike share the entry: softcap 0.0, return_attn_probs False,
    # is_causal 1 take the full path and find it there.
    before = _counts()
    flash_dmattn.flash_dmattn_func(q, k, v, softcap=0.0, is_causal=1, return_attn_probs=False)
    assert _delta(before) == (1, 0) and len(MEMO) == 1


def test_plain_calls_the_full_path_runs(_served):
    """What the plain path leaves to the full path: outputs equal, and the full path's own
    handling (a copied last dim, the oracle for float64, a causal call with Lq != Lk)."""
    q, k, v = _plain()
    flash_dmattn.flash_dmattn_func(q, k, v)
    # Last dims with a stride: copied by the full path, so that SDPA takes its fused kernel.
    qs = torch.randn(2, 9, 4, 32)[..., ::2]
    want = flash_dmattn.flash_dmattn_func(qs.contiguous(), k, v)
    out, served = _served(lambda: flash_dmattn.flash_dmattn_func(qs, k, v))
    assert not served
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # Heads-first tensors transposed to (B, L, H, D): served as they are.
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
    want = flash_dmattn.flash_dmattn_func(q.detach(), k.detach(), v.detach())
    flash_dmattn.flash_dmattn_func(qt, k.detach(), v.detach())
    out, served = _served(lambda: flash_dmattn.flash_dmattn_func(qt, k.detach(), v.detach()))
    assert served
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # float64 stays on the oracle; causal with Lq != Lk goes through a mask.
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    for args in ((q64, k64, v64), (q[:, :4], k, v)):
        first = flash_dmattn.flash_dmattn_func(*args, is_causal=True)
        out, served = _served(lambda: flash_dmattn.flash_dmattn_func(*args, is_causal=True))
        assert not served  # a memo hit in the full path instead
        torch.testing.assert_close(out, first, rtol=0, atol=0)


def raise_every_plain_call_error(q, k, v):
    """Every validation error of a call with q, k, v (the signature of ``(q, k, v,
    is_causal=True)`` already remembered): the full path's checks still run."""
    call = flash_dmattn.flash_dmattn_func
    with pytest.raises(ValueError, match="share one dtype"):
        call(q, k, v.double(), is_causal=True)
    with pytest.raises(ValueError, match="must be on one device"):
        call(q, k, v.to("meta"), is_causal=True)
    with pytest.raises(ValueError, match="same shape"):
        call(q, k, v[:, :5], is_causal=True)
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        call(q, k, v.numpy(), is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        call(q, k, v, is_causal=2)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        call(q, k, v, is_causal=True, deterministic="yes")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must be finite"):
            call(q, k, v, is_causal=True, softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale must be a number"):
        call(q, k, v, is_causal=True, softmax_scale="0.1")
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        call(q, k, v, is_causal=True, dropout_p="0")
    with pytest.raises(ValueError, match="must be 4-D"):
        call(q[0], k[0], v[0], is_causal=True)


def test_plain_calls_still_raise_every_error():
    q, k, v = _plain(grad=False)
    flash_dmattn.flash_dmattn_func(q, k, v, is_causal=True)  # the signature is remembered
    raise_every_plain_call_error(q, k, v)


def test_plain_calls_see_the_environment(monkeypatch):
    q, k, v = _plain(grad=False)
    flash_dmattn.flash_dmattn_func(q, k, v)
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "flex")  # forced: read on every call
    seen = []
    real = FlexBackend.attention
    monkeypatch.setattr(FlexBackend, "attention",
                        lambda self, inputs: seen.append(self.name) or real(self, inputs))
    flash_dmattn.flash_dmattn_func(q, k, v)
    assert seen == ["flex"]
    monkeypatch.delenv("FLASH_DMATTN_BACKEND")
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference")  # another signature
    before = _counts()
    flash_dmattn.flash_dmattn_func(q, k, v)
    assert _delta(before) == (0, 1) and registry.DISPATCH_MEMO.peek(
        registry.dispatch_signature(AttentionInputs.from_args(q, k, v))).name != "torch-reference"
    # The backend decided for it has no plain entry: every call takes the full path.
    flash_dmattn.flash_dmattn_func(q, k, v)
    assert _delta(before) == (1, 1)


def test_plain_calls_inside_a_compiled_graph_skip_the_memo(monkeypatch):
    q, k, v = _plain(grad=False)
    flash_dmattn.flash_dmattn_func(q, k, v)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert registry.run_plain(q, k, v, None, None, None) is None


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports CUDA device 0 to registry.run_plain (the attributes it reads),
    so that the CUDA branch of run_plain can be tested without a GPU."""

    is_cpu = False
    is_cuda = True
    device = property(lambda self: torch.device("cuda", 0))


def test_deterministic_cuda_training_is_never_served_by_the_plain_entry():
    """run_plain leaves a CUDA call with deterministic=True that needs a gradient to the full
    path even when the memo holds a backend for its signature: torch-reference's plain CUDA
    entry is one SDPA call, whose backward accumulates with atomics. Without a gradient, or
    without deterministic=True, the entry serves the call."""
    served = []

    class Entry:
        name = "torch-reference"

        @staticmethod
        def plain_cuda_attention(q, k, v, scale, causal, lq, lk):
            served.append((q.requires_grad, causal))
            return "served"

    q, k, v = (t.as_subclass(_OnCuda) for t in _plain(grad=False, dtype=torch.bfloat16))
    assert q.is_cuda and not q.is_cpu and q.device == torch.device("cuda", 0)
    qg = q.detach().requires_grad_()

    def remember(query, deterministic, grad=True):
        needs = grad and query.requires_grad
        key = registry._plain_signature(torch.device("cuda", 0), query.shape, k.shape,
                                        query.dtype, True, deterministic, grad, needs,
                                        envs.dispatch_environment())
        MEMO.put(key, Entry)

    for deterministic in (False, True):
        remember(qg, deterministic)
        remember(q, deterministic)
    with torch.no_grad():
        remember(qg, True, grad=False)
    # Deterministic training: the full path runs it, whatever the memo holds.
    assert registry.run_plain(qg, k, v, None, True, True) is None
    assert served == []
    # Not deterministic, or no gradient: served.
    assert registry.run_plain(qg, k, v, None, True, False) == "served"
    assert registry.run_plain(q, k, v, None, True, True) == "served"
    with torch.no_grad():
        assert registry.run_plain(qg, k, v, None, True, True) == "served"
    assert served == [(True, True), (False, True), (True, True)]


def test_global_deterministic_setting_reaches_the_plain_entry():
    """deterministic=None follows torch.use_deterministic_algorithms: under it a CUDA training
    call is left to the full path, as with deterministic=True; an explicit False is served."""
    served = []

    class Entry:
        name = "torch-reference"

        @staticmethod
        def plain_cuda_attention(q, k, v, scale, causal, lq, lk):
            served.append(q.requires_grad)
            return "served"

    q, k, v = (t.as_subclass(_OnCuda) for t in _plain(grad=False, dtype=torch.bfloat16))
    qg = q.detach().requires_grad_()
    for deterministic in (False, True):
        key = registry._plain_signature(torch.device("cuda", 0), qg.shape, k.shape, qg.dtype,
                                        True, deterministic, True, True,
                                        envs.dispatch_environment())
        MEMO.put(key, Entry)
    assert registry.run_plain(qg, k, v, None, True, None) == "served"
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert registry.run_plain(qg, k, v, None, True, None) is None
        assert registry.run_plain(qg, k, v, None, True, False) == "served"
    finally:
        torch.use_deterministic_algorithms(previous)
    assert served == [True, True]
