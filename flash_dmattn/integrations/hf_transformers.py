"""HuggingFace ``transformers`` attention function and mask function for flash_dmattn.

``dmattn_attention_forward`` has the signature of transformers' attention interface
(``sdpa_attention_forward`` / ``eager_attention_forward``) and ``dmattn_mask`` that of its
attention-mask interface; :func:`register` installs both under the name ``"dmattn"``. This
module imports ``transformers`` only inside :func:`register` and :func:`dmattn_mask`, so the
attention function itself works on plain tensors without transformers installed.

Padding masks take the packed-sequence path
-------------------------------------------
When the mask of a call is exactly "causal (or not) + key padding" (a batch padded on the
left, as in generation, or on the right, as in training), ``dmattn_attention_forward`` can
unpad the real tokens, call :func:`flash_dmattn.flash_dmattn_varlen_func` without any mask
and pad the result back, instead of passing a ``(B, 1, Lq, Lk)`` mask to the dense kernel.
``dmattn_mask`` recognises the pattern where it is built (it knows which transformers mask
function it was asked for) and attaches the ``(B, L)`` padding mask to the bool tensor it
returns; see :mod:`flash_dmattn.integrations.hf_varlen` for the rules. Control:

* ``FLASH_DMATTN_HF_VARLEN=auto|always|never`` (environment; default ``auto``),
* :func:`flash_dmattn.integrations.hf_varlen.set_varlen_mode` (process-wide, overrides the
  environment),
* ``dmattn_varlen="auto"|"always"|"never"`` keyword on a call (e.g. ``model(ids,
  attention_mask=am, dmattn_varlen="never")``; transformers forwards it), overriding both.

``never`` keeps the dense path; ``always`` packs every recognised call with more than one
query; ``auto`` packs when some key is padding and a packed kernel backend (``cuda`` /
``triton``, not the per-sequence ``torch-reference`` loop) would run it. Decode steps (one
query against a KV cache), masks with any other content (sliding windows, chunks, dynamic
masks, user 4-D masks, masks edited in place) and calls with ``attention_bias`` /
``position_bias`` always keep the dense path. Padded query rows of causal packed calls are
zeros; rows of real tokens are identical to the dense path's.

Calls with no mask take the plain route
---------------------------------------
A call with no mask, no soft cap, no dropout and no ``sliding_window`` / ``attention_bias`` /
``position_bias`` (a decoding step of Llama and most models, an unpadded prefill) goes straight
to :func:`flash_dmattn.flash_dmattn_func` without the mask normalisation, where a signature that
auto-dispatch has decided is served by :func:`flash_dmattn.registry.run_plain` (on a GPU, with
no validation object, dispatch or custom op: one SDPA call for a step over little K/V, policy
rule ``gpu-plain-decode``, or for a training call on Hopper of the shapes cuDNN's attention
takes, rule ``hopper-plain-training``; else the triton split-KV decode kernel).
The output is the general route's; invalid calls raise as they do there.

Decoding steps of top-W dynamic-mask models read only the kept keys
-------------------------------------------------------------------
A Doge decoding step (one query; its layer has already kept the ``keep_window_size`` best
keys per kv head and written dtype-min into the others' entries of the additive mask) runs
over the kept keys by index (:func:`~flash_dmattn.topk_decode.selected_keys_attention`): one
``torch.topk`` over each kv head's mask row finds them, and the triton decode kernel reads
their K/V rows and mask values only, with no ``(B, H, 1, L)`` bool mask built and no
dispatch per layer. Other calls (prefill, other models, ``L <= keep_window_size``) keep the
dense path.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Optional, Tuple

import torch

from ..api import flash_dmattn_func
from ..dropout import check_dropout_p
from ..topk_decode import run_selected
from . import hf_varlen

#: The name under which :func:`register` installs the attention and mask functions. It must not
#: contain "flash": transformers 5.x treats such names as flash-attention / hub-kernel requests.
DEFAULT_NAME = "dmattn"

# Models whose attention layers turn the mask they are given into a *dynamic* mask of their
# own (bias + top-k), instead of passing it through. They need a materialised causal mask even
# where sdpa's mask function would return None and rely on ``is_causal``: once such a model has
# folded the (absent) mask into its float bias, the attention function is handed a non-None
# mask and cannot tell that causality was dropped. transformers' own Doge has this property
# (with ``attn_implementation="sdpa"`` an unpadded Doge prefill is not causal).
_DYNAMIC_MASK_MODEL_TYPES = frozenset({"doge"})


def _model_type(module: Optional[torch.nn.Module]) -> Optional[str]:
    """``module.config.model_type`` (None where the layer has no config)."""
    return getattr(getattr(module, "config", None), "model_type", None)


def _get_kernel() -> Callable:
    """The library call used for every attention (a seam: tests spy on it):
    :func:`~flash_dmattn.flash_dmattn_func`, i.e. ``flash_dmattn_func_auto()``."""
    return flash_dmattn_func


def _get_selected_kernel() -> Callable:
    """The library call of a top-W decoding step (:func:`_topk_decode`; a seam: tests spy on
    it). Takes keywords ``query, key, value, key_index, attn_bias, softmax_scale, is_causal,
    softcap, cache_seqlens, bias_floor`` (:func:`flash_dmattn.topk_decode.run_selected`)."""
    return run_selected


# ---------------------------------------------------------------------------------------------
# Mask / bias normalisation
# ---------------------------------------------------------------------------------------------
def _dropout_p(module: Optional[torch.nn.Module], dropout: Optional[float]) -> float:
    """The attention dropout of a call: ``dropout`` (checked to be in ``[0, 1)``) while the
    module trains or when there is no module, else 0."""
    p = check_dropout_p(dropout)
    # Models pass their configured dropout only while training (``0.0 if not self.training``),
    # but some pass it unconditionally; eager attention drops only in training mode
    # (``F.dropout(..., training=module.training)``), and so does this function.
    if module is not None and not getattr(module, "training", True):
        return 0.0
    return p


def _masked_threshold(dtype: torch.dtype) -> float:
    # transformers writes torch.finfo(dtype).min (or -inf) into masked entries of additive
    # masks; anything at or below half of it cannot be a real score offset.
    floor = _MASKED_THRESHOLDS.get(dtype)
    if floor is None:
        floor = _MASKED_THRESHOLDS[dtype] = torch.finfo(dtype).min / 2
    return floor


_MASKED_THRESHOLDS: dict = {}  # by dtype: a decoding step asks once per layer


def _split_additive_mask(
    mask: torch.Tensor, has_bias: bool = False
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Split a float additive mask into ``(bool attend-mask, bias or None)``.

    Equivalent plain PyTorch::

        keep = torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min / 2)
        bias = mask if has_bias or mask.shape[-2] == 1 or (mask[keep] != 0).any() else None

    The bias is the given tensor itself (its masked entries are never read because the bool
    mask excludes them), so nothing larger than the input is allocated.
    """
    keep = torch.isfinite(mask) & (mask > _masked_threshold(mask.dtype))
    if has_bias:
        # The caller knows the mask carries a bias (a dynamic-mask model's): no need to look.
        return keep, mask
    if mask.dim() >= 2 and mask.shape[-2] == 1:
        # One row for every query (a decoding step's mask, a padding mask): kept as a per-key
        # bias without looking, because looking makes the host wait for the device at every
        # layer of every step, and reading one bias row per tile costs next to nothing.
        return keep, mask
    # A pure 0 / sentinel mask carries no bias: skipping it saves a bias read per tile and,
    # during training, a bias-gradient reduction nobody asked for.
    has_bias = bool(((mask != 0) & keep).any()) if mask.numel() else False
    return keep, (mask if has_bias else None)


