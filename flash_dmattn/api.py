"""The public attention functions (docs/contract.md §2): validation once, then a backend from the registry."""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from . import registry
from .inputs import AttentionInputs, VarlenInputs


def flash_dmattn_func(
    query,
    key,
    value,
    attn_mask=None,
    attn_bias=None,
    softmax_scale=None,
    is_causal=None,
    softcap=None,
    deterministic=None,
    return_attn_probs=None,
    cache_seqlens=None,
    block_table=None,
    dropout_p=0.0,
):
    """Attention with a boolean mask and an additive bias, on the best backend for the inputs.

    Args:
        query: ``(B, Lq, H, D)``; key, value: ``(B, Lk, Hkv, D)`` with ``H % Hkv == 0``.
        attn_mask: bool, broadcastable to ``(B, H, Lq, Lk)`` (head dim may be ``Hkv``);
            True = attend. Never expanded in memory. Or a
            :class:`~flash_dmattn.masks.KeyIntervals` ``(start, end)`` with start/end
            broadcastable to ``(B, H or Hkv, Lk)``: query i sees key j iff
            ``start[j] <= i + Lk - Lq < end[j]`` (the query's position; with ``cache_seqlens``
            it is ``i + cache_seqlens[b] - Lq``), O(Lk) numbers instead of an (Lq, Lk) mask.
            Combines with ``is_causal`` and ``attn_bias`` like a bool mask.
        attn_bias: float (query dtype or float32), same broadcast rules; added to the scaled
            scores. Its gradient has exactly its shape.
        softmax_scale: default ``1/sqrt(D)``; ``0.0`` is valid (uniform attention).
        is_causal: bottom-right aligned causal mask (key j visible to query i iff
            ``j <= i + Lk - Lq``).
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)`` before the bias.
        deterministic: bitwise-reproducible backward. ``None`` (default) follows
            :func:`torch.are_deterministic_algorithms_enabled` (``torch.use_deterministic_algorithms``).
        return_attn_probs: also return ``lse (B, H, Lq)`` and the probabilities (testing aid).
        cache_seqlens: KV-cache decoding (like ``flash_attn_with_kvcache``): int32/int64
            ``(B,)`` on the query's device; key/value hold a preallocated cache of capacity
            ``Lk`` of which the first ``cache_seqlens[b]`` keys are valid for batch ``b``.
            Keys ``j >= cache_seqlens[b]`` are invisible, and causal alignment is bottom-right
            against the used length: query i sees key j iff ``j <= i + cache_seqlens[b] - Lq``.
            Values must be in ``0..Lk`` (checked for CPU tensors only: checking CUDA values
            would sync the device every decoding step).
        block_table: paged KV cache (like ``flash_attn_with_kvcache``): int32/int64
            ``(B, max_pages_per_seq)``. key/value are then page pools ``(num_pages,
            page_size, Hkv, D)`` (page_size a multiple of 16) and batch ``b``'s logical key
            ``j`` is ``key[block_table[b, j // page_size], j % page_size]``; the logical key
            length is ``Lk = max_pages_per_seq * page_size`` (mask, bias and ``cache_seqlens``
            refer to it). Page ids must be in ``0..num_pages-1`` (checked for CPU tensors
            only). Supported by triton (forward, few query rows: the decode kernel) and
            torch-reference (also gradients w.r.t. the pools); not by flex.
        dropout_p: attention dropout in ``[0, 1)``, on the normalised probabilities as in
            SDPA (``O = dropout(P) @ V``, kept entries scaled by ``1 / (1 - dropout_p)``),
            forward and backward. The keep rate uses ``dropout_p`` rounded to a multiple of
            ``1/256`` (as PyTorch's fused attention kernels round it to 8 bits); the scale
            uses it unrounded. Each call draws its seed and offset from torch's default
            generator for the query's device, so ``torch.manual_seed`` reproduces it; which
            entries it keeps is a pure function of them and of ``(batch, head, query, key)``
            (:mod:`flash_dmattn.dropout`; :func:`flash_dmattn.testing.dropout_mask` rebuilds
            it). With ``return_attn_probs`` the probabilities are those before dropout.

    Returns ``(B, Lq, H, D)`` in the query's dtype (or ``(out, lse, probs)``). Rows with no
    visible key give 0 (lse = -inf). Equivalent plain PyTorch::

        k, v = (einops.repeat(t, "b j hkv d -> b j (hkv g) d", g=H // Hkv) for t in (k, v))
        s = softmax_scale * torch.einsum("bihd,bjhd->bhij", q, k).float()
        if softcap: s = softcap * torch.tanh(s / softcap)
        s = s + attn_bias                   # per kv head: repeat(.., "b hkv i j -> b (hkv g) i j")
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)
        visible = attn_mask & ((j <= i + Lk - Lq) if is_causal else True)
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
        out = torch.einsum("bhij,bjhd->bihd", p, v.float()).to(q.dtype)

    With ``dropout_p`` (``keep`` the call's keep-mask, see ``flash_dmattn.testing``)::

        p = p * keep / (1 - dropout_p)                      # before the einsum with v

    With ``cache_seqlens`` (``n = cache_seqlens[:, None, None, None]``, per batch)::

        used = j < n                                        # (B, 1, 1, Lk)
        visible = attn_mask & used & ((j <= i + n - Lq) if is_causal else True)

    With ``attn_mask=KeyIntervals(start, end)``, the same with the dense mask::

        attn_mask = KeyIntervals(start, end).to_dense(Lq)   # (Bx, Hx, Lq, Lk) bool

    With ``block_table`` (``P = block_table.shape[1]``, ``S = key.shape[1]``), first gather
    the pages into contiguous K/V, then proceed as above::

        k = key[block_table.long()].reshape(B, P * S, Hkv, D)   # same for v
    """
    if (attn_mask is None and attn_bias is None and softcap is None and cache_seqlens is None
            and block_table is None and (return_attn_probs is None or return_attn_probs is False)
            and (dropout_p is None or (dropout_p.__class__ is float and dropout_p == 0.0))):
        # A plain call whose signature auto-dispatch has seen: no AttentionInputs (see
        # registry.run_plain); None where the full path below must run it.
        out = registry.run_plain(query, key, value, softmax_scale, is_causal, deterministic)
        if out is not None:
            return out
    inputs = AttentionInputs.from_args(
        query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
        deterministic, return_attn_probs, cache_seqlens, block_table, dropout_p,
    )
    return registry.run_auto(inputs)


