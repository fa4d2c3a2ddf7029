"""Attention implementations as ``torch.library`` custom ops, with fake kernels and autograd.

Wrapping each implementation's forward and backward as opaque custom ops keeps
``torch.compile`` from tracing into kernel launchers or chunk loops: the compiler sees one
node per direction with a shape-only (fake) implementation, and the autograd formula saves
only what the backward needs (inputs, output, lse).

An implementation supplies two plain functions:

* ``forward(q, k, v, mask, bias, scale, is_causal, softcap) -> (out, lse)``
* ``backward(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic,
  needs) -> (dq, dk, dv, dbias)`` with ``None`` for gradients ``needs`` did not ask for.

Both also receive ``cache_seqlens=<(B,) int32 tensor>`` as a keyword, but only on calls that
have one (KV-cache decoding), so implementations that never get it need not accept it; and
likewise ``key_intervals=<(2, Bx, Hx, Lk) int32 tensor>`` (the bounds of a
:class:`~flash_dmattn.masks.KeyIntervals` mask, combined with ``mask`` and causal like any
mask) only on calls that have one, and with it ``key_window=<int>`` where the mask carries
its window promise (:attr:`~flash_dmattn.masks.KeyIntervals.window`). The forward likewise receives ``block_table=<(B, P) int32 tensor>`` only on paged-KV calls (k and v
are then page pools); there is no backward for those: a backend that takes paged KV with
gradients must differentiate outside the op (the reference gathers the pages first).
Attention dropout arrives the same way, on calls that have it only: ``dropout_p=<float>``
and ``dropout_rng=<int64 (seed, offset) tensor>`` (see :mod:`flash_dmattn.dropout`), in both
directions, so the backward regenerates the forward's keep-mask.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor


def laid_out_like(t: Tensor, value: Tensor) -> Tensor:
    """``value`` in ``t``'s dtype and memory layout (the layout the fake kernels promise)."""
    result = torch.empty_like(t)  # an allocation from the caching allocator, no traffic
    if value.dtype == result.dtype and value.stride() == result.stride():
        return value
    result.copy_(value)
    return result


def _optional_kwargs(cache_seqlens: Optional[Tensor], key_intervals: Optional[Tensor],
                     key_window: int = 0, dropout_p: float = 0.0,
                     dropout_rng: Optional[Tensor] = None) -> dict:
    """The optional arguments an implementation receives as keywords: only those present, so
    an implementation that never gets one need not accept it (``key_window`` 0: none;
    ``dropout_p`` 0.0: no dropout)."""
    extra = {}
    if dropout_p > 0.0:
        extra["dropout_p"] = float(dropout_p)
        extra["dropout_rng"] = dropout_rng
    if cache_seqlens is not None:
        extra["cache_seqlens"] = cache_seqlens
    if key_intervals is not None:
        extra["key_intervals"] = key_intervals
        if key_window:
            extra["key_window"] = int(key_window)
    return extra


def _grads_as_outputs(inputs, grads) -> Tuple[Tensor, ...]:
    """A backward op's outputs: each gradient laid out like its input. Custom ops return
    tensors only, so an empty tensor stands for a gradient nobody asked for."""
    # A fresh empty tensor per slot: custom-op outputs must not alias each other.
    return tuple(
        laid_out_like(t, g) if g is not None else inputs[0].new_empty(0)
        for t, g in zip(inputs, grads)
    )


def _fake_grads(inputs, needs) -> Tuple[Tensor, ...]:
    """Shape-only outputs of a backward op (see :func:`_grads_as_outputs`)."""
    return tuple(
        torch.empty_like(t) if need and t is not None else inputs[0].new_empty(0)
        for need, t in zip(needs, inputs)
    )


def _grads_needed(ctx, bias_at: int) -> List[bool]:
    """Which of ``(dq, dk, dv, dbias)`` a custom op's autograd formula asks its backward op
    for: q, k and v are the forward op's first three inputs, the bias its input ``bias_at``
    (asked for only when the call had a bias)."""
    asked = ctx.needs_input_grad
    return [asked[0], asked[1], asked[2], ctx.has_bias and asked[bias_at]]