def _as_bias(name: str, t: torch.Tensor, query_dtype: torch.dtype, key_len: int) -> torch.Tensor:
    """A float bias in the library's layout: 4-D, last dim sliced to the keys, legal dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() == 3:
        # The 1.2.x per-key form (batch, heads, key_len): the same bias for every query.
        t = t.unsqueeze(-2)
    if t.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D (batch, heads, query_len, key_len) or 3-D "
            f"(batch, heads, key_len), got shape {tuple(t.shape)}"
        )
    t = _slice_keys(name, t, key_len)
    # The kernels take a bias in the query's dtype or float32; float32 keeps every value exact.
    if t.dtype not in (query_dtype, torch.float32):
        t = t.float()
    return t


def _slice_keys(name: str, t: torch.Tensor, key_len: int) -> torch.Tensor:
    # transformers' masks may be built for a static cache's full length while the keys of this
    # call are shorter; like eager and flex attention, keep the first key_len columns.
    if t.shape[-1] > key_len:
        return t[..., :key_len]
    if t.shape[-1] < key_len and t.shape[-1] != 1:
        raise ValueError(
            f"{name} covers {t.shape[-1]} keys but there are {key_len} keys; "
            f"shape {tuple(t.shape)} cannot be broadcast to key_len={key_len}"
        )
    return t


def normalise_hf_mask(
    attention_mask: Optional[torch.Tensor], key_len: int, has_bias: bool = False
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], bool, int]:
    """Turn whatever a transformers model passed as ``attention_mask`` into library inputs.

    ``has_bias``: a float mask is known to carry a bias (a dynamic-mask model's), so it is
    kept as the bias without looking at its values (which makes the host wait for the device).

    Returns ``(bool_mask, bias, is_structural, key_limit)``:

    * ``None`` -> ``(None, None, False, key_len)``.
    * bool 4-D ``(B, 1|H, Lq, >=Lk)`` (True = attend) -> the mask, key dim sliced to ``Lk``.
    * float 4-D additive (0 = attend, dtype-min / -inf = masked, possibly plus a real bias) ->
      ``isfinite(m) & (m > finfo.min / 2)`` and ``m`` itself as bias if it holds any value
      other than 0 and the sentinel.
    * 3-D ``(B, Lq, Lk)`` -> as 4-D with a singleton head dim.
    * 2-D ``(B, L)`` padding mask (nonzero = real token) -> ``(B, 1, 1, L)`` bool and
      ``key_limit = L``: the keys past ``L`` are unused static-cache slots (transformers pads
      such masks with False, see ``prepare_padding_mask``).

    ``is_structural`` is True for 3-/4-D masks: they already encode causality, so
    ``is_causal`` is not applied on top of them.
    """
    if attention_mask is None:
        return None, None, False, key_len
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__} "
            f"(flex-attention BlockMasks are not supported; use attn_implementation='dmattn' "
            f"with its registered mask function)"
        )
    m = attention_mask
    if m.dim() == 2:
        length = m.shape[-1]
        if length > key_len:
            raise ValueError(
                f"2-D attention_mask has length {length} but there are only {key_len} keys; "
                f"pass a 4-D mask for caches that drop tokens (sliding windows)"
            )
        keep = m if m.dtype == torch.bool else m != 0
        return keep[:, None, None, :], None, False, length
    if m.dim() == 3:
        m = m.unsqueeze(1)
    if m.dim() != 4:
        raise ValueError(
            f"attention_mask must be 2-D (batch, seq), 3-D or 4-D (batch, heads, query, key), "
            f"got shape {tuple(m.shape)}"
        )
    m = _slice_keys("attention_mask", m, key_len)
    if m.dtype == torch.bool:
        return m, None, True, key_len
    if m.is_floating_point():
        keep, bias = _split_additive_mask(m, has_bias)
        return keep, bias, True, key_len
    # Integer 4-D masks follow the 2-D convention: nonzero = attend.
    return m != 0, None, True, key_len


def _band_mask(
    query_len: int, key_len: int, sliding_window: int, device: torch.device
) -> torch.Tensor:
    """``(1, 1, Lq, Lk)`` bool: key j visible to query i iff ``j > i + Lk - Lq - window``.

    transformers' sliding-window convention (``sliding_window_overlay``), bottom-right aligned
    like the library's causal mask.
    """
    q_pos = torch.arange(query_len, device=device)[:, None] + (key_len - query_len)
    k_pos = torch.arange(key_len, device=device)[None, :]
    return (k_pos > q_pos - sliding_window)[None, None]


def _combine_bias(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    if b is None:
        return a
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return a + b


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------
def dmattn_attention_forward(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers attention-interface function running flash_dmattn.

    Args:
        module: the calling attention layer (``is_causal`` and ``training`` are read from it).
        query: ``(B, H, Lq, D)``; key, value: ``(B, Hkv, Lk, D)`` (heads first, as
            transformers passes them). K/V are never repeated for GQA.
        attention_mask: None, bool 4-D (True = attend), additive float 4-D (0 / dtype-min or
            -inf, possibly plus a real bias, as Doge passes it), 3-D, or a 2-D ``(B, L)``
            padding mask; 4-D masks may be longer than ``Lk`` (sliced).
        scaling: softmax scale (default ``1/sqrt(D)``).
        dropout: attention dropout probability in ``[0, 1)``, applied by the kernel to the
            normalised probabilities while ``module.training`` (or with no module); ignored
            in eval mode, as eager attention does. ``torch.manual_seed`` reproduces it; the
            random stream is the library's, not ``F.dropout``'s.
        softcap: ``softcap * tanh(s / softcap)`` on the scaled scores.
        kwargs: ``is_causal`` (default ``module.is_causal``, else True; used only with no 3-/4-D
            mask and ``Lq > 1``), ``attention_bias`` / ``position_bias`` (extra additive biases,
            4-D or per-key 3-D), ``sliding_window`` (applied only when no 3-/4-D mask is given);
            others (``position_ids``, ``output_attentions``, ...) are ignored.

    Returns ``(attn_output (B, Lq, H, D), None)``.

    A mask that ``dmattn_mask`` built as "causal (or not) + key padding", or a 2-D padding
    mask, may instead be run as packed sequences (``dmattn_varlen`` keyword /
    ``FLASH_DMATTN_HF_VARLEN``, see the module docstring): same rows for real tokens, zeros
    for the padded query rows of causal calls.

    Equivalent plain PyTorch (``repeat_kv`` as in transformers, ``m`` the additive form of the
    mask, ``causal`` as decided above)::

        k, v = repeat_kv(key, H // Hkv), repeat_kv(value, H // Hkv)
        s = (query @ k.transpose(-1, -2)).float() * scaling
        if softcap: s = softcap * torch.tanh(s / softcap)
        keep = torch.isfinite(m) & (m > torch.finfo(m.dtype).min / 2)   # & causal band
        s = torch.where(keep, s + m + attention_bias, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)                        # fully masked rows -> 0
        p = p * keep / (1 - dropout)    # training: keep = the call's keep-mask (flash_dmattn.testing)
        out = (p @ v.float()).to(query.dtype).transpose(1, 2)           # (B, Lq, H, D)

    With no mask, ``is_causal`` and ``Lk > Lq > 1`` the keys are cut to the first ``Lq`` (as
    transformers' sdpa integration does: this only happens when prefilling an empty static
    cache, whose later slots are empty).
    """
    dropout_p = _validate_call(module, query, key, value, scaling, dropout, kwargs)
    if attention_mask is None:
        # No mask (a decoding step of most models, an unpadded prefill): neither the top-W nor
        # the packed route applies; the routing keyword / environment is still checked.
        hf_varlen.get_varlen_mode(kwargs)
        out = _unmasked_call(module, query, key, value, scaling, softcap, kwargs, dropout_p)
        if out is not None:
            return out, None
    else:
        # A Doge decoding step: attend to the W keys its additive mask keeps, by index.
        out = _topk_decode(module, query, key, value, attention_mask, scaling, softcap, kwargs,
                           dropout_p)
        if out is not None:
            return out, None
        # A "causal + key padding" mask may be cheaper as packed sequences (module docstring).
        out = hf_varlen.maybe_varlen_attention(
            module, query, key, value, attention_mask, scaling, softcap, kwargs, dropout_p,
        )
        if out is not None:
            return out, None
    call = _attention_call(
        module, query, key, value, attention_mask, scaling, softcap, kwargs, dropout_p
    )
    out = _get_kernel()(**call)
    return out, None


def _validate_call(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: Optional[float],
    dropout: float,
    kwargs: dict,
) -> float:
    """Checks shared by the dense and the packed route (typed errors, before any work);
    returns the call's dropout (:func:`_dropout_p`)."""
    dropout_p = _dropout_p(module, dropout)
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            "flash_dmattn does not support attention sinks (s_aux); use attn_implementation='eager'"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key and value must be 4-D (batch, heads, seq, head_dim), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if scaling is not None and not math.isfinite(float(scaling)):
        raise ValueError(f"scaling must be finite, got {scaling}")
    return dropout_p


def prepare_attention_call(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float],
    dropout: float,
    softcap: Optional[float],
    kwargs: dict,
) -> dict:
    """The keyword arguments of the library call that ``dmattn_attention_forward`` makes.

    Keys: ``query``, ``key``, ``value`` (``(B, L, H|Hkv, D)`` views), ``attn_mask``,
    ``attn_bias``, ``softmax_scale``, ``is_causal``, ``softcap``, ``dropout_p``.
    """
    dropout_p = _validate_call(module, query, key, value, scaling, dropout, kwargs)
    return _attention_call(module, query, key, value, attention_mask, scaling, softcap, kwargs,
                           dropout_p)


