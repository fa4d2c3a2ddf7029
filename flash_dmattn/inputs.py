"""One validated, normalised description of an attention call (docs/contract.md §3).

Every public entry point builds an :class:`AttentionInputs` (or :class:`VarlenInputs`) once,
before any backend runs. Backends then read plain attributes and never re-validate: they may
rely on every invariant listed in the class docstrings.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .dropout import check_dropout_p, draw_rng
from .masks import KeyIntervals

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fmt(t: torch.Tensor) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    return f"{tuple(t.shape)} {dtype} on {t.device}"


def _check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {t.dtype}; supported dtypes are float16, bfloat16, float32 and "
            f"float64 (kernels take float16/bfloat16)"
        )


def _check_qkv(query, key, value, layout: str) -> None:
    """Types, rank, one dtype, one device, and key/value shapes alike (docs/contract.md §3.5)."""
    rank = int(layout[0])
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    _check_float_dtype("query", query)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"query, key and value must share one dtype, got query {_fmt(query)}, "
            f"key {_fmt(key)}, value {_fmt(value)}"
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"query, key and value must be on one device, got query {_fmt(query)}, "
            f"key {_fmt(key)}, value {_fmt(value)}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}"
        )


def _needs_grad(*tensors) -> bool:
    """True when autograd will ask for a gradient of any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Kernels vectorise along the head dim; every other stride is used as given.
    return t if t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


def _collapse_broadcast_dims(t: torch.Tensor) -> torch.Tensor:
    """Narrow every stride-0 dimension to size 1 (a view).

    A user who passes ``mask.expand(B, H, L, L)`` means a broadcast mask; reading it as one lets
    backends take their per-key / per-head fast paths and keeps block maps small.
    """
    strides = t.stride()
    if 0 not in strides:  # the usual case, on every call: nothing broadcast
        return t
    for dim, (size, stride) in enumerate(zip(t.shape, strides)):
        if size > 1 and stride == 0:
            t = t.narrow(dim, 0, 1)
    return t


def _number(name: str, value) -> float:
    """``value`` as a float; a ``TypeError`` naming the argument for anything but a real
    number (bool excluded: ``True`` as a scale or cap is a caller bug, not 1.0)."""
    if type(value) is float:  # the usual case, on every call
        return value
    if isinstance(value, (bool, str, bytes)) or (
        isinstance(value, torch.Tensor) and (value.numel() != 1 or value.dtype == torch.bool)
    ):
        raise TypeError(f"{name} must be a number or None, got {_describe_value(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or None, got {_describe_value(value)}") from None


def resolve_deterministic(value) -> bool:
    """The ``deterministic`` argument as a bool. ``None`` (the default) follows
    :func:`torch.are_deterministic_algorithms_enabled`, as PyTorch's own operators do, so that
    ``torch.use_deterministic_algorithms(True)`` makes every backward bitwise reproducible; an
    explicit ``True`` / ``False`` wins over the global setting."""
    if value is None:
        return torch.are_deterministic_algorithms_enabled()
    return _flag("deterministic", value)