def flash_dmattn_varlen_func(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    attn_mask=None,
    attn_bias=None,
    softmax_scale=None,
    is_causal=None,
    softcap=None,
    deterministic=None,
    return_attn_probs=None,
    dropout_p=0.0,
):
    """Attention over packed sequences; no token attends across a sequence boundary.

    ``query (total_q, H, D)``, ``key``/``value (total_k, Hkv, D)``; sequence ``i`` owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (and likewise for keys). ``attn_mask`` /
    ``attn_bias`` are per key: ``(total_k,)``, ``(Hkv, total_k)`` or ``(H, total_k)``, applying to
    every query of that key's sequence. Causal alignment is per sequence (bottom-right).
    ``attn_mask`` may also be a :class:`~flash_dmattn.masks.KeyIntervals` whose start/end have
    those per-key shapes; positions are per sequence: query ``i`` of a sequence of lengths
    ``(lq, lk)`` sees its key ``j`` iff ``start[j] <= i + lk - lq < end[j]`` (triton and cuda
    run it as one key-interval call over the packed tokens, at the cost of the selected keys).
    ``dropout_p`` as in :func:`flash_dmattn_func`, with the sequence index as the batch
    coordinate and rows / keys counted from the sequence's start (sequence ``i``'s keep-mask
    is ``flash_dmattn.testing.dropout_mask(rng, n, H, max_seqlen_q, max_seqlen_k,
    dropout_p)[i, :, :lq_i, :lk_i]``).
    Returns ``(total_q, H, D)`` (or ``(out, lse (H, total_q), probs)``). Equivalent::

        for i in range(len(cu_seqlens_q) - 1):
            qs = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1])
            ks = slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
            out[qs] = flash_dmattn_func(query[None, qs], key[None, ks], value[None, ks],
                                        attn_mask[..., ks], attn_bias[..., ks], ...)[0]
    """
    inputs = VarlenInputs.from_args(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        attn_mask, attn_bias, softmax_scale, is_causal, softcap, deterministic,
        return_attn_probs, dropout_p,
    )
    return registry.run_auto(inputs)