def _attention_call(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float],
    softcap: Optional[float],
    kwargs: dict,
    dropout_p: float,
) -> dict:
    """:func:`prepare_attention_call` on validated arguments (``dropout_p``: the call's)."""
    query_len, key_len = query.shape[2], key.shape[2]

    mask, mask_bias, structural, key_limit = normalise_hf_mask(
        attention_mask, key_len, has_bias=_model_type(module) in _DYNAMIC_MASK_MODEL_TYPES
    )

    causal = _call_is_causal(module, kwargs, query_len, structural)
    if attention_mask is None:
        key_limit = min(key_limit, _unmasked_key_limit(causal, query_len, key_len))
    if key_limit < key_len:
        # Views only: the trailing keys are static-cache slots nothing may attend to.
        key, value = key[:, :, :key_limit], value[:, :, :key_limit]
        key_len = key_limit

    sliding_window = kwargs.get("sliding_window")
    if not structural and sliding_window is not None and key_len > int(sliding_window) > 0:
        band = _band_mask(query_len, key_len, int(sliding_window), query.device)
        mask = band if mask is None else mask & band

    bias = mask_bias
    for name in ("attention_bias", "position_bias"):
        extra = kwargs.get(name)
        if extra is not None:
            bias = _combine_bias(bias, _as_bias(name, extra, query.dtype, key_len))
    if bias is not None and bias.dtype not in (query.dtype, torch.float32):
        bias = bias.float()

    q, k, v = _library_layout(query, key, value)
    return dict(
        query=q,
        key=k,
        value=v,
        attn_mask=mask,
        attn_bias=bias,
        softmax_scale=scaling,
        is_causal=causal,
        softcap=softcap if softcap else None,
        dropout_p=dropout_p,
    )