def _flag(name: str, value) -> bool:
    """``value`` as a bool: None, a bool, or an integer 0 / 1; else a ``TypeError`` naming the
    argument (a tensor passed one position too far lands here)."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{name} must be a bool or None, got {_describe_value(value)}")


def _describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def default_softmax_scale(head_dim: int) -> float:
    """The scale of a call that gives none: ``1 / sqrt(head_dim)`` (1 for an empty head dim)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _scale_and_softcap(softmax_scale, softcap, head_dim: int) -> Tuple[float, float]:
    if softmax_scale is None:
        scale = default_softmax_scale(head_dim)
    else:
        scale = _number("softmax_scale", softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    cap = 0.0 if softcap is None else _number("softcap", softcap)
    if not math.isfinite(cap) or cap < 0.0:
        raise ValueError(f"softcap must be None, 0.0 (off) or a positive number, got {softcap}")
    return scale, cap


def _check_aux_type(name: str, t, query: torch.Tensor) -> None:
    """A mask must be bool; a bias float in the query's dtype or fp32; both on its device."""
    if not isinstance(t, torch.Tensor):
        kinds = "a bool torch.Tensor, a KeyIntervals" if name == "attn_mask" else "a torch.Tensor"
        raise TypeError(f"{name} must be {kinds} or None, got {type(t).__name__}")
    if name == "attn_mask":
        if t.dtype != torch.bool:
            if t.is_floating_point():
                hint = (
                    "for a 0/1 mask write attn_mask=mask.bool(); for an additive mask (0 = "
                    "attend, -inf or a large negative number = masked) write attn_mask=(mask == 0)"
                    ", or pass it as attn_bias=mask"
                )
            else:
                hint = "write attn_mask=mask.bool() (nonzero = attend), or pass an additive mask as attn_bias"
            raise TypeError(
                f"attn_mask must be a bool tensor (True = attend), got {t.dtype} with shape "
                f"{tuple(t.shape)}; {hint}"
            )
    else:
        if t.dtype == torch.bool:
            raise TypeError(
                "attn_bias must be a floating tensor (added to the scores), got bool with shape "
                f"{tuple(t.shape)}; pass a boolean mask as attn_mask"
            )
        if t.dtype not in (query.dtype, torch.float32):
            raise ValueError(
                f"attn_bias has dtype {t.dtype} but query has {query.dtype}; attn_bias must have "
                f"the query's dtype or float32"
            )
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}")


def normalise_mask_or_bias(
    name: str,
    t: Optional[torch.Tensor],
    *,
    query: torch.Tensor,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    seqlen_q: int,
    seqlen_k: int,
) -> Optional[torch.Tensor]:
    """Check a mask or bias and return it as a 4-D view ``(Bx, Hx, Qx, Kx)``.

    ``Bx in {1, B}``, ``Hx in {1, Hkv, H}``, ``Qx in {1, Lq}``, ``Kx in {1, Lk}``. Fewer than 4 dims
    are left-padded with size-1 dims; nothing is expanded or copied.
    """
    if t is None:
        return None
    _check_aux_type(name, t, query)
    given = tuple(t.shape)
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims, got shape {given}")
    while t.dim() < 4:
        t = t.unsqueeze(0)
    bx, hx, qx, kx = t.shape
    target = (batch, num_heads, seqlen_q, seqlen_k)
    ok = (
        bx in (1, batch)
        and hx in (1, num_kv_heads, num_heads)
        and qx in (1, seqlen_q)
        and kx in (1, seqlen_k)
    )
    if not ok:
        hint = _broadcast_hint(name, given, t.shape, target, num_kv_heads)
        raise ValueError(
            f"{name} with shape {given} does not broadcast to (batch, heads, seqlen_q, "
            f"seqlen_k) = {target}; the heads dim may be 1, num_kv_heads={num_kv_heads} or "
            f"num_heads={num_heads}" + (f". {hint}" if hint else "")
        )
    return t


def _broadcast_hint(name: str, given: tuple, padded: tuple, target: tuple, num_kv_heads: int):
    """What to write instead, for the common ways a mask or bias misses the call's shape."""
    batch, num_heads, seqlen_q, seqlen_k = target
    var = name[5:]  # "mask" or "bias"
    if len(given) == 2 and given[0] == batch and given[1] == seqlen_k:
        return (
            f"A (batch, seqlen_k) padding {var} is one row per batch: write "
            f"{name}={var}[:, None, None, :] (shape ({batch}, 1, 1, {seqlen_k}))"
        )
    if len(given) == 3 and given[0] == batch and given[1] in (1, seqlen_q) and given[2] == seqlen_k:
        return (
            f"A (batch, seqlen_q, seqlen_k) {var} is shared by the heads: write "
            f"{name}={var}[:, None] (shape ({batch}, 1, {given[1]}, {seqlen_k}))"
        )
    # Tensors given heads-first, (B, H, L, D), are read here as (B, L=H, H=L, D): the roles of
    # the sequence and head dims swap. If the mask fits that reading, say so.
    bx, hx, qx, kx = padded
    if (bx in (1, batch) and hx in (1, seqlen_q, seqlen_k) and qx in (1, num_heads)
            and kx in (1, num_kv_heads) and (qx, kx) != (1, 1)):
        return _HEADS_FIRST_HINT
    return None


