"""Packed-sequence ("varlen") route of the transformers integration for key-padding masks.

A batch padded to a common length wastes work on padding tokens and, through the dense path,
makes every attention call read a ``(B, 1, Lq, Lk)`` mask. When the mask a transformers model
hands to ``dmattn_attention_forward`` is nothing but "causal (or not) + key padding", the
attention function can instead unpad the real tokens, run
:func:`flash_dmattn.flash_dmattn_varlen_func` with ``cu_seqlens`` and no mask at all, and pad
the result back (unpad -> attend -> pad).

How the pattern is recognised
-----------------------------
Nothing is inferred from mask *values* (that would cost a pass over the mask per layer). The
registered mask function ``dmattn_mask`` knows what it builds: when transformers asks it for
the plain ``causal_mask_function`` or ``bidirectional_mask_function`` (no sliding window,
chunking, packed-sequence or custom ``and``/``or`` overlay) combined with a 2-D padding mask,
it attaches a small :class:`PaddingRecord` (the ``(B, L)`` padding mask, causal or not, the
query offset, the mask's version counter) to the bool tensor it returns. The attention
function uses the record only when it still describes the tensor it receives: same object
(a sliced or rebuilt mask has no record), same shape, same ``_version`` (no in-place edit
since), and no extra bias / window keyword. Masks a model rewrites (Doge folds the mask into
its dynamic bias), user-built 4-D masks, sliding-window and chunked masks therefore keep the
dense path. A 2-D ``(B, L)`` mask passed directly to the attention function is a padding
mask by definition and is recognised too.

Semantics
---------
* Causal: packed sequence ``b`` holds the real tokens of row ``b``; the library's per-sequence
  bottom-right causal alignment equals the padded causal mask restricted to real tokens (the
  query positions are the last ``Lq`` key positions, so the ``t``-th real query sees the real
  keys up to its own). Padded query rows are returned as **zeros**. With left padding that is
  exactly what the dense path returns (those rows see no key); with right padding the dense
  path returns, for a padded query row, an average over the real keys before it — a value no
  real token ever reads (padded keys are masked for every real query), so hidden states and
  logits at real positions, and the gradients of any loss over real positions, are the same.
* Not causal (bidirectional masks, also cross-attention): only the keys are unpacked; every
  query row is kept, so every output row equals the dense path's.
* Attention dropout (training): the packed call drops with the same probability, but its
  keep-mask counts query rows and keys from each sequence's first real token (see
  :mod:`flash_dmattn.testing`), so it is a different draw from the dense path's: the two
  routes agree in distribution, not entry by entry.

Routing (``FLASH_DMATTN_HF_VARLEN``)
------------------------------------
``auto`` (default), ``always`` or ``never``, taken from, in order: the ``dmattn_varlen``
keyword of the attention call (transformers forwards extra ``model(...)`` keywords to it),
:func:`set_varlen_mode`, the environment variable ``FLASH_DMATTN_HF_VARLEN``.

* ``never``: the dense path, as before.
* ``always``: the packed route for every recognised call (also when nothing is padded).
* ``auto``: the packed route when it is valid *and* likely cheaper: at least one key is
  padding, and auto-dispatch would run the packed call on a kernel backend (``cuda`` /
  ``triton``). ``torch-reference``'s varlen path is a per-sequence Python loop, never
  cheaper than the dense kernels; so on CPU, and wherever no kernel takes packed calls,
  ``auto`` keeps the dense path.

Valid means: a recognised padding pattern, more than one query (decode steps with a KV cache
keep the dense path), queries at the end of the keys (training, prefill, chunked prefill with a
dynamic cache), no ``attention_bias`` / ``position_bias``, no sliding window, not inside
``torch.compile`` (the packing metadata needs host synchronisation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from .. import envs
from ..api import flash_dmattn_varlen_func
from ..utils.padding import gather_tokens, pad_input, unpad_indices

ENV_VAR = envs.HF_VARLEN
MODE_KWARG = "dmattn_varlen"
MODES = ("auto", "always", "never")

# Attribute under which dmattn_mask stores the PaddingRecord on the mask tensor it returns.
_RECORD_ATTR = "_dmattn_padding_record"

_mode_override: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# Routing mode
# ---------------------------------------------------------------------------------------------
def _check_mode(mode: Any, source: str) -> str:
    """Validate a routing mode string (ValueError names where the bad value came from)."""
    value = mode.strip().lower() if isinstance(mode, str) else mode
    if value not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(MODES)}; got {mode!r}")
    return value


def set_varlen_mode(mode: Optional[str]) -> None:
    """Set the process-wide routing mode (``"auto"``, ``"always"``, ``"never"``).

    ``None`` clears it, so the environment variable ``FLASH_DMATTN_HF_VARLEN`` applies again.
    A ``dmattn_varlen=`` keyword on a call still takes precedence.
    """
    global _mode_override
    _mode_override = None if mode is None else _check_mode(mode, "set_varlen_mode(mode)")


def get_varlen_mode(call_kwargs: Optional[dict] = None) -> str:
    """The routing mode for one call: keyword, then :func:`set_varlen_mode`, then env, then auto."""
    if call_kwargs is not None and call_kwargs.get(MODE_KWARG) is not None:
        return _check_mode(call_kwargs[MODE_KWARG], f"the {MODE_KWARG}= keyword")
    if _mode_override is not None:
        return _mode_override
    raw = envs.hf_varlen_mode()
    # Read per call (a dict lookup) so that tests and users can switch it at run time.
    return _check_mode(raw, f"environment variable {ENV_VAR}") if raw else "auto"


# ---------------------------------------------------------------------------------------------
# What a mask means
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class PaddingRecord:
    """What a bool mask tensor encodes: key ``j`` visible to query ``i`` of row ``b`` iff
    ``padding[b, j]`` and, when ``causal``, ``j <= i + q_offset``.

    ``padding`` is the ``(B, L)`` bool padding mask (True = real token; columns past ``L``
    are padding, as transformers pads it). ``version`` is the described tensor's
    ``_version`` when the record was made: an in-place edit since invalidates the record.
    ``causal`` / ``q_offset`` are None for a 2-D mask given to the attention function
    directly, whose causality is decided per call. ``plans`` caches packing metadata, so it
    is computed once per mask and shared by every layer.
    """

    padding: torch.Tensor
    version: int
    causal: Optional[bool] = None
    q_offset: Optional[int] = None
    plans: Dict[tuple, "PackPlan"] = field(default_factory=dict)


def _version_of(t: torch.Tensor) -> int:
    """``t._version``; -1 for inference-mode tensors, which keep no version counter."""
    try:
        return t._version
    except RuntimeError:
        return -1


def attach_record(mask: torch.Tensor, record: PaddingRecord) -> torch.Tensor:
    """Store ``record`` on ``mask`` (a plain Python attribute; the tensor is unchanged)."""
    setattr(mask, _RECORD_ATTR, record)
    return mask


def record_of(mask: Any) -> Optional[PaddingRecord]:
    """The record attached to ``mask`` if it still describes it (not edited in place since)."""
    record = getattr(mask, _RECORD_ATTR, None)
    if not isinstance(record, PaddingRecord) or record.version != _version_of(mask):
        return None
    return record


def record_for_sdpa_mask(
    mask: Optional[torch.Tensor], bound: Dict[str, Any]
) -> Optional[PaddingRecord]:
    """The record for a mask built by transformers' ``sdpa_mask`` with arguments ``bound``.

    Returns None unless the mask is exactly "plain causal or plain bidirectional + a 2-D
    padding mask": any other ``mask_function`` (sliding window, chunked, packed sequences,
    custom overlays) is a different callable, so identity comparison is exact and free.
    """
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    fn = bound.get("mask_function", getattr(masking_utils, "causal_mask_function", None))
    if fn is getattr(masking_utils, "causal_mask_function", object()):
        causal = True
    elif fn is getattr(masking_utils, "bidirectional_mask_function", object()):
        causal = False
    else:
        return None
    padding = bound.get("attention_mask")
    q_offset, kv_offset = bound.get("q_offset", 0), bound.get("kv_offset", 0)
    # transformers < 5 passes cache_position instead of q_offset; static caches pass tensor
    # offsets (reading them would synchronise): those keep the dense path.
    if "q_length" not in bound or type(q_offset) is not int or type(kv_offset) is not int:
        return None
    if kv_offset != 0 or not isinstance(padding, torch.Tensor) or padding.dim() != 2:
        return None
    if padding.shape[0] != mask.shape[0] or padding.is_floating_point():
        return None
    padding = padding if padding.dtype == torch.bool else padding != 0
    return PaddingRecord(
        padding=padding, version=_version_of(mask), causal=causal, q_offset=q_offset
    )


# ---------------------------------------------------------------------------------------------
# Packing metadata
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class PackPlan:
    """Packing metadata for one (mask, query length, key length): indices and cu_seqlens.

    ``q_index`` is None when every query row is kept (non-causal): then the packed queries
    are the plain ``(B * Lq)`` rows and ``cu_seqlens_q = arange(B + 1) * Lq``.
    """

    k_index: torch.Tensor
    cu_k: torch.Tensor
    max_k: int
    q_index: Optional[torch.Tensor]
    cu_q: torch.Tensor
    max_q: int
    total_q: int  # packed query rows
    total_k: int  # packed key rows (real keys)
    k_rows: int  # B * Lk, the unpacked key rows

    @property
    def padded(self) -> bool:
        """At least one key position is padding."""
        return self.total_k < self.k_rows


def _valid_keys(padding: torch.Tensor, key_len: int) -> torch.Tensor:
    """``(B, key_len)`` bool; columns past the padding mask's length are padding."""
    if padding.shape[-1] >= key_len:
        return padding[:, :key_len]
    return torch.nn.functional.pad(padding, (0, key_len - padding.shape[-1]), value=False)