def _unmasked_call(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: Optional[float],
    softcap: Optional[float],
    kwargs: dict,
    dropout_p: float,
) -> Optional[torch.Tensor]:
    """The library call of :func:`_attention_call` for a call with no mask, no soft cap, no
    dropout and none of the keywords that add to the scores (``sliding_window``,
    ``attention_bias``, ``position_bias``), made without its mask normalisation: ``q, k, v``,
    the scale and the causal flag, which :func:`flash_dmattn.registry.run_plain` serves
    without validating again once auto-dispatch has decided the signature (a decoding step on
    the triton decode kernel). None for any other call (the general route runs it)."""
    if (softcap or dropout_p
            or kwargs.get("sliding_window") is not None
            or kwargs.get("attention_bias") is not None
            or kwargs.get("position_bias") is not None):
        return None
    query_len = query.shape[2]
    causal = _call_is_causal(module, kwargs, query_len, False)
    key_limit = _unmasked_key_limit(causal, query_len, key.shape[2])
    if key_limit < key.shape[2]:
        key, value = key[:, :, :key_limit], value[:, :, :key_limit]
    q, k, v = _library_layout(query, key, value)
    return _get_kernel()(query=q, key=k, value=v, attn_mask=None, attn_bias=None,
                         softmax_scale=scaling, is_causal=causal, softcap=None,
                         dropout_p=dropout_p)