_HEADS_FIRST_HINT = (
    "query, key and value look heads-first, (batch, heads, seqlen, head_dim); flash_dmattn takes "
    "(batch, seqlen, heads, head_dim): pass query.transpose(1, 2), key.transpose(1, 2) and "
    "value.transpose(1, 2), and transpose the output back"
)


def _intervals_on_device(intervals: KeyIntervals, query: torch.Tensor) -> torch.Tensor:
    """The bounds of ``intervals``, which must be on the query's device."""
    if intervals.bounds.device != query.device:
        raise ValueError(
            f"attn_mask (KeyIntervals {intervals.shape}) is on {intervals.bounds.device} but "
            f"query is on {query.device}"
        )
    return intervals.bounds


def check_key_intervals(
    intervals: KeyIntervals, query: torch.Tensor, batch: int, num_heads: int, num_kv_heads: int,
    seqlen_k: int,
) -> torch.Tensor:
    """Check a :class:`KeyIntervals` mask against the call; return its ``(2, Bx, Hx, Lk)``
    int32 bounds (``Bx in {1, B}``, ``Hx in {1, Hkv, H}``)."""
    bounds = _intervals_on_device(intervals, query)
    bx, hx, lk = bounds.shape[1:]
    if bx not in (1, batch) or hx not in (1, num_kv_heads, num_heads) or lk != seqlen_k:
        raise ValueError(
            f"attn_mask (KeyIntervals with start/end of shape {(bx, hx, lk)}) does not "
            f"broadcast to (batch, heads, seqlen_k) = ({batch}, {num_heads}, {seqlen_k}); the "
            f"heads dim may be 1, num_kv_heads={num_kv_heads} or num_heads={num_heads}, and the "
            f"last dim must be seqlen_k"
        )
    return bounds.contiguous()


def _check_cache_seqlens(cache_seqlens, query: torch.Tensor, batch: int, seqlen_k: int):
    """Validate ``cache_seqlens`` (per-batch used length of a KV cache); return it as int32.

    Shape ``(B,)``, int32/int64, on the query's device. Values must lie in ``0..Lk``; they are
    checked only for CPU tensors: reading a CUDA tensor's values would force a device sync on
    every decoding step (and break CUDA-graph capture), which is exactly what a KV-cache
    decoding loop must avoid. On CUDA, out-of-range values are clamped to ``0..Lk`` by the
    kernels (memory-safe, but the result is then unspecified).
    """
    if cache_seqlens is None:
        return None
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be a torch.Tensor of shape (batch,) or None, got "
            f"{type(cache_seqlens).__name__}"
        )
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        # ValueError like cu_seqlens' dtype check (docs/contract.md §3.5: dtype mismatches are ValueError).
        raise ValueError(f"cache_seqlens must be int32 (or int64), got {cache_seqlens.dtype}")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise ValueError(
            f"cache_seqlens must have shape (batch,) = ({batch},), got "
            f"{tuple(cache_seqlens.shape)}"
        )
    if cache_seqlens.device != query.device:
        raise ValueError(
            f"cache_seqlens is on {cache_seqlens.device} but query is on {query.device}"
        )
    if cache_seqlens.device.type == "cpu" and cache_seqlens.numel() and not torch.compiler.is_compiling():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > seqlen_k:
            raise ValueError(
                f"cache_seqlens values must lie in 0..{seqlen_k} (the key/value capacity Lk); "
                f"got min {lo}, max {hi}"
            )
    return cache_seqlens.to(torch.int32).contiguous()


# Page sizes must be multiples of this: the decode kernel's key tiles are 16 wide, and the
# FlashAttention paged-KV convention keeps pages a multiple of the tile size.
PAGE_SIZE_MULTIPLE = 16


