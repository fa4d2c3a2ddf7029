"""Plain decoding steps without AttentionInputs (issue 33 item 5: the host time of a decode step).

A model with no mask (Llama) calls the attention function with one query per step against a
growing KV cache. Once auto-dispatch has decided such a call's signature, the call is served by
``registry.run_plain`` and the chosen backend's plain entry: the triton backend's
``plain_decode`` hands the tensors to the split-KV decode kernel (``decode.plain_decode_forward``)
with no validation object, no dispatch and no custom op. These tests hold that

* the served call gives the full path's output bit for bit (the triton kernels interpreted on
  CPU tensors, the triton backend the only one left to auto-dispatch) and launches exactly what
  the full path launches when the launchers plan as on an H100 (the kernels recorded);
* every invalid call still raises the full path's error on a remembered signature, through the
  library function and through the Hugging Face attention function;
* what the plain entry does not serve (gradients, the main forward's shapes, a kernel that fails
  to compile) takes the full path and computes the same.
"""
import argparse

import pytest
import torch

import flash_dmattn
from flash_dmattn import registry
from flash_dmattn.inputs import AttentionInputs
from interpreter_only import interpreter_skip_reason, needs_triton
from test_decode_host_path import harness  # noqa: F401  (fixture)
from test_dispatch_memo import _served, raise_every_plain_call_error  # noqa: F401  (fixture)

MEMO = registry.DISPATCH_MEMO
_NO_INTERPRETER = interpreter_skip_reason()
needs_interpreter = pytest.mark.skipif(_NO_INTERPRETER is not None, reason=str(_NO_INTERPRETER))


@pytest.fixture
def triton_only(monkeypatch, _served):
    """Auto-dispatch has only triton left for CPU tensors (not forced: a forced backend keeps
    the full path); ``served(fn)`` as test_dispatch_memo's (no AttentionInputs built, one
    memo hit)."""
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "torch-reference,flex,cuda")
    return _served


