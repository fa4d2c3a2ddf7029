"""The flex backend never lets a compile failure escape auto-dispatch: shapes Inductor's
flex-decoding kernel cannot tile run the main kernel, and a compile failure found at run time
becomes a remembered decline while the next backend answers the call (CPU, simulated GPU)."""
import warnings

import pytest
import torch

from interpreter_only import skip_unless_available

from flash_dmattn import flash_dmattn_func, policy, registry
from flash_dmattn.backends import flex
from flash_dmattn.backends.base import BackendDeclined
from flash_dmattn.inputs import AttentionInputs

from naive import naive_attention


def inductor_decode_has_no_config(seqlen_q, heads, kv_heads, q_block=flex.BLOCK):
    """Inductor's flex-decoding choice, written out: queries shorter than 128, a power-of-2
    query-head group per kv head (GQA) -> the decoding kernel, whose row tile packs the
    group's queries (a power of 2, at least 16 rows) and must divide the BlockMask's Q block."""
    group = heads // kv_heads
    if seqlen_q >= 128 or group < 2 or (group & (group - 1)):
        return False
    rows = 16
    while rows < seqlen_q * group:
        rows *= 2
    return q_block % rows != 0


def test_decode_kernel_rule_matches_inductors_choice():
    for heads, kv_heads in [(1, 1), (4, 4), (4, 1), (8, 2), (6, 2), (32, 8), (16, 1), (3, 1)]:
        for seqlen_q in range(1, 200):
            assert flex.decode_kernel_cannot_tile(seqlen_q, heads, kv_heads) == \
                inductor_decode_has_no_config(seqlen_q, heads, kv_heads), (seqlen_q, heads, kv_heads)
    # The two failing calls: B2 H4/Hkv1 L100, B1 H4/Hkv1 L65.
    assert flex.decode_kernel_cannot_tile(100, 4, 1)
    assert flex.decode_kernel_cannot_tile(65, 4, 1)
    assert not flex.decode_kernel_cannot_tile(32, 4, 1)  # 128 packed rows: one Q block
    assert not flex.decode_kernel_cannot_tile(1, 32, 8)  # decoding steps keep the decode kernel


def _inputs(lq, heads, kv_heads, bias=None, grad=False):
    q = torch.randn(1, lq, heads, 16, requires_grad=grad)
    k = torch.randn(1, lq, kv_heads, 16)
    return AttentionInputs.from_args(q, k, k, None, bias)


def test_kernel_options_force_the_main_kernel_where_decoding_has_no_config():
    assert flex.kernel_options_for(_inputs(100, 4, 1), False) == {"FORCE_USE_FLEX_ATTENTION": True}
    assert flex.kernel_options_for(_inputs(100, 4, 4), False) is None
    assert flex.kernel_options_for(_inputs(300, 4, 1), False) is None
    light = flex.kernel_options_for(_inputs(65, 4, 1), True)
    assert light == {"FORCE_USE_FLEX_ATTENTION": True, "num_stages": 1, "num_warps": 4}


class NoValidChoicesError(RuntimeError):
    """Named as Inductor's: the backend recognises compile failures by type name."""


class InductorError(RuntimeError):
    pass


def test_compile_failure_is_recognised_through_wrappers():
    try:
        try:
            raise NoValidChoicesError("No choices to select")
        except NoValidChoicesError as inner:
            raise InductorError("LoweringException: ...") from inner
    except InductorError as exc:
        assert registry.is_compile_failure(exc)
        assert registry.failure_reason(exc) == "InductorError: LoweringException: ..."
    assert not registry.is_compile_failure(ValueError("bad shape"))


@pytest.fixture
def on_simulated_gpu(monkeypatch):
    """CPU tensors that report a CUDA device of compute capability 8.0 (flex first there); no
    run-time declines remembered before or after."""
    monkeypatch.setattr(AttentionInputs, "device", property(lambda self: torch.device("cuda")))
    registry.forget_declines()
    with policy.simulated_capability((8, 0)):
        yield
    registry.forget_declines()