def eager_inference(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may run its implementation directly instead of through the custom op.

    The op exists for autograd and for ``torch.compile``; an eager call that wants no gradient
    gets nothing from it but its dispatch cost (tens of microseconds: autograd wrapper, the
    dispatcher, dynamo's disable guard), which dominates a decode step. Anything the op is
    there for keeps it: compiling or tracing, a gradient to record, tensor subclasses (fake,
    functorch, DTensor), meta tensors, and active torch-function or dispatch modes.
    """
    return plain_eager(*tensors, allow_grad=False)


def plain_eager(*tensors: Optional[Tensor], allow_grad: bool = True) -> bool:
    """Whether a call is plain eager PyTorch: not compiling or tracing, no tensor subclasses,
    meta tensors or active torch-function / dispatch modes (and, unless ``allow_grad``, no
    gradient to record). See :func:`eager_inference`."""
    probes = _eager_probes()
    if probes is None:  # a torch without one of these probes: keep the op
        return False
    tracing_state, function_stack, dispatch_mode, wrapped = probes
    if (torch.compiler.is_compiling() or tracing_state() is not None or function_stack() > 0
            or dispatch_mode() is not None):
        return False
    grad = not allow_grad and torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not Tensor or t.is_meta or wrapped(t):
            return False
        if grad and t.requires_grad:
            return False
    return True


_EAGER_PROBES: Optional[tuple] = None


def _eager_probes() -> Optional[tuple]:
    """The torch internals :func:`plain_eager` asks (looked up once: a decode step calls it
    for every layer): the tracing state, the torch-function mode stack's length, the current
    dispatch mode and the functorch-wrapper test; None where this torch lacks one."""
    global _EAGER_PROBES
    if _EAGER_PROBES is None:
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            _EAGER_PROBES = (torch._C._get_tracing_state, torch._C._len_torch_function_stack,
                             _get_current_dispatch_mode,
                             torch._C._functorch.is_functorch_wrapped_tensor)
        except (AttributeError, ImportError):
            _EAGER_PROBES = ()
    return _EAGER_PROBES or None


class AttentionOp:
    """A forward/backward pair registered as ``flash_dmattn::<name>_fwd`` / ``_bwd``."""

    def __init__(
        self,
        name: str,
        forward: Callable,
        backward: Callable,
        lse_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: torch.float32,
        planned_forward: Optional[Callable] = None,
    ) -> None:
        self.name = name
        self._backward = backward
        self._planned_forward = planned_forward

        def run_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens,
                        block_table, key_intervals=None, key_window=0, dropout_p=0.0,
                        dropout_rng=None):
            extra = _optional_kwargs(cache_seqlens, key_intervals, key_window, dropout_p,
                                     dropout_rng)
            if block_table is not None:
                extra["block_table"] = block_table
            out, lse = forward(q, k, v, mask, bias, scale, is_causal, softcap, **extra)
            # the fake promises contiguous outputs; .contiguous() is free when already so
            return out.contiguous(), lse.contiguous()

        self._run_forward = run_forward

        @torch.library.custom_op(f"flash_dmattn::{name}_fwd", mutates_args=())
        def fwd_op(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            mask: Optional[Tensor],
            bias: Optional[Tensor],
            scale: float,
            is_causal: bool,
            softcap: float,
            deterministic: bool,
            cache_seqlens: Optional[Tensor] = None,
            block_table: Optional[Tensor] = None,
            key_intervals: Optional[Tensor] = None,
            key_window: int = 0,
            dropout_p: float = 0.0,
            dropout_rng: Optional[Tensor] = None,
        ) -> Tuple[Tensor, Tensor]:
            return run_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens,
                               block_table, key_intervals, key_window, dropout_p, dropout_rng)

        @fwd_op.register_fake
        def _(q, k, v, mask, bias, scale, is_causal, softcap, deterministic, cache_seqlens=None,
              block_table=None, key_intervals=None, key_window=0, dropout_p=0.0,
              dropout_rng=None):
            B, Lq, H, _ = q.shape
            out = q.new_empty(B, Lq, H, v.shape[-1])
            return out, q.new_empty(B, H, Lq, dtype=lse_dtype(q.dtype))

        @torch.library.custom_op(f"flash_dmattn::{name}_bwd", mutates_args=())
        def bwd_op(
            dout: Tensor,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            mask: Optional[Tensor],
            bias: Optional[Tensor],
            out: Tensor,
            lse: Tensor,
            scale: float,
            is_causal: bool,
            softcap: float,
            deterministic: bool,
            needs: List[bool],
            cache_seqlens: Optional[Tensor] = None,
            key_intervals: Optional[Tensor] = None,
            key_window: int = 0,
            dropout_p: float = 0.0,
            dropout_rng: Optional[Tensor] = None,
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
            extra = _optional_kwargs(cache_seqlens, key_intervals, key_window, dropout_p,
                                     dropout_rng)
            grads = backward(
                dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic,
                tuple(needs), **extra,
            )
            return _grads_as_outputs((q, k, v, bias), grads)

        @bwd_op.register_fake
        def _(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic, needs,
              cache_seqlens=None, key_intervals=None, key_window=0, dropout_p=0.0,
              dropout_rng=None):
            return _fake_grads((q, k, v, bias), needs)

        def setup_context(ctx, inputs, output):
            (q, k, v, mask, bias, scale, is_causal, softcap, deterministic, cache_seqlens,
             block_table, key_intervals, key_window, dropout_p, dropout_rng) = inputs
            out, lse = output
            ctx.paged = block_table is not None
            ctx.key_window = key_window
            ctx.dropout_p = dropout_p
            ctx.save_for_backward(q, k, v, mask, bias, out, lse, cache_seqlens, key_intervals,
                                  dropout_rng)
            ctx.config = (scale, is_causal, softcap, deterministic)
            ctx.has_bias = bias is not None

        def backward_formula(ctx, dout, _dlse):
            if ctx.paged:
                # Backends decline gradients with paged KV (see the module docstring).
                raise RuntimeError(
                    f"flash_dmattn::{name}: no backward for paged KV (block_table); use the "
                    f"torch-reference backend for gradients"
                )
            (q, k, v, mask, bias, out, lse, cache_seqlens, key_intervals,
             dropout_rng) = ctx.saved_tensors
            needs = _grads_needed(ctx, 4)
            grads = bwd_op(
                dout.contiguous(), q, k, v, mask, bias, out, lse, *ctx.config, needs, cache_seqlens,
                key_intervals, ctx.key_window, ctx.dropout_p, dropout_rng,
            )
            dq, dk, dv, dbias = (g if n else None for g, n in zip(grads, needs))
            return (dq, dk, dv, None, dbias, None, None, None, None, None, None, None, None, None,
                    None)

        fwd_op.register_autograd(backward_formula, setup_context=setup_context)
        self._fwd = fwd_op

    def __call__(
        self, q, k, v, mask, bias, scale, is_causal, softcap, deterministic=False, cache_seqlens=None,
        block_table=None, key_intervals=None, key_window=None, dropout_p=0.0, dropout_rng=None,
    ):
        """``(out, lse)``; differentiable in q, k, v and bias. lse is returned as float32.

        ``cache_seqlens``: optional int32 ``(B,)`` used KV-cache lengths (KV-cache decoding).
        ``block_table``: optional int32 ``(B, P)`` page ids; k/v are then page pools
        (forward only).
        ``key_intervals``: optional int32 ``(2, Bx, Hx, Lk)`` bounds of a
        :class:`~flash_dmattn.masks.KeyIntervals` mask (see ``AttentionInputs.key_intervals``);
        ``key_window``: that mask's window promise (None: none).
        ``dropout_p`` / ``dropout_rng``: attention dropout and the call's int64 ``(seed,
        offset)`` tensor (:mod:`flash_dmattn.dropout`); ignored when ``dropout_p`` is 0.

        Eager calls that need no gradient run the implementation without the custom op
        (:func:`eager_inference`); eager calls that do, with an implementation that plans its
        backward in the forward (``planned_forward``), run as a :class:`_PlannedAttention`.
        The results are the same.
        """
        dropout_p = float(dropout_p or 0.0)
        if dropout_p == 0.0:
            dropout_rng = None
        tensors = (q, k, v, mask, bias, cache_seqlens, block_table, key_intervals, dropout_rng)
        window = int(key_window or 0) if key_intervals is not None else 0
        if eager_inference(*tensors):
            out, lse = self._run_forward(q, k, v, mask, bias, float(scale), bool(is_causal),
                                         float(softcap), cache_seqlens, block_table,
                                         key_intervals, window, dropout_p, dropout_rng)
        elif (self._planned_forward is not None and block_table is None
              and plain_eager(*tensors)):
            out, lse = _PlannedAttention.apply(
                self, q, k, v, mask, bias, float(scale), bool(is_causal), float(softcap),
                bool(deterministic), cache_seqlens, key_intervals, window, dropout_p,
                dropout_rng,
            )
        else:
            out, lse = self._fwd(
                q, k, v, mask, bias, float(scale), bool(is_causal), float(softcap),
                bool(deterministic), cache_seqlens, block_table, key_intervals, window,
                dropout_p, dropout_rng,
            )
        return out, (lse if lse.dtype == torch.float32 else lse.to(torch.float32))


class _PlannedAttention(torch.autograd.Function):
    """Eager autograd for an :class:`AttentionOp` whose forward also plans its backward.

    ``planned_forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=...,
    key_intervals=...)`` (each keyword only when given) returns ``(out, lse, plan)``; the plan (any Python object, e.g. tile lists worked out from
    the mask) stays on the autograd node and reaches ``backward(..., plan=plan)``, so a
    training step does not plan twice. Compiled and traced calls take the custom ops, whose
    tensors-only interface has no room for it: there the backward plans again.
    """

    @staticmethod
    def forward(ctx, op, q, k, v, mask, bias, scale, is_causal, softcap, deterministic,
                cache_seqlens, key_intervals=None, key_window=0, dropout_p=0.0, dropout_rng=None):
        extra = _optional_kwargs(cache_seqlens, key_intervals, key_window, dropout_p,
                                 dropout_rng)
        out, lse, plan = op._planned_forward(q, k, v, mask, bias, scale, is_causal, softcap,
                                             **extra)
        out, lse = out.contiguous(), lse.contiguous()
        ctx.save_for_backward(q, k, v, mask, bias, out, lse, cache_seqlens, key_intervals,
                              dropout_rng)
        ctx.op, ctx.plan, ctx.key_window = op, plan, key_window
        ctx.dropout_p = dropout_p
        ctx.config = (scale, is_causal, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, k, v, mask, bias, out, lse, cache_seqlens, key_intervals,
         dropout_rng) = ctx.saved_tensors
        needs = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3],
                 bias is not None and ctx.needs_input_grad[5])
        extra = _optional_kwargs(cache_seqlens, key_intervals, ctx.key_window, ctx.dropout_p,
                                 dropout_rng)
        if ctx.plan is not None:
            extra["plan"] = ctx.plan
        dq, dk, dv, dbias = ctx.op._backward(dout.contiguous(), q, k, v, mask, bias, out, lse,
                                             *ctx.config, needs, **extra)
        ctx.plan = None  # the lists are not needed again (retain_graph plans anew)
        grads = [None if not n else g for g, n in zip((dq, dk, dv, dbias), needs)]
        return (None, grads[0], grads[1], grads[2], None, grads[3], None, None, None, None,
                None, None, None, None, None)


class VarlenAttentionOp:
    """A packed-sequence forward/backward pair registered as ``flash_dmattn::<name>_fwd`` /
    ``_bwd`` (the varlen counterpart of :class:`AttentionOp`).

    An implementation supplies:

    * ``forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap)
      -> (out (total_q, H, D), lse (H, total_q) fp32)``
    * ``backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, out, lse, scale,
      is_causal, softcap, deterministic, needs) -> (dq, dk, dv, dbias)`` with ``None`` for
      gradients ``needs`` did not ask for; dbias in the shape of ``bias`` (a per-key 2-D view).

    Both also receive ``dropout_p`` / ``dropout_rng`` keywords on calls with attention dropout
    (as :class:`AttentionOp`'s implementations do).
    """

    def __init__(self, name: str, forward: Callable, backward: Callable) -> None:
        self.name = name

        def run_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal,
                        softcap, dropout_p=0.0, dropout_rng=None):
            extra = _optional_kwargs(None, None, 0, dropout_p, dropout_rng)
            out, lse = forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal,
                               softcap, **extra)
            return out.contiguous(), lse.contiguous()

        self._run_forward = run_forward

        @torch.library.custom_op(f"flash_dmattn::{name}_fwd", mutates_args=())
        def fwd_op(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            cu_q: Tensor,
            cu_k: Tensor,
            max_q: int,
            max_k: int,
            mask: Optional[Tensor],
            bias: Optional[Tensor],
            scale: float,
            is_causal: bool,
            softcap: float,
            deterministic: bool,
            dropout_p: float = 0.0,
            dropout_rng: Optional[Tensor] = None,
        ) -> Tuple[Tensor, Tensor]:
            return run_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal,
                               softcap, dropout_p, dropout_rng)

        @fwd_op.register_fake
        def _(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
              deterministic, dropout_p=0.0, dropout_rng=None):
            total_q, H, _ = q.shape
            out = q.new_empty(total_q, H, v.shape[-1])
            return out, q.new_empty(H, total_q, dtype=torch.float32)

        @torch.library.custom_op(f"flash_dmattn::{name}_bwd", mutates_args=())
        def bwd_op(
            dout: Tensor,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            cu_q: Tensor,
            cu_k: Tensor,
            max_q: int,
            max_k: int,
            mask: Optional[Tensor],
            bias: Optional[Tensor],
            out: Tensor,
            lse: Tensor,
            scale: float,
            is_causal: bool,
            softcap: float,
            deterministic: bool,
            needs: List[bool],
            dropout_p: float = 0.0,
            dropout_rng: Optional[Tensor] = None,
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
            extra = _optional_kwargs(None, None, 0, dropout_p, dropout_rng)
            grads = backward(
                dout, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, out, lse, scale, is_causal,
                softcap, deterministic, tuple(needs), **extra,
            )
            return _grads_as_outputs((q, k, v, bias), grads)

        @bwd_op.register_fake
        def _(dout, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, out, lse, scale, is_causal,
              softcap, deterministic, needs, dropout_p=0.0, dropout_rng=None):
            return _fake_grads((q, k, v, bias), needs)

        def setup_context(ctx, inputs, output):
            (q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
             deterministic, dropout_p, dropout_rng) = inputs
            out, lse = output
            ctx.save_for_backward(q, k, v, cu_q, cu_k, mask, bias, out, lse, dropout_rng)
            ctx.dropout_p = dropout_p
            ctx.config = (scale, is_causal, softcap, deterministic)
            ctx.max_lens = (max_q, max_k)
            ctx.has_bias = bias is not None

        def backward_formula(ctx, dout, _dlse):
            q, k, v, cu_q, cu_k, mask, bias, out, lse, dropout_rng = ctx.saved_tensors
            needs = _grads_needed(ctx, 8)
            grads = bwd_op(dout.contiguous(), q, k, v, cu_q, cu_k, *ctx.max_lens, mask, bias,
                           out, lse, *ctx.config, needs, ctx.dropout_p, dropout_rng)
            dq, dk, dv, dbias = (g if n else None for g, n in zip(grads, needs))
            return (dq, dk, dv, None, None, None, None, None, dbias, None, None, None, None, None,
                    None)

        fwd_op.register_autograd(backward_formula, setup_context=setup_context)
        self._fwd = fwd_op

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
                 deterministic=False, dropout_p=0.0, dropout_rng=None):
        """``(out (total_q, H, D), lse (H, total_q) fp32)``; differentiable in q, k, v, bias.

        Eager calls that need no gradient skip the custom op (:func:`eager_inference`).
        """
        dropout_p = float(dropout_p or 0.0)
        if dropout_p == 0.0:
            dropout_rng = None
        if eager_inference(q, k, v, cu_q, cu_k, mask, bias, dropout_rng):
            return self._run_forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k), mask, bias,
                                     float(scale), bool(is_causal), float(softcap), dropout_p,
                                     dropout_rng)
        return self._fwd(
            q, k, v, cu_q, cu_k, int(max_q), int(max_k), mask, bias, float(scale),
            bool(is_causal), float(softcap), bool(deterministic), dropout_p, dropout_rng,
        )

    def attention(self, inputs) -> Tensor:
        """The output of a validated :class:`~flash_dmattn.inputs.VarlenInputs` call."""
        if getattr(inputs, "key_intervals", None) is not None:
            # The varlen op has no key-interval argument: refuse rather than ignore the mask.
            raise RuntimeError(
                f"flash_dmattn::{self.name}: key-interval masks (KeyIntervals) are not supported "
                f"by this varlen path; use the torch-reference backend"
            )
        out, _ = self(
            inputs.query, inputs.key, inputs.value, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
            inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.attn_mask, inputs.attn_bias,
            inputs.softmax_scale, inputs.is_causal, inputs.softcap, inputs.deterministic,
            getattr(inputs, "dropout_p", 0.0), getattr(inputs, "dropout_rng", None),
        )
        return out