def make_plan(padding: torch.Tensor, causal: bool, query_len: int, key_len: int) -> PackPlan:
    """Packing metadata; the queries are the last ``query_len`` of the ``key_len`` positions."""
    valid_k = _valid_keys(padding, key_len)
    k_index, cu_k, max_k, _ = unpad_indices(valid_k)
    batch = valid_k.shape[0]
    keys = dict(k_index=k_index, cu_k=cu_k, max_k=max_k, total_k=k_index.numel(),
                k_rows=batch * key_len)
    if not causal:
        # Keys only: query rows are kept, which is exact (a padded query row sees the real
        # keys, as in the dense path) and safe for cross-attention, where the query tokens
        # are not the key tokens.
        cu_q = torch.arange(batch + 1, device=padding.device, dtype=torch.int32) * query_len
        return PackPlan(q_index=None, cu_q=cu_q, max_q=query_len, total_q=batch * query_len, **keys)
    if query_len == key_len:
        q_index, cu_q, max_q = k_index, cu_k, max_k
    else:
        q_index, cu_q, max_q, _ = unpad_indices(valid_k[:, key_len - query_len:])
    return PackPlan(q_index=q_index, cu_q=cu_q, max_q=max_q, total_q=q_index.numel(), **keys)


# ---------------------------------------------------------------------------------------------
# Deciding whether a call takes the packed route
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Route:
    record: PaddingRecord
    causal: bool
    key_len: int  # keys actually attended (a 2-D mask may cut static-cache slots)