def test_compile_failure_becomes_a_remembered_decline_and_auto_moves_on(monkeypatch,
                                                                         on_simulated_gpu):
    backend = registry.get_backend("flex")
    attempts = []

    def failing_compile(q, k, v, kwargs, options):
        attempts.append(options)
        raise InductorError("LoweringException: NoValidChoicesError: No choices to select")

    monkeypatch.setattr(flex, "_run_compiled", failing_compile)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 100, 4, 64, generator=g)
    k = torch.randn(2, 100, 1, 64, generator=g)
    v = torch.randn(2, 100, 1, 64, generator=g)
    inputs = AttentionInputs.from_args(q, k, v)
    assert registry.select_backend(inputs).name == "flex"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the torch-reference fallback warning
        out = flash_dmattn_func(q, k, v)
        ref, _ = naive_attention(q, k, v)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        assert len(attempts) == 1
        reasons = registry._reasons(backend, inputs)
        assert any("failed to compile a call like this one" in r and "InductorError" in r
                   for r in reasons)
        flash_dmattn_func(q, k, v)  # declined up front: no second compile
    assert len(attempts) == 1
    # A call of another shape is not affected; an explicit call says why it cannot run.
    assert not registry._reasons(backend, AttentionInputs.from_args(q[:, :64], k, v))
    with pytest.raises(ValueError, match="failed to compile a call like this one"):
        registry.check_explicit(backend, inputs)


def test_explicit_flex_raises_the_decline_with_its_reason(monkeypatch, on_simulated_gpu):
    backend = registry.get_backend("flex")

    def failing_compile(q, k, v, kwargs, options):
        raise NoValidChoicesError("No choices to select")

    monkeypatch.setattr(flex, "_run_compiled", failing_compile)
    q = torch.randn(1, 65, 4, 64)
    k = torch.randn(1, 65, 1, 64)
    with pytest.raises(BackendDeclined, match="NoValidChoicesError"):
        backend.attention(AttentionInputs.from_args(q, k, k))


def test_other_errors_are_not_turned_into_declines(monkeypatch, on_simulated_gpu):
    backend = registry.get_backend("flex")

    def broken(q, k, v, kwargs, options):
        raise IndexError("a bug, not a compile failure")

    monkeypatch.setattr(flex, "_run_compiled", broken)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(IndexError):
        backend.attention(AttentionInputs.from_args(q, q, q))
    assert not registry._runtime_declines


class OutOfResources(RuntimeError):
    """Named as Triton's shared-memory failure at a kernel's first launch."""


def test_any_backends_compile_failure_is_remembered_and_auto_moves_on(monkeypatch,
                                                                      on_simulated_gpu):
    # The triton backend (run here by the interpreter) failing to compile its kernels for a
    # call: auto-dispatch remembers it for calls like this one and runs the next backend.
    from flash_dmattn.backends.triton.backend import TritonBackend

    skip_unless_available("triton")
    triton = registry._BACKENDS["triton"]
    tried = []

    def failing(self, inputs):
        tried.append(self.name)
        raise OutOfResources("out of resource: shared memory, Required: 264192")

    monkeypatch.setattr(TritonBackend, "attention", failing)
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "flex")  # next: torch-reference, on CPU tensors
    q = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 512, 2, 16, dtype=torch.bfloat16)
    # A decode shape with a bias (a plain step would be one SDPA call): triton first.
    bias = torch.randn(1, 2, 1, 512, dtype=torch.bfloat16)
    inputs = AttentionInputs.from_args(q, k, k, None, bias)
    assert registry.select_backend(inputs).name == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = flash_dmattn_func(q, k, k, None, bias)
        flash_dmattn_func(q, k, k, None, bias)
        want = registry.get_backend("torch-reference").attention(inputs)
    assert torch.equal(out, want)
    assert tried == ["triton"]
    assert registry.select_backend(inputs).name != "triton"
    with pytest.raises(ValueError, match="OutOfResources: out of resource"):
        registry.check_explicit(triton, inputs)


@pytest.mark.parametrize("shape, declined", [
    ((1, 1, 1, 1), True), ((2, 4, 1, 1), True), ((1, 2, 1, 1), True),
    ((1, 4, 7, 1), False), ((1, 1, 1, 7), False), ((2, 4, 7, 7), False)])
def test_gradient_of_a_bias_constant_over_queries_and_keys_is_declined_on_cuda(
        shape, declined, monkeypatch):
    # Inductor's Flex backward fails to compile the scatter of such a gradient (an address
    # independent of the query and key tiles), and only after the forward has run: decline it
    # up front. Simulated CUDA inputs (CPU tensors reporting a CUDA device).
    monkeypatch.setattr(AttentionInputs, "device", property(lambda self: torch.device("cuda")))
    b, heads = shape[0], 4
    q = torch.randn(b, 7, heads, 16, requires_grad=True)
    k = torch.randn(b, 7, 2, 16)
    bias = torch.randn(shape, requires_grad=True)
    reasons = flex.FlexBackend().not_supported_reasons(AttentionInputs.from_args(q, k, k, None, bias))
    assert any("broadcast over both queries and keys" in r for r in reasons) == declined
    with torch.no_grad():  # no gradient asked for: nothing to decline
        reasons = flex.FlexBackend().not_supported_reasons(
            AttentionInputs.from_args(q, k, k, None, bias))
    assert not any("broadcast over both" in r for r in reasons)
