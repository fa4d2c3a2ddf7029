"""The ``triton`` backend: fused mask + bias attention kernels with tile skipping.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests the kernels).
The kernels are wrapped as custom ops (:class:`flash_dmattn.ops.AttentionOp`) so
``torch.compile`` treats them as opaque nodes with fake implementations.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ...envs import interpret_mode
from ...inputs import default_softmax_scale
from ...ops import eager_inference
from ...policy import device_capability
from ...registry import BackendDeclined, is_compile_failure
from ..base import Backend
from . import triton_unavailable_reason

MAX_HEAD_DIM = 256

_op = None


def _forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None, block_table=None,
             key_intervals=None, key_window=None, dropout_p=0.0, dropout_rng=None):
    drop = dict(dropout_p=dropout_p, dropout_rng=dropout_rng)
    if key_intervals is not None:
        from .intervals import interval_forward, plan_for

        plan = plan_for(q, k, key_intervals, is_causal, backward=False, window=key_window)
        if not plan[0].hides_nothing:
            out, lse, _ = interval_forward(q, k, v, bias, key_intervals, scale, is_causal,
                                           softcap, plan, **drop)
            return out, lse
        # A mask that hides nothing beyond is_causal: the dense kernels, which skip tiles
        # past the diagonal instead of gathering every key.
    decode = _decode_module()
    decode_forward = decode.decode_forward
    if block_table is not None:
        # Paged KV: only the decode kernel reads pages (block_table_reasons declines the rest).
        return decode_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens,
                              block_table=block_table)

    # Few query rows per kv head (decoding): the split-KV kernel reads K/V once per group.
    # It is also the only forward that honours cache_seqlens (not_supported_reasons declines
    # cache_seqlens for every other shape, and dropout with a KV cache: the split-KV kernel
    # has none).
    if not dropout_p and decode.use_decode_kernel(q.shape[1], q.shape[2], k.shape[2], k.shape[1],
                                                  cache_seqlens is not None):
        return decode_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens)
    from .forward import attention_forward

    return attention_forward(q, k, v, mask, bias, scale, is_causal, softcap, **drop)


_DECODE = None


def _decode_module():
    """:mod:`.decode` (imported on first use, so that importing this module needs no triton;
    then kept: a decoding step reaches it once per layer)."""
    global _DECODE
    if _DECODE is None:
        from . import decode

        _DECODE = decode
    return _DECODE


def plain_decode(query, key, value, softmax_scale, is_causal, seqlen_q, seqlen_k):
    """A plain decoding call (:func:`flash_dmattn.registry.run_plain`: no mask, bias, soft cap,
    KV cache, dropout or probabilities, in a signature auto-dispatch gave this backend): the
    split-KV decode kernel on the tensors as given, the launch :meth:`TritonBackend.attention`
    makes for such a call (its custom op, :func:`_forward`), without them. None where that
    call would not be this launch: a shape the main forward runs, a gradient to record, a
    traced or compiled call, tensor subclasses or active modes, and a call whose kernels fail
    to compile or decline (the full path then runs it again, and declines it as usual)."""
    decode = _DECODE or _decode_module()
    if not decode.use_decode_kernel(seqlen_q, query.shape[2], key.shape[2], seqlen_k, False):
        return None
    if not eager_inference(query, key, value):
        return None
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(query.shape[3])
    try:
        # run_plain checked the last dims (contiguous, as decode_forward makes them).
        return decode.plain_decode_forward(query, key, value, float(softmax_scale), is_causal)
    except Exception as exc:
        if isinstance(exc, BackendDeclined) or is_compile_failure(exc):
            return None
        raise


def _planned_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                     key_intervals=None, key_window=None, dropout_p=0.0, dropout_rng=None):
    """``_forward`` plus the backward's plan (see
    :mod:`flash_dmattn.planning.plan`); None where it has none."""
    drop = dict(dropout_p=dropout_p, dropout_rng=dropout_rng)
    if key_intervals is not None:
        from ...planning.key_lists import DenseEquivalent
        from .intervals import interval_forward, plan_for

        plan = plan_for(q, k, key_intervals, is_causal, backward=True, window=key_window)
        if not plan[0].hides_nothing:
            return interval_forward(q, k, v, bias, key_intervals, scale, is_causal, softcap,
                                    plan, **drop)
        out, lse, dense_plan = _planned_forward(q, k, v, None, bias, scale, is_causal, softcap,
                                                **drop)
        return out, lse, DenseEquivalent(dense_plan)
    from .decode import use_decode_kernel
    if not dropout_p and use_decode_kernel(q.shape[1], q.shape[2], k.shape[2], k.shape[1],
                                           cache_seqlens is not None):
        return (*_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens), None)
    from .forward import attention_forward
    return attention_forward(q, k, v, mask, bias, scale, is_causal, softcap, keep_plan=True,
                             **drop)


def _backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic, needs,
              cache_seqlens=None, plan=None, key_intervals=None, key_window=None, dropout_p=0.0,
              dropout_rng=None):
    drop = dict(dropout_p=dropout_p, dropout_rng=dropout_rng)
    if key_intervals is not None:
        from ...planning.key_lists import DenseEquivalent
        from .intervals import interval_backward, plan_for

        if plan is None:
            plan = plan_for(q, k, key_intervals, is_causal, backward=True, window=key_window)
            if plan[0].hides_nothing:
                plan = DenseEquivalent(None)
        if isinstance(plan, DenseEquivalent):
            return _backward(dout, q, k, v, None, bias, out, lse, scale, is_causal, softcap,
                             deterministic, needs, plan=plan.plan, **drop)
        return interval_backward(dout, q, k, v, bias, key_intervals, out, lse, scale, is_causal,
                                 softcap, deterministic, needs, plan=plan, **drop)
    from .backward import attention_backward

    if cache_seqlens is not None:
        # The backward kernels take one key length for all batches: fold the per-batch used
        # length (and its causal diagonal) into the mask; small by cache_seqlens_reasons.
        from ...planning.decode import fold_cache_seqlens

        mask = fold_cache_seqlens(mask, cache_seqlens, q.shape[1], k.shape[1], is_causal)
        is_causal = False
        plan = None  # planned for the unfolded mask
    need_dq, need_dk, need_dv, need_dbias = needs
    return attention_backward(
        dout, q, k, v, out, lse, mask, bias, scale, is_causal, softcap, deterministic,
        bias_needs_grad=need_dbias, needs_dq=need_dq, needs_dkv=need_dk or need_dv, plan=plan,
        **drop,
    )


def triton_op():
    """The registered custom-op pair (created on first use, so importing needs no triton)."""
    global _op
    if _op is None:
        from ...ops import AttentionOp

        _op = AttentionOp("triton", _forward, _backward, planned_forward=_planned_forward)
    return _op


_varlen_op = None


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
                    dropout_p=0.0, dropout_rng=None):
    from .forward_varlen import attention_forward_varlen

    return attention_forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale,
                                    is_causal, softcap, dropout_p=dropout_p,
                                    dropout_rng=dropout_rng)


def _varlen_backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, out, lse, scale,
                     is_causal, softcap, deterministic, needs, dropout_p=0.0, dropout_rng=None):
    from .backward import attention_backward_varlen

    # deterministic needs nothing extra: the varlen backward never uses atomics.
    need_dq, need_dk, need_dv, need_dbias = needs
    return attention_backward_varlen(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
        bias_needs_grad=need_dbias, needs_dq=need_dq, needs_dkv=need_dk or need_dv,
        dropout_p=dropout_p, dropout_rng=dropout_rng,
    )


def triton_varlen_op():
    """The registered packed-sequence custom-op pair (created on first use)."""
    global _varlen_op
    if _varlen_op is None:
        from ...ops import VarlenAttentionOp

        _varlen_op = VarlenAttentionOp("triton_varlen", _varlen_forward, _varlen_backward)
    return _varlen_op


def _kernel_reasons(inputs) -> List[str]:
    """Why the kernels cannot run these inputs (dense or packed): device, dtype, head dim, probs."""
    reasons = []
    dev = inputs.device.type
    if dev != "cuda" and not (dev == "cpu" and interpret_mode()):
        reasons.append(f"tensors on {dev} (needs CUDA, or CPU with TRITON_INTERPRET=1)")
    if dev == "cuda" and device_capability(inputs.device) < (8, 0):
        reasons.append("needs a GPU of compute capability >= 8.0")
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if dev == "cpu" else ())
    if inputs.dtype not in allowed:
        reasons.append(f"dtype {inputs.dtype} is not supported (float16, bfloat16)")
    if inputs.head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {inputs.head_dim} > {MAX_HEAD_DIM}")
    if inputs.return_attn_probs:
        reasons.append("return_attn_probs is not supported (use torch-reference)")
    return reasons


def _interval_reasons(inputs) -> List[str]:
    """Why the key-interval kernels cannot run a call with a KeyIntervals mask."""
    reasons = []
    if inputs.cache_seqlens is not None or inputs.block_table is not None:
        reasons.append("key-interval masks with a KV cache (cache_seqlens / block_table) are "
                       "not supported by triton yet")
    if inputs.attn_bias is not None and inputs.attn_bias.shape[2] != 1:
        reasons.append("with a key-interval mask the triton kernels take a per-key bias "
                       f"(Bx, Hx, 1, Lk); got bias {tuple(inputs.attn_bias.shape)}")
    return reasons


class TritonBackend(Backend):
    name = "triton"

    def probe(self) -> Optional[str]:
        reason = triton_unavailable_reason()
        if reason is not None:
            return reason
        if not interpret_mode() and not torch.cuda.is_available():
            return "no CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU tensors)"
        return None

    def version(self) -> str:
        try:
            import triton
        except Exception:  # reported by probe(); `info` must still print a row
            return "-"
        return f"triton {triton.__version__}"

    def not_supported_reasons(self, inputs) -> List[str]:
        reasons = _kernel_reasons(inputs)
        if getattr(inputs, "key_intervals", None) is not None:
            reasons.extend(_interval_reasons(inputs))
        if inputs.cache_seqlens is not None:
            from ...planning.decode import cache_seqlens_reasons

            reasons.extend(cache_seqlens_reasons(inputs))
        if inputs.block_table is not None:
            from ...planning.decode import block_table_reasons

            reasons.extend(block_table_reasons(inputs))
        if inputs.dropout_p > 0.0 and (inputs.cache_seqlens is not None
                                       or inputs.block_table is not None):
            reasons.append("dropout with a KV cache (cache_seqlens / block_table): the triton "
                           "decode kernel has no dropout")
        return reasons

    # Plain calls of a decided signature (registry.run_plain) that the decode kernel runs: the
    # function itself, not a method calling it (one Python frame less on every decoding step).
    plain_attention = staticmethod(plain_decode)
    plain_cuda_attention = staticmethod(plain_decode)

    def varlen_not_supported_reasons(self, inputs) -> List[str]:
        """Why the packed-sequence kernels cannot run ``inputs`` (a VarlenInputs). With key
        intervals the call runs as one packed key-interval call
        (:mod:`flash_dmattn.planning.packed_intervals`), whose reasons these are."""
        if getattr(inputs, "key_intervals", None) is not None:
            from ...planning.packed_intervals import packed_interval_inputs, packed_interval_reasons

            reasons = packed_interval_reasons(inputs)
            packed = packed_interval_inputs(inputs, remap=False)
            reasons.extend(r for r in self.not_supported_reasons(packed) if r not in reasons)
            return reasons
        return _kernel_reasons(inputs)

    def varlen_attention(self, inputs):
        """Packed-sequence attention (docs/contract.md §4) through the ``triton_varlen`` custom
        ops; with key intervals, one batch-1 key-interval call over the packed tokens (the
        ``triton`` ops), whose gradients reach the varlen tensors through its views."""
        if getattr(inputs, "key_intervals", None) is not None:
            from ...planning.packed_intervals import packed_interval_inputs

            return self.attention(packed_interval_inputs(inputs))[0]
        return triton_varlen_op().attention(inputs)

    def attention(self, inputs):
        intervals = inputs.key_intervals
        out, _ = triton_op()(
            inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.attn_bias,
            inputs.softmax_scale, inputs.is_causal, inputs.softcap, inputs.deterministic,
            cache_seqlens=inputs.cache_seqlens, block_table=inputs.block_table,
            key_intervals=intervals, key_window=inputs.key_window, dropout_p=inputs.dropout_p,
            dropout_rng=inputs.dropout_rng,
        )
        return out