def _route_for_call(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Any,
    kwargs: dict,
) -> Optional[_Route]:
    """The padding pattern of this call if the packed route is valid for it, else None."""
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor):
        return None
    if any(kwargs.get(name) is not None for name in ("attention_bias", "position_bias", "s_aux")):
        return None  # extra score content the packed route would have to carry
    batch, query_len, key_len = query.shape[0], query.shape[2], key.shape[2]
    if query_len < 2:
        return None  # decode: one query reads the cache; nothing to gain from packing
    if attention_mask.dim() == 4:
        record = record_of(attention_mask)
        if record is None or record.causal is None:
            return None
        if tuple(attention_mask.shape) != (batch, 1, query_len, key_len):
            return None
        if record.causal and record.q_offset + query_len != key_len:
            return None
        route = _Route(record, record.causal, key_len)
    elif attention_mask.dim() == 2:
        route = _route_for_2d_mask(module, query_len, key_len, attention_mask, kwargs)
        if route is None:
            return None
    else:
        return None
    window = kwargs.get("sliding_window")
    if window is not None and route.key_len > int(window) > 0:
        return None
    if route.record.padding.shape[0] != batch:
        return None
    return route


def _route_for_2d_mask(
    module: Optional[torch.nn.Module],
    query_len: int,
    key_len: int,
    mask: torch.Tensor,
    kwargs: dict,
) -> Optional[_Route]:
    """A 2-D ``(B, L)`` padding mask given directly, with the dense path's causality rule."""
    length = mask.shape[-1]
    if length > key_len or mask.is_floating_point() or mask.is_complex():
        return None  # the dense path reports the error
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if is_causal and length < query_len:
        return None  # more queries than keys: not a self-attention layout
    record = record_of(mask)
    if record is None:
        # Cached on the mask, so every layer of one forward shares the packing metadata.
        padding = mask if mask.dtype == torch.bool else mask != 0
        record = PaddingRecord(padding, _version_of(mask))
        attach_record(mask, record)
    return _Route(record, bool(is_causal), length)


def _packed_backend_name(inputs: Any) -> Optional[str]:
    """The backend auto-dispatch would run packed ``inputs`` on, without logging or warning."""
    from .. import registry

    return registry.auto_backend_name(inputs)