def _check_block_table(block_table, query: torch.Tensor, key: torch.Tensor, batch: int):
    """Validate a paged-KV ``block_table``; return it as int32 contiguous.

    ``block_table (B, max_pages_per_seq)`` maps batch ``b``'s logical page ``p`` (keys
    ``p*page_size .. (p+1)*page_size - 1``) to a physical page of the pools ``key``/``value``
    ``(num_pages, page_size, Hkv, D)``. ``page_size`` must be a positive multiple of 16. Page
    ids must lie in ``0..num_pages-1``; like ``cache_seqlens`` they are checked only for CPU
    tensors (no device sync per decoding step); on CUDA the kernel clamps them (memory-safe,
    result unspecified).
    """
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(
            f"block_table must be a torch.Tensor of shape (batch, max_pages_per_seq) or None, "
            f"got {type(block_table).__name__}"
        )
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 (or int64), got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must have shape (batch, max_pages_per_seq) with batch={batch} (from "
            f"query {tuple(query.shape)}), got {tuple(block_table.shape)}"
        )
    if block_table.device != query.device:
        raise ValueError(f"block_table is on {block_table.device} but query is on {query.device}")
    num_pages, page_size = key.shape[0], key.shape[1]
    if page_size < PAGE_SIZE_MULTIPLE or page_size % PAGE_SIZE_MULTIPLE != 0:
        raise ValueError(
            f"with block_table, key/value are page pools (num_pages, page_size, num_kv_heads, "
            f"head_dim) and page_size must be a positive multiple of {PAGE_SIZE_MULTIPLE}; got "
            f"key {tuple(key.shape)} (page_size {page_size})"
        )
    if (block_table.device.type == "cpu" and block_table.numel()
            and not torch.compiler.is_compiling()):
        lo, hi = int(block_table.min()), int(block_table.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(
                f"block_table page ids must lie in 0..{num_pages - 1} (key/value pools hold "
                f"{num_pages} pages); got min {lo}, max {hi}"
            )
    return block_table.to(torch.int32).contiguous()


class _InputsBase:
    """What :class:`AttentionInputs` and :class:`VarlenInputs` read alike off their fields
    (``query``, ``key``, ``value``, ``attn_mask``, ``attn_bias``, ``key_intervals``,
    ``is_causal``): dtype, device, the gradient questions and the start of ``describe``."""

    __slots__ = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def needs_grad(self) -> bool:
        """True when autograd will ask for a gradient of any input."""
        return _needs_grad(self.query, self.key, self.value, self.attn_bias)

    @property
    def bias_needs_grad(self) -> bool:
        return torch.is_grad_enabled() and self.attn_bias is not None and self.attn_bias.requires_grad

    def _describe_aux(self, parts: list) -> list:
        """``parts`` (the call's tensors, described) with the mask, key intervals, bias and
        causal flag appended, as ``describe`` lists them."""
        if self.attn_mask is not None:
            parts.append(f"mask {tuple(self.attn_mask.shape)}")
        if self.key_intervals is not None:
            parts.append(f"key intervals {tuple(self.key_intervals.shape[1:])}")
        if self.attn_bias is not None:
            parts.append(f"bias {tuple(self.attn_bias.shape)}")
        if self.is_causal:
            parts.append("causal")
        return parts


def _heads_error(query: torch.Tensor, key: torch.Tensor, hint: str = "") -> ValueError:
    """The error for query heads that are not a multiple of the key/value heads (heads in
    dim -2 of both), ``hint`` appended after a semicolon."""
    h, hkv = query.shape[-2], key.shape[-2]
    return ValueError(
        f"num_heads={h} (query {tuple(query.shape)}) must be a multiple of "
        f"num_kv_heads={hkv} (key {tuple(key.shape)})" + (f"; {hint}" if hint else "")
    )


@dataclass(frozen=True)
class AttentionInputs(_InputsBase):
    """A validated dense attention call.

    Invariants: ``query (B, Lq, H, D)``, ``key``/``value (B, Lk, Hkv, D)`` with ``H % Hkv == 0``,
    one dtype (fp16/bf16/fp32/fp64) and one device, last dims contiguous. ``attn_mask`` is None or
    a bool 4-D view and ``attn_bias`` None or a float 4-D view (query dtype or fp32), each with
    dims ``(1|B, 1|Hkv|H, 1|Lq, 1|Lk)``; stride-0 dims of the mask (and of a bias that needs no
    gradient) are narrowed to size 1. ``softcap == 0.0`` means off. ``cache_seqlens`` is None
    or an int32 contiguous ``(B,)`` tensor on the query's device: keys ``j >= cache_seqlens[b]``
    are invisible for batch ``b`` and causal alignment is bottom-right against that length
    (values in ``0..Lk``, checked on CPU only, see :func:`_check_cache_seqlens`).

    Paged KV: with ``block_table`` (int32 contiguous ``(B, P)``, see
    :func:`_check_block_table`) ``key``/``value`` are page pools ``(num_pages, page_size, Hkv,
    D)`` and the logical key length is ``Lk = P * page_size``; use :attr:`seqlen_k`,
    :attr:`num_kv_heads` and :attr:`page_size`, never ``key.shape[1]``, for the logical shape.
    Logical key ``j`` of batch ``b`` is ``key[block_table[b, j // page_size], j % page_size]``.

    Attention dropout: ``dropout_p`` in ``[0, 1)``; when it is positive ``dropout_rng`` is the
    call's int64 ``(seed, offset)`` on the query's device, drawn once here from torch's
    generator (:mod:`flash_dmattn.dropout`), else None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    attn_bias: Optional[torch.Tensor]
    softmax_scale: float
    is_causal: bool
    softcap: float
    deterministic: bool
    return_attn_probs: bool
    cache_seqlens: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    key_intervals: Optional[torch.Tensor] = None
    # The KeyIntervals mask's window promise (see KeyIntervals), for the kernels' planning.
    key_window: Optional[int] = None
    # Attention dropout (see flash_dmattn.dropout): the probability, and the call's int64
    # (seed, offset) rng tensor on the query's device (None when dropout_p == 0).
    dropout_p: float = 0.0
    dropout_rng: Optional[torch.Tensor] = None

    @staticmethod
    def from_args(
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
        dropout_p=None,
    ) -> "AttentionInputs":
        paged = block_table is not None
        layout = (
            "4-D (num_pages, page_size, heads, head_dim) page pools with block_table"
            if paged else "4-D (batch, seqlen, heads, head_dim)"
        )
        _check_qkv(query, key, value, layout)
        b, lq, h, d = query.shape
        bk, lk, hkv, dk = key.shape
        if paged:
            block_table = _check_block_table(block_table, query, key, b)
            lk = block_table.shape[1] * key.shape[1]  # logical length: pages per seq * page size
        elif bk != b:
            raise ValueError(
                f"batch size differs: query {tuple(query.shape)} vs key/value {tuple(key.shape)}"
            )
        if dk != d:
            raise ValueError(
                f"head_dim differs: query {tuple(query.shape)} vs key/value {tuple(key.shape)}"
            )
        if hkv == 0 or h % hkv != 0:
            # Heads-first tensors read as (B, L, H, D) have few "positions" (the heads) and
            # many "heads" (the positions), and their real head counts divide.
            heads_first = not paged and 0 < lk < hkv and lq < h and lq % lk == 0
            raise _heads_error(query, key, _HEADS_FIRST_HINT if heads_first else "")
        scale, cap = _scale_and_softcap(softmax_scale, softcap, d)
        intervals = window = None
        if isinstance(attn_mask, KeyIntervals):
            intervals = check_key_intervals(attn_mask, query, b, h, hkv, lk)
            window = attn_mask.window
            attn_mask = None
        mask = bias = None
        if attn_mask is not None or attn_bias is not None:
            dims = dict(query=query, batch=b, num_heads=h, num_kv_heads=hkv, seqlen_q=lq,
                        seqlen_k=lk)
        if attn_mask is not None:
            mask = _collapse_broadcast_dims(normalise_mask_or_bias("attn_mask", attn_mask, **dims))
        if attn_bias is not None:
            bias = normalise_mask_or_bias("attn_bias", attn_bias, **dims)
            if not bias.requires_grad:
                bias = _collapse_broadcast_dims(bias)
        if cache_seqlens is not None:
            cache_seqlens = _check_cache_seqlens(cache_seqlens, query, b, lk)
        p = check_dropout_p(dropout_p)
        return AttentionInputs(
            query=_last_dim_contiguous(query),
            key=_last_dim_contiguous(key),
            value=_last_dim_contiguous(value),
            attn_mask=mask,
            attn_bias=bias,
            softmax_scale=scale,
            is_causal=_flag("is_causal", is_causal),
            softcap=cap,
            deterministic=resolve_deterministic(deterministic),
            return_attn_probs=_flag("return_attn_probs", return_attn_probs),
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            key_intervals=intervals,
            key_window=window,
            dropout_p=p,
            dropout_rng=draw_rng(query.device) if p > 0.0 else None,
        )

    # Shapes -------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def seqlen_q(self) -> int:
        return self.query.shape[1]

    @property
    def seqlen_k(self) -> int:
        """Logical key length: ``Lk``, or ``max_pages_per_seq * page_size`` when paged."""
        if self.block_table is not None:
            return self.block_table.shape[1] * self.key.shape[1]
        return self.key.shape[1]

    @property
    def plain(self) -> bool:
        """No mask, bias, key intervals, KV cache (paged or not), soft cap, attention
        probabilities or dropout: attention of q, k and v alone (registry.run_plain's calls,
        the policy's ``plain`` feature, torch-reference's SDPA route on a GPU)."""
        return (self.attn_mask is None and self.attn_bias is None and self.key_intervals is None
                and self.block_table is None and self.cache_seqlens is None and not self.softcap
                and not self.return_attn_probs and not self.dropout_p)

    @property
    def page_size(self) -> Optional[int]:
        """Keys per page of a paged KV cache (None when K/V are contiguous)."""
        return self.key.shape[1] if self.block_table is not None else None

    @property
    def num_heads(self) -> int:
        return self.query.shape[2]

    @property
    def num_kv_heads(self) -> int:
        # Dim 2 in both layouts: (B, Lk, Hkv, D) and paged pools (num_pages, page_size, Hkv, D).
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[3]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def describe(self) -> str:
        parts = self._describe_aux([f"query {_fmt(self.query)}", f"key {tuple(self.key.shape)}"])
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.cache_seqlens is not None:
            parts.append("cache_seqlens")
        if self.block_table is not None:
            parts.append(
                f"paged KV (block_table {tuple(self.block_table.shape)}, page_size "
                f"{self.page_size}, logical Lk {self.seqlen_k})"
            )
        return ", ".join(parts)


@dataclass(frozen=True)
class VarlenInputs(_InputsBase):
    """A validated packed-sequence call (docs/contract.md §4).

    ``query (total_q, H, D)``, ``key``/``value (total_k, Hkv, D)``; ``cu_seqlens_q/k`` int32
    1-D of equal length ``n + 1`` on the query's device. ``attn_mask`` / ``attn_bias`` are
    None or 2-D views ``(1|Hkv|H, total_k)``: one value per key, shared by every query of
    that key's sequence.

    ``key_intervals`` is None or the int32 contiguous ``(2, Hx, total_k)`` bounds of a
    :class:`~flash_dmattn.masks.KeyIntervals` mask (``Hx in {1, Hkv, H}``; ``attn_mask`` is
    then None): query ``i`` of a sequence of lengths ``(lq, lk)`` sees that sequence's key
    ``j`` iff ``start[j] <= i + lk - lq < end[j]`` (positions are per sequence).
    ``key_window``: that mask's window promise, per sequence (None: none).

    ``dropout_p`` / ``dropout_rng`` as in :class:`AttentionInputs`; the dropout's batch
    coordinate is the sequence index, its rows and keys count from the sequence's start.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    attn_mask: Optional[torch.Tensor]
    attn_bias: Optional[torch.Tensor]
    softmax_scale: float
    is_causal: bool
    softcap: float
    deterministic: bool
    return_attn_probs: bool
    key_intervals: Optional[torch.Tensor] = None
    key_window: Optional[int] = None
    # Attention dropout, as in AttentionInputs; the batch coordinate is the sequence index.
    dropout_p: float = 0.0
    dropout_rng: Optional[torch.Tensor] = None

    @staticmethod
    def from_args(
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
        dropout_p=None,
    ) -> "VarlenInputs":
        _check_qkv(query, key, value, "3-D (total_tokens, heads, head_dim) for varlen")
        _, h, d = query.shape
        total_k, hkv, dk = key.shape
        if dk != d:
            raise ValueError(f"head_dim differs: query {tuple(query.shape)} vs key {tuple(key.shape)}")
        if hkv == 0 or h % hkv != 0:
            raise _heads_error(query, key)
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor):
                raise TypeError(
                    f"{name} must be a 1-D int32 torch.Tensor of n+1 offsets, got "
                    f"{_describe_value(cu)}"
                )
            if cu.dim() != 1 or cu.numel() < 1:
                raise ValueError(f"{name} must be a 1-D tensor of n+1 offsets")
            if cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be int32 (or int64), got {cu.dtype}")
            if cu.device != query.device:
                raise ValueError(f"{name} is on {cu.device} but query is on {query.device}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                f"{cu_seqlens_k.numel()}; both must hold n+1 offsets"
            )
        scale, cap = _scale_and_softcap(softmax_scale, softcap, d)
        intervals = window = None
        if isinstance(attn_mask, KeyIntervals):
            intervals = _check_varlen_key_intervals(attn_mask, query, h, hkv, total_k)
            window = attn_mask.window
            attn_mask = None
        mask = _normalise_varlen_per_key("attn_mask", attn_mask, query, h, hkv, total_k)
        bias = _normalise_varlen_per_key("attn_bias", attn_bias, query, h, hkv, total_k)
        p = check_dropout_p(dropout_p)
        return VarlenInputs(
            query=_last_dim_contiguous(query),
            key=_last_dim_contiguous(key),
            value=_last_dim_contiguous(value),
            cu_seqlens_q=cu_seqlens_q.to(torch.int32),
            cu_seqlens_k=cu_seqlens_k.to(torch.int32),
            max_seqlen_q=_length("max_seqlen_q", max_seqlen_q),
            max_seqlen_k=_length("max_seqlen_k", max_seqlen_k),
            attn_mask=mask,
            attn_bias=bias,
            softmax_scale=scale,
            is_causal=_flag("is_causal", is_causal),
            softcap=cap,
            deterministic=resolve_deterministic(deterministic),
            return_attn_probs=_flag("return_attn_probs", return_attn_probs),
            key_intervals=intervals,
            key_window=window,
            dropout_p=p,
            dropout_rng=draw_rng(query.device) if p > 0.0 else None,
        )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    def describe(self) -> str:
        parts = self._describe_aux([
            f"varlen query {_fmt(self.query)}",
            f"key {tuple(self.key.shape)}",
            f"{self.num_seqs} sequences",
        ])
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        return ", ".join(parts)