def _call_is_causal(module: Optional[torch.nn.Module], kwargs: dict, query_len: int,
                    structural: bool) -> bool:
    """Whether the library call is causal: the ``is_causal`` keyword, else the layer's flag,
    else True; but a 3-/4-D mask (``structural``) already says what each query sees, and a
    single query sees every cached key."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    return bool(is_causal) and not structural and query_len > 1


def _unmasked_key_limit(causal: bool, query_len: int, key_len: int) -> int:
    """Keys a call without a mask reads: a causal call with more keys than queries is the
    prefill of an empty static cache, whose trailing slots are empty (as transformers' sdpa
    integration cuts them)."""
    return query_len if causal and key_len > query_len else key_len


def _library_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """``(B, L, H, D)`` views of transformers' heads-first tensors; K/V caches in another dtype
    (quantised caches dequantise to their own dtype) are cast because the kernels take one
    dtype."""
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Decoding steps of models with a top-W dynamic mask (Doge)
# ---------------------------------------------------------------------------------------------
def _decode_window(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Any,
    kwargs: dict,
    dropout_p: float,
) -> Optional[int]:
    """``W`` when this call is a decoding step of a top-W dynamic-mask model whose additive
    mask keeps at most ``W`` of more than ``W`` keys; else None (the dense path runs).

    Doge (``config.model_type == "doge"``) keeps, per kv head, the ``keep_window_size`` keys
    with the largest dynamic bias (a ``torch.topk`` over every key), writes dtype-min into the
    others and repeats the result over each group's query heads before calling the attention
    function, so every kv head's mask row has at most ``W`` entries that are not masked, and
    the first query head of a group carries the group's row.
    """
    if query.shape[2] != 1 or not isinstance(attention_mask, torch.Tensor) or dropout_p:
        return None
    m = attention_mask
    if m.dim() != 4 or m.shape[2] != 1 or not m.is_floating_point():
        return None
    if _model_type(module) not in _DYNAMIC_MASK_MODEL_TYPES:
        return None
    window = getattr(module, "keep_window_size", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return None
    batch, heads = query.shape[0], query.shape[1]
    kv_heads, key_len = key.shape[1], key.shape[2]
    if key_len <= window or m.shape[-1] < key_len or heads % kv_heads:
        return None
    if m.shape[0] not in (1, batch) or m.shape[1] not in (1, kv_heads, heads):
        return None
    if (kwargs.get("attention_bias") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("sliding_window") is not None):
        return None
    return window


def _topk_decode(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: Optional[float],
    softcap: Optional[float],
    kwargs: dict,
    dropout_p: float,
) -> Optional[torch.Tensor]:
    """A Doge decoding step over the ``W`` keys its mask keeps, or None (see
    :func:`_decode_window`).

    The kept keys are found with one ``torch.topk`` of ``W`` over each kv head's mask row (the
    row has at most ``W`` unmasked entries, so the top ``W`` hold all of them, whatever order
    ties take) and attended by index (:func:`flash_dmattn.topk_decode.run_selected`): the
    triton kernel reads those ``W`` keys' K/V rows and mask values and nothing of the other
    keys, and no ``(B, H, 1, Lk)`` bool mask is built. Which slots are visible is read from the
    mask values as the dense path reads them (``isfinite(m) & (m > finfo.min / 2)``), and the
    values are added as the bias, so the output is the dense path's.
    """
    window = _decode_window(module, query, key, attention_mask, kwargs, dropout_p)
    if window is None:
        return None
    group = query.shape[1] // key.shape[1]
    m = attention_mask
    if m.shape[-1] > key.shape[2]:
        m = m[..., : key.shape[2]]
    if m.shape[1] == query.shape[1] and group > 1:
        m = m[:, ::group]  # one row per kv head: the group's first query head
    floor = _masked_threshold(m.dtype)  # of the mask's own dtype, as the dense path reads it
    if m.dtype not in (query.dtype, torch.float32):
        m = m.float()
    index = torch.topk(m[:, :, 0], window, dim=-1, sorted=False).indices  # (B, Hkv, W)
    q, k, v = _library_layout(query, key, value)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return _get_selected_kernel()(
        query=q, key=k, value=v, key_index=index, attn_bias=m, softmax_scale=scale,
        is_causal=False, softcap=float(softcap) if softcap else 0.0, cache_seqlens=None,
        bias_floor=floor,
    )


# ---------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------
def _sdpa_mask_function() -> Callable:
    try:
        from transformers import masking_utils
    except ImportError as exc:  # transformers < 4.53 has no mask interface
        raise ImportError(
            "dmattn_mask needs transformers.masking_utils (transformers >= 4.53)"
        ) from exc
    fn = getattr(masking_utils, "sdpa_mask", None)
    if fn is None:
        fn = masking_utils.AttentionMaskInterface._global_mapping.get("sdpa")
    if fn is None:
        raise RuntimeError(
            "this transformers version has no sdpa mask function to build dmattn masks from"
        )
    return fn


def dmattn_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers attention-mask-interface function for ``"dmattn"``.

    Builds the same boolean ``(B, 1, Lq, Lk)`` mask (True = attend) as transformers' sdpa mask
    function, with the same arguments, and the same ``None`` when the mask is plain causal (or
    plain full) so the attention function can use ``is_causal`` and skip tiles without reading
    a mask. For models that derive their own dynamic mask from the mask they receive
    (``config.model_type == "doge"``) the causal mask is materialised for every call with more
    than one query, because they drop the ``None`` → causal meaning when they fold it into
    their bias; a single query (a decoding step) has no causality to drop and gets sdpa's
    answer.

    When the mask is plain causal or plain bidirectional plus a 2-D padding mask, the returned
    tensor carries a :class:`~flash_dmattn.integrations.hf_varlen.PaddingRecord` (a Python
    attribute holding that ``(B, L)`` mask) so that the attention function can run the call as
    packed sequences without reading the 4-D mask. The tensor itself is unchanged.

    Equivalent::

        return transformers.masking_utils.sdpa_mask(*args, **kwargs)
    """
    config = kwargs.get("config")
    if (getattr(config, "model_type", None) in _DYNAMIC_MASK_MODEL_TYPES
            and _query_length(kwargs) != 1):
        # A single query (a decoding step) has no causality to lose: there sdpa's rule applies
        # (None without padding, as for sdpa), which spares the step the mask and every layer
        # the folding of it into the dynamic mask.
        kwargs["allow_is_causal_skip"] = False
    build = _sdpa_mask_function()
    mask = build(*args, **kwargs)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
        raise TypeError(
            f"transformers' sdpa mask function returned {type(mask).__name__} "
            f"{getattr(mask, 'dtype', '')}; dmattn expects a bool tensor or None"
        )
    if mask is not None and not torch.compiler.is_compiling():
        # Remember what this mask is, so that the attention function can take the packed
        # route without reading the mask (attributes on traced tensors are left alone).
        record = hf_varlen.record_for_sdpa_mask(mask, _bind_mask_arguments(build, args, kwargs))
        if record is not None:
            hf_varlen.attach_record(mask, record)
    return mask