def _decode(B=2, Lq=1, H=4, Hkv=2, Lk=150, D=16, dtype=torch.float32, heads_first=True, seed=0):
    """``(B, L, H, D)`` query and K/V; K/V views of a transformers cache ``(B, Hkv, L, D)``
    (``heads_first``) or contiguous."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype).transpose(1, 2)
    if heads_first:
        k, v = (torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).transpose(1, 2)
                for _ in range(2))
    else:
        k, v = (torch.randn(B, Lk, Hkv, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@needs_interpreter
@pytest.mark.parametrize("kw,dims", [
    (dict(), dict()),
    (dict(softmax_scale=0.3), dict(H=8, Hkv=2)),             # GQA: four heads a tile
    (dict(is_causal=True), dict(Lq=2)),                      # two queries, causal
    (dict(is_causal=True), dict()),
    (dict(softmax_scale=0.0), dict(H=2, Hkv=2, Lk=300)),     # several splits: the combine
    (dict(), dict(dtype=torch.bfloat16, heads_first=False)),
    (dict(), dict(B=1, Lk=129)),                             # the shortest decode call
])
def test_served_decode_equals_the_full_path(triton_only, poison, kw, dims):
    q, k, v = _decode(**dims)
    with torch.no_grad():
        first = flash_dmattn.flash_dmattn_func(q, k, v, **kw)   # decided and remembered
        out, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k, v, **kw))
    assert served
    assert torch.equal(out, first) and out.stride() == first.stride()
    # A new key length is a new signature: the full path decides it, then it is served.
    k2, v2 = k[:, :-1], v[:, :-1]
    with torch.no_grad():
        first = flash_dmattn.flash_dmattn_func(q, k2, v2, **kw)
        out, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k2, v2, **kw))
    assert served and torch.equal(out, first)


@needs_interpreter
def test_what_the_plain_entry_does_not_serve_takes_the_full_path(triton_only, monkeypatch):
    from flash_dmattn.backends.triton import decode

    # A gradient to record: the custom op's autograd (the full path), decided per grad flag.
    q, k, v = _decode()
    q.requires_grad_(True)
    want = flash_dmattn.flash_dmattn_func(q, k, v)
    out, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k, v))
    assert not served and out.requires_grad and torch.equal(out, want)
    # Fewer keys than the decode kernel takes: the main forward.
    q, k, v = _decode(Lk=64)
    with torch.no_grad():
        want = flash_dmattn.flash_dmattn_func(q, k, v)
        out, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k, v))
    assert not served and torch.equal(out, want)
    # Kernels that fail to compile on the plain entry: the full path runs the call (and would
    # decline it for the next backend as usual).
    q, k, v = _decode()

    class CompilationError(Exception):  # a compile failure, by its name (registry rule)
        pass

    def fail(*args, **kwargs):
        raise CompilationError("no")

    with torch.no_grad():
        want = flash_dmattn.flash_dmattn_func(q, k, v)
        monkeypatch.setattr(decode, "plain_decode_forward", fail)
        out, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k, v))
    assert not served and torch.equal(out, want)
    # Any other error is the call's own and is raised.
    monkeypatch.setattr(decode, "plain_decode_forward",
                        lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("kernel bug")))
    with torch.no_grad(), pytest.raises(RuntimeError, match="kernel bug"):
        flash_dmattn.flash_dmattn_func(q, k, v)


@needs_interpreter
def test_invalid_decode_calls_still_raise_on_a_remembered_signature(triton_only):
    q, k, v = _decode()
    with torch.no_grad():
        flash_dmattn.flash_dmattn_func(q, k, v, is_causal=True)
        _, served = triton_only(lambda: flash_dmattn.flash_dmattn_func(q, k, v, is_causal=True))
        assert served
        raise_every_plain_call_error(q, k, v)
        # The head counts (checked by from_args, read by the signature): another signature.
        with pytest.raises(ValueError, match="multiple of"):
            flash_dmattn.flash_dmattn_func(q[:, :, :3], k, v, is_causal=True)


class _Layer(torch.nn.Module):
    """What the Hugging Face attention function reads of a Llama attention layer."""

    def __init__(self):
        super().__init__()
        self.config = argparse.Namespace(model_type="llama")
        self.is_causal = True
        self.eval()


@needs_interpreter
def test_hf_decode_step_is_served_and_equals_the_full_path(triton_only, monkeypatch):
    from flash_dmattn.integrations import hf_transformers

    layer = _Layer()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, 16, generator=g)           # (B, H, 1, D) as transformers passes
    k, v = (torch.randn(1, 2, 130, 16, generator=g) for _ in range(2))

    def call(**kw):
        return hf_transformers.dmattn_attention_forward(layer, q, k, v, None, scaling=0.25,
                                                        dropout=0.0, **kw)[0]

    with torch.no_grad():
        first = call()
        out, served = triton_only(call)
        assert served and torch.equal(out, first)
        # The general route (a spy on the library call) computes the same.
        calls = []
        real = hf_transformers._get_kernel

        def spy():
            calls.append(1)
            return real()

        with monkeypatch.context() as m:
            m.setattr(hf_transformers, "_get_kernel", spy)
            assert torch.equal(call(), first) and calls
        # Keywords that change the scores leave the unmasked route, as before.
        band = call(sliding_window=16)
        assert not torch.equal(band, first)
        # Invalid calls raise as before, the signature remembered.
        with pytest.raises(ValueError, match="dmattn_varlen"):
            call(dmattn_varlen="sometimes")
        with pytest.raises(ValueError, match="s_aux"):
            call(s_aux=torch.zeros(4))
        with pytest.raises(ValueError, match="must be 4-D"):
            hf_transformers.dmattn_attention_forward(layer, q[0], k, v, None, scaling=0.25)
        with pytest.raises(ValueError, match="scaling must be finite"):
            hf_transformers.dmattn_attention_forward(layer, q, k, v, None,
                                                     scaling=float("nan"))
        with pytest.raises(ValueError, match="dropout_p must be in"):
            hf_transformers.dmattn_attention_forward(layer, q, k, v, None, scaling=0.25,
                                                     dropout=1.5)


def _layout(args):
    # Tensors by their layout (outputs are fresh allocations: their addresses differ).
    return tuple((a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else
                 (type(a), a) for a in args)


@needs_triton
@pytest.mark.parametrize("dims", [
    dict(), dict(heads=8, kv_heads=2), dict(keys=4096), dict(batch=1, keys=130),
    dict(head_dim=64),
])
def test_served_decode_launches_what_the_full_path_launches_on_an_h100(harness, dims):
    """The launchers planning as on an H100 (the harness of tools/decode_host_overhead.py,
    kernels recorded): the served step launches the kernels, grids, argument types and
    values (tensors by layout) and constexprs of the full path."""
    from flash_dmattn.integrations import hf_transformers

    shape = dict(batch=4, heads=8, kv_heads=8, head_dim=128, keys=1088, window=256)
    shape.update(dims)
    module, q, k, v, _ = harness.make_call("llama", argparse.Namespace(**shape))
    counts = {"launches": 0, "syncs": 0}
    logs = []
    with torch.no_grad(), harness.stubbed_device(counts):
        for _ in range(3):  # the full path (deciding), then served twice
            counts["log"] = []
            hits = MEMO.hits
            hf_transformers.dmattn_attention_forward(module, q, k, v, None, scaling=0.125,
                                                     dropout=0.0)
            logs.append((MEMO.hits - hits,
                         [(name, grid, _layout(args), sorted(meta.items()))
                          for name, grid, args, meta in counts["log"]]))
    (first_hits, full), (hits2, served2), (hits3, served3) = logs
    assert (first_hits, hits2, hits3) == (0, 1, 1)
    assert full and served2 == full and served3 == full


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_triton
@pytest.mark.parametrize("dims", [dict(), dict(H=32, Hkv=8), dict(B=1, Lk=4097)])
def test_cuda_decode_step_is_served_and_equals_the_full_path(dims, monkeypatch):
    """On a GPU: the plain CUDA key that run_plain builds is the dispatch signature, and a
    served step (the compiled decode kernels) gives the full path's output bit for bit.
    Auto-dispatch keeps only triton (disabled, not forced: a forced backend takes the full
    path), whose plain decode entry is the one under test."""
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "cuda,flex,torch-reference")
    shape = dict(B=4, H=8, Hkv=8, Lk=1088, D=128, dtype=torch.bfloat16)
    shape.update(dims)
    q, k, v = (t.cuda() for t in _decode(**shape))
    with torch.no_grad():
        first = flash_dmattn.flash_dmattn_func(q, k, v, softmax_scale=0.1)
        key = registry.dispatch_signature(AttentionInputs.from_args(q, k, v, None, None, 0.1))
        assert key[0] == registry.PLAIN_CUDA
        chosen = MEMO.peek(key)
        assert chosen is not None and chosen.name == "triton"
        hits = MEMO.hits
        out = flash_dmattn.flash_dmattn_func(q, k, v, softmax_scale=0.1)
        torch.cuda.synchronize()
    assert MEMO.hits - hits == 1
    assert torch.equal(out, first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_small_decode_step_is_one_sdpa_call():
    """On a GPU, auto-dispatch sends a plain decoding step over little K/V to torch-reference
    (policy rule gpu-plain-decode), whose plain entry is one SDPA call: no fallback warning,
    served from the memo after the first call, SDPA's output bit for bit."""
    import warnings

    q, k, v = (t.cuda() for t in _decode(B=4, H=8, Hkv=2, Lk=1088, D=128, dtype=torch.bfloat16))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.1,
        enable_gqa=True).transpose(1, 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        first = flash_dmattn.flash_dmattn_func(q, k, v, softmax_scale=0.1)
        key = registry.dispatch_signature(AttentionInputs.from_args(q, k, v, None, None, 0.1))
        assert MEMO.peek(key).name == "torch-reference"
        hits = MEMO.hits
        out = flash_dmattn.flash_dmattn_func(q, k, v, softmax_scale=0.1)
    assert MEMO.hits - hits == 1
    assert torch.equal(first, want) and torch.equal(out, want)