def _length(name: str, value) -> int:
    """``value`` as a non-negative int; a ``TypeError`` naming the argument for anything
    ``int()`` cannot read (or a bool, a string)."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be an int, got {_describe_value(value)}")
    try:
        n = int(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be an int, got {_describe_value(value)}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def _normalise_varlen_per_key(name, t, query, h, hkv, total_k):
    if t is None:
        return None
    _check_aux_type(name, t, query)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[0] not in (1, hkv, h) or t.shape[1] != total_k:
        raise ValueError(
            f"varlen {name} must have shape (total_k,), (num_kv_heads, total_k) or "
            f"(num_heads, total_k) = ({total_k},), ({hkv}, {total_k}) or ({h}, {total_k}); "
            f"got {tuple(t.shape)}"
        )
    return t


def _check_varlen_key_intervals(intervals: KeyIntervals, query, h, hkv, total_k) -> torch.Tensor:
    """Check a varlen :class:`KeyIntervals` mask; return its ``(2, Hx, total_k)`` int32 bounds.

    Like a varlen mask it is per key: start/end of shape ``(total_k,)``, ``(Hkv, total_k)`` or
    ``(H, total_k)`` (no batch dim: the sequences are packed along the keys).
    """
    bounds = _intervals_on_device(intervals, query)
    bx, hx, lk = bounds.shape[1:]
    if bx != 1 or hx not in (1, hkv, h) or lk != total_k:
        raise ValueError(
            f"varlen attn_mask (KeyIntervals with start/end of shape {(bx, hx, lk)}) must have "
            f"start/end of shape (total_k,), (num_kv_heads, total_k) or (num_heads, total_k) = "
            f"({total_k},), ({hkv}, {total_k}) or ({h}, {total_k})"
        )
    return bounds[:, 0].contiguous()