def _fixed_backend_func(name: str) -> Callable:
    """``flash_dmattn_func`` bound to one backend, which never silently falls back."""

    @functools.wraps(flash_dmattn_func)
    def run(
        query,
        key,
        value,
        attn_mask=None,
        attn_bias=None,
        softmax_scale=None,
        is_causal=None,
        softcap=None,
        deterministic=None,
        return_attn_probs=None,
        cache_seqlens=None,
        block_table=None,
        dropout_p=0.0,
    ):
        inputs = AttentionInputs.from_args(
            query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
            deterministic, return_attn_probs, cache_seqlens, block_table, dropout_p,
        )
        backend = registry.check_explicit(registry.get_backend(name), inputs)
        return backend.attention(inputs)

    run.__name__ = f"{name.replace('-', '_')}_dmattn_func"
    run.__qualname__ = run.__name__
    run.__doc__ = f"``flash_dmattn_func`` on the {name!r} backend only (no fallback).\n\n" + (
        flash_dmattn_func.__doc__ or ""
    )
    return run


triton_dmattn_func = _fixed_backend_func("triton")
flex_dmattn_func = _fixed_backend_func("flex")
reference_dmattn_func = _fixed_backend_func("torch-reference")


def flash_dmattn_func_auto(*args, **kwargs) -> Callable:
    """Return an attention function: one backend's, or per-call auto-dispatch.

    ``flash_dmattn_func_auto(backend=None)``. ``backend=None`` returns
    :func:`flash_dmattn_func` (the first backend in the order ``cuda, triton, flex,
    torch-reference`` that supports each call's inputs). A name returns that backend's
    function, or raises ``BackendUnavailableError`` (a ``RuntimeError``) with the reason it
    cannot be used here, or ``ValueError`` for an unknown name. It takes no tensors: call the
    function it returns, ``flash_dmattn_func_auto("triton")(query, key, value, ...)``.
    """
    backend = _auto_backend_arg(args, kwargs)
    if backend is None:
        return flash_dmattn_func
    registry.get_backend(backend)
    return _fixed_backend_func(backend)


def _auto_backend_arg(args: tuple, kwargs: dict) -> Optional[str]:
    """The ``backend`` of a ``flash_dmattn_func_auto`` call, or a ``TypeError`` that says how
    to call it (the usual mistake is passing the tensors to it instead of to its result)."""
    usage = (
        "flash_dmattn_func_auto(backend) returns an attention function and takes no tensors: "
        "write flash_dmattn_func_auto(backend='triton')(query, key, value, ...), or "
        "flash_dmattn_func(query, key, value, ...) for per-call dispatch"
    )
    if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
        raise TypeError(f"{usage}; got {_describe_call(args, kwargs)}")
    unknown = sorted(k for k in kwargs if k != "backend")
    if unknown:
        raise TypeError(
            "flash_dmattn_func_auto() got unexpected keyword argument"
            f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; it takes only "
            "backend (a backend name or None)"
        )
    if len(args) > 1 or (args and "backend" in kwargs):
        raise TypeError(f"{usage}; got {_describe_call(args, kwargs)}")
    backend = args[0] if args else kwargs.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend must be a backend name ({', '.join(registry.PRIORITY)}) or None, got "
            f"{type(backend).__name__}"
        )
    return backend


def _describe_call(args: tuple, kwargs: dict) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"tensor{tuple(x.shape)}"
        return repr(x) if len(repr(x)) <= 30 else type(x).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"flash_dmattn_func_auto({', '.join(parts)})"


flash_dmattn_func_auto.__signature__ = inspect.Signature(
    [inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)],
    return_annotation=Callable,
)