def _kernel_takes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softcap: Optional[float],
    dropout_p: float = 0.0,
) -> bool:
    """Whether a kernel backend (not the per-sequence torch-reference loop) would run the call.

    Asked with empty packed tensors of the call's device, dtype and head counts: backends
    decide from those, so the answer costs no packing, no copy and no host synchronisation.
    """
    from ..inputs import VarlenInputs

    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    q = query.new_empty((0, heads, head_dim)).requires_grad_(needs_grad)
    kv = query.new_empty((0, kv_heads, head_dim))
    cu = torch.empty(1, dtype=torch.int32, device=query.device)
    inputs = VarlenInputs.from_args(q, kv, kv, cu, cu, 0, 0, softcap=softcap if softcap else None)
    if dropout_p > 0.0:
        # Set on the built inputs: from_args would draw the call's rng and so advance the
        # generator that the real call then draws from.
        inputs = dataclasses.replace(inputs, dropout_p=dropout_p)
    return _packed_backend_name(inputs) not in (None, "torch-reference")


# ---------------------------------------------------------------------------------------------
# The packed call
# ---------------------------------------------------------------------------------------------
def _get_varlen_kernel() -> Callable:
    """The packed-sequence library call (a seam: tests spy on it)."""
    return flash_dmattn_varlen_func


def _pack(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: PackPlan,
    causal: bool,
    scaling: Optional[float],
    softcap: Optional[float],
    dropout_p: float = 0.0,
) -> dict:
    """Keyword arguments of the varlen call: packed ``(total, heads, D)`` q/k/v + metadata."""
    batch, _, query_len, _ = query.shape
    q = query.transpose(1, 2)  # (B, Lq, H, D) views: nothing is copied before the gather
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if plan.q_index is None:
        q_packed = q.reshape(batch * query_len, *q.shape[2:])
    else:
        q_packed = gather_tokens(q, plan.q_index)
    k_packed, v_packed = gather_tokens(k, plan.k_index), gather_tokens(v, plan.k_index)
    # Quantised caches dequantise to their own dtype; the kernels take one dtype (as dense).
    if k_packed.dtype != q_packed.dtype:
        k_packed = k_packed.to(q_packed.dtype)
    if v_packed.dtype != q_packed.dtype:
        v_packed = v_packed.to(q_packed.dtype)
    return dict(
        query=q_packed,
        key=k_packed,
        value=v_packed,
        cu_seqlens_q=plan.cu_q,
        cu_seqlens_k=plan.cu_k,
        max_seqlen_q=plan.max_q,
        max_seqlen_k=plan.max_k,
        softmax_scale=scaling,
        is_causal=causal,
        softcap=softcap if softcap else None,
        dropout_p=dropout_p,
    )


def maybe_varlen_attention(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: Optional[float],
    softcap: Optional[float],
    kwargs: dict,
    dropout_p: float = 0.0,
) -> Optional[torch.Tensor]:
    """Attention through the packed route, ``(B, Lq, H, D)``, or None for the dense path.

    ``query`` ``(B, H, Lq, D)`` and ``key``/``value`` ``(B, Hkv, Lk, D)`` as transformers passes
    them; the caller has validated them (rank, dropout, attention sinks, scaling). Padded
    query rows of causal calls come back as zeros (see the module docstring). ``dropout_p``
    is the call's attention dropout (0 outside training).
    """
    mode = get_varlen_mode(kwargs)
    if mode == "never" or torch.compiler.is_compiling():
        return None
    route = _route_for_call(module, query, key, attention_mask, kwargs)
    if route is None:
        return None
    if mode == "auto" and not _kernel_takes(query, key, value, softcap, dropout_p):
        return None  # decided before any packing work: no cost where packing does not pay
    batch, _, query_len, _ = query.shape
    plan_key = (route.causal, query_len, route.key_len)
    plan = route.record.plans.get(plan_key)
    if plan is None:
        plan = make_plan(route.record.padding, route.causal, query_len, route.key_len)
        route.record.plans[plan_key] = plan
    if mode == "auto" and not plan.padded:
        return None  # nothing padded: the dense path with the same (or no) mask is cheaper
    if plan.total_q == 0 or plan.total_k == 0:
        return None  # nothing real to attend: the dense path already returns the zero rows
    key, value = key[:, :, : route.key_len], value[:, :, : route.key_len]
    packed = _pack(query, key, value, plan, route.causal, scaling, softcap, dropout_p)
    out = _get_varlen_kernel()(**packed)
    if plan.q_index is None:
        return out.view(batch, query_len, *out.shape[1:])
    return pad_input(out, plan.q_index, batch, query_len)