def _query_length(kwargs: dict) -> Optional[int]:
    """The query length a mask-function call describes (``q_length``, or transformers < 5's
    ``cache_position``), None when the call does not say."""
    q_length = kwargs.get("q_length")
    if isinstance(q_length, int) and not isinstance(q_length, bool):
        return q_length
    cache_position = kwargs.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.dim() == 1:
        return cache_position.shape[0]
    return None


def _bind_mask_arguments(build: Callable, args: tuple, kwargs: dict) -> dict:
    """The mask function's arguments by name (transformers passes keywords; accept both)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(build).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {}  # unknown calling convention: no record, the dense path is always right
    return dict(bound.arguments)


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------
def register(name: str = DEFAULT_NAME) -> str:
    """Register :func:`dmattn_attention_forward` and :func:`dmattn_mask` under ``name``.

    After this, ``from_pretrained(..., attn_implementation="dmattn")``,
    ``from_config(..., attn_implementation="dmattn")`` and
    ``model.set_attn_implementation("dmattn")`` use flash_dmattn. Idempotent.

    Equivalent::

        transformers.AttentionInterface.register(name, dmattn_attention_forward)
        transformers.masking_utils.AttentionMaskInterface.register(name, dmattn_mask)

    Raises ImportError without transformers, RuntimeError when it has no
    ``AttentionInterface`` (transformers < 4.48), ValueError for a name transformers would
    read as a flash-attention or hub-kernel request. With 4.48 <= transformers < 4.53 (no
    mask interface) only the attention function is registered; those versions build 4-D
    masks in the model, which the attention function accepts.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if "flash" in name or "/" in name or ":" in name:
        raise ValueError(
            f"attention implementation name {name!r} would be read by transformers as a "
            f"flash-attention or hub-kernel request; use a name without 'flash', '/' or ':' "
            f"(default {DEFAULT_NAME!r})"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"flash_dmattn.integrations needs HuggingFace transformers, which could not be "
            f"imported ({exc}); pip install -U transformers"
        ) from exc
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        try:
            from transformers.modeling_utils import AttentionInterface as interface
        except ImportError as exc:
            raise RuntimeError(
                f"transformers {transformers.__version__} has no AttentionInterface; "
                f"flash_dmattn's integration needs transformers >= 4.48"
            ) from exc
    interface.register(name, dmattn_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, dmattn_mask)
    return name
