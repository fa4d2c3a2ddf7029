"""A drop-in replacement for ``torch.nn.MultiheadAttention`` that computes through flash_dmattn."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..dropout import dense_keep_mask, draw_rng
from ._common import attention_function, check_backend_name, check_positive_int

__all__ = ["MultiheadAttention"]


def _check_mask_dtype(name: str, mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")


def _split_mask(mask: Optional[torch.Tensor], dtype: torch.dtype):
    """A torch-convention mask -> ``(allowed bool or None, additive float or None)``.

    torch's bool masks mean True = *not* allowed; flash_dmattn's mean True = attend.
    Float masks are additive in both and become the bias (in the query's dtype, as torch
    casts them). ``-inf`` entries stay in the bias: the library supports them and keeping
    them there keeps a float mask that requires grad differentiable.
    """
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return ~mask, None
    return None, mask.to(dtype)


def _and(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    return a if b is None else a & b


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


def _append_key_column(t: Optional[torch.Tensor], count: int) -> Optional[torch.Tensor]:
    """Extend a 4-D mask (attend) or bias (0) by ``count`` always-visible keys."""
    if t is None or count == 0:
        return t
    if t.dtype == torch.bool:
        return F.pad(t, (0, count), value=True)
    return F.pad(t, (0, count), value=0.0)


def _plain_probs(q, k, mask, bias, scale):
    """Differentiable attention probabilities ``(B, H, L, S)`` (weights that need a gradient).

    The library's ``return_attn_probs`` output is a detached testing aid, while torch's
    attention weights carry gradients; so when autograd needs them they are computed here.
    Rows with no visible key give 0 (torch gives NaN there), consistent with the output.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.einsum("blhd,bshd->bhls", q.to(acc), k.to(acc)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p.to(q.dtype)


def _next_dropout_keep(device, batch, heads, query_len, key_len, dropout_p) -> torch.Tensor:
    """Bool ``(B, H, L, S)``: the keep-mask that the next dropout call on ``device`` uses.

    A call draws its rng from the device's default generator; drawing it here on a forked
    generator state (restored on exit) gives the same rng without advancing the generator.
    """
    if device.type == "cpu":
        devices, device_type = [], None
    else:
        index = device.index
        if index is None:
            index = torch.get_device_module(device.type).current_device()
        devices, device_type = [index], device.type
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        rng = draw_rng(device)
    return dense_keep_mask(rng, dropout_p, batch, heads, query_len, key_len)


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` with the same constructor, parameters, state_dict keys
    and forward semantics, computed through flash_dmattn.

    Extra argument: ``backend`` (flash_dmattn backend name, ``None`` = auto-dispatch).

    ``load_state_dict`` from a torch MHA of the same configuration works both ways. Masks
    follow *torch's* conventions: ``key_padding_mask`` ``(B, S)`` (or ``(S,)`` unbatched) bool
    with True = ignore, or float additive; ``attn_mask`` ``(L, S)`` or ``(B * num_heads, L, S)``
    bool with True = NOT allowed, or float additive. ``is_causal`` is a hint as in torch: it
    requires ``attn_mask`` and the mask given is what is applied.

    Paths:

    * ``need_weights=False``: one flash_dmattn call (``backend``).
    * ``need_weights=True`` and a gradient is needed: output through flash_dmattn, weights
      through a differentiable plain-PyTorch softmax (the library's probabilities carry no
      gradient).
    * ``need_weights=True`` and no gradient: one call to the ``torch-reference`` backend with
      ``return_attn_probs=True`` (output and weights together).

    ``add_bias_kv`` / ``add_zero_attn`` are supported exactly as torch does them: one learned
    key/value (``bias_k``/``bias_v``) and/or one all-zero key/value are appended to every
    sequence, always visible (masks are extended with "attend").

    ``dropout`` (training mode only) is the kernels' attention dropout on the probabilities,
    reproducible with ``torch.manual_seed`` but a different random stream from torch's; the
    weights returned are, as torch's, those after dropout (kept entries scaled by
    ``1 / (1 - dropout)``).

    Differences from torch: a query row with no visible key outputs 0 (``out_proj`` bias only
    after projection) and weight 0 where torch gives NaN; no nested-tensor fast path.

    Returns ``(attn_output, attn_weights)``: output ``(L, B, E)`` (``(B, L, E)`` when
    ``batch_first``, ``(L, E)`` unbatched); weights ``(B, L, S)`` averaged over heads or
    ``(B, H, L, S)`` (batch dim dropped when unbatched), or ``None`` if not ``need_weights``.

    Equivalent plain PyTorch (batch-first tensors, bool masks in torch's convention)::

        q, k, v = F.linear(query, Wq, bq), F.linear(key, Wk, bk), F.linear(value, Wv, bv)
        # (+ bias_k / bias_v and zero key/value appended along S, masks padded with "allowed")
        q = q.view(B, L, H, Dh).transpose(1, 2); k = k.view(B, S, H, Dh).transpose(1, 2)
        v = v.view(B, S, H, Dh).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / Dh ** 0.5                        # (B, H, L, S)
        s = s.masked_fill(attn_mask.view(-1, H, L, S) if attn_mask.dim() == 3 else attn_mask,
                          float("-inf"))
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        p = s.softmax(-1)
        if training:
            p = p * keep / (1 - dropout)     # keep: the call's keep-mask (flash_dmattn.testing)
        out = out_proj((p @ v).transpose(1, 2).reshape(B, L, E))
        weights = p.mean(1) if average_attn_weights else p
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
    ) -> None:
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if kdim is not None:
            check_positive_int("kdim", kdim)
        if vdim is not None:
            check_positive_int("vdim", vdim)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.backend = check_backend_name(backend)

        # Parameter names, shapes and registration order mirror torch.nn.MultiheadAttention
        # so that state_dicts load in both directions.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # torch's initialisation, so a fresh module is statistically identical to torch's.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, backend={self.backend!r}"

    # Checks -----------------------------------------------------------------------------------
    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        """Validate shapes/dtypes as torch does (with typed errors); return ``is_batched``."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 3-D (batched) or 2-D (unbatched), got shape {tuple(query.shape)}")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must have the same number of dims, got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != dim:
                raise ValueError(f"{name} last dim must be {dim}, got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must agree in batch and sequence dims, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        is_batched = query.dim() == 3
        if is_batched:
            batch_dim = 0 if self.batch_first else 1
            if key.shape[batch_dim] != query.shape[batch_dim]:
                raise ValueError(f"query and key batch sizes differ: {tuple(query.shape)} vs {tuple(key.shape)}")
        if key_padding_mask is not None:
            _check_mask_dtype("key_padding_mask", key_padding_mask)
        if attn_mask is not None:
            _check_mask_dtype("attn_mask", attn_mask)
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal is a hint that attn_mask is causal and needs attn_mask (as in torch); "
                "e.g. nn.Transformer.generate_square_subsequent_mask(L)"
            )
        return is_batched

    # Forward ----------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        is_batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        # Work batch-first internally: (B, L, E).
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, _ = query.shape
        src_len = key.shape[1]
        heads, head_dim = self.num_heads, self.head_dim

        q, k, v = self._in_projection(query, key, value)
        extra = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(batch, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, self.bias_v.expand(batch, 1, self.embed_dim)], dim=1)
            extra += 1
        elif self.bias_k is not None or self.bias_v is not None:
            raise ValueError("bias_k and bias_v must both be set or both be None")
        q = q.view(batch, tgt_len, heads, head_dim)
        k = k.view(batch, k.shape[1], heads, head_dim)
        v = v.view(batch, v.shape[1], heads, head_dim)
        if self.add_zero_attn:
            # A zero key/value per head, as torch appends after splitting heads.
            zeros = k.new_zeros(batch, 1, heads, head_dim)
            k = torch.cat([k, zeros], dim=1)
            v = torch.cat([v, zeros], dim=1)
            extra += 1

        mask, bias = self._masks(key_padding_mask, attn_mask, batch, tgt_len, src_len, q.dtype, q.device)
        mask = _append_key_column(mask, extra)
        bias = _append_key_column(bias, extra)

        dropout_p = self.dropout if self.training else 0.0
        # The kernels take dropout_p < 1; with 1 every probability is dropped and the attention
        # output is zero (torch's result), so the call runs without dropout and is zeroed.
        drop_all = dropout_p >= 1.0
        call_p = 0.0 if drop_all else dropout_p
        keep = None
        if need_weights and call_p > 0.0:
            # torch returns the weights after dropout: rebuild the keep-mask the call will draw.
            keep = _next_dropout_keep(q.device, batch, heads, tgt_len, k.shape[1], call_p)

        weights = None
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, bias)
        )
        if need_weights and not needs_grad:
            # No gradient needed: the reference backend returns output and probabilities together.
            out, _, weights = attention_function("torch-reference")(
                q, k, v, attn_mask=mask, attn_bias=bias, return_attn_probs=True, dropout_p=call_p
            )
            weights = weights.to(q.dtype)
        else:
            out = attention_function(self.backend)(
                q, k, v, attn_mask=mask, attn_bias=bias, dropout_p=call_p
            )
            if need_weights:
                weights = _plain_probs(q, k, mask, bias, head_dim ** -0.5)
        if keep is not None:
            # The library's probabilities are those before dropout.
            weights = weights * keep / (1.0 - call_p)
        if drop_all:
            out = out * 0.0
            if weights is not None:
                weights = weights * 0.0

        out = self.out_proj(out.reshape(batch, tgt_len, self.embed_dim))
        if need_weights and average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            return out.squeeze(0), (None if weights is None else weights.squeeze(0))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _in_projection(self, query, key, value):
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _masks(self, key_padding_mask, attn_mask, batch, tgt_len, src_len, dtype, device):
        """torch-convention masks -> flash_dmattn ``(attn_mask bool 4-D, attn_bias float 4-D)``."""
        mask = bias = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, src_len):
                raise ValueError(
                    f"key_padding_mask must be (batch, src_len) = {(batch, src_len)}, "
                    f"got shape {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.device != device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but query is on {device}")
            allowed, additive = _split_mask(key_padding_mask.view(batch, 1, 1, src_len), dtype)
            mask, bias = _and(mask, allowed), _add(bias, additive)
        if attn_mask is not None:
            if attn_mask.device != device:
                raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {device}")
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (tgt_len, src_len):
                    raise ValueError(
                        f"2-D attn_mask must be (L, S) = {(tgt_len, src_len)}, got {tuple(attn_mask.shape)}"
                    )
                am = attn_mask.view(1, 1, tgt_len, src_len)
            elif attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (batch * self.num_heads, tgt_len, src_len):
                    raise ValueError(
                        f"3-D attn_mask must be (batch * num_heads, L, S) = "
                        f"{(batch * self.num_heads, tgt_len, src_len)}, got {tuple(attn_mask.shape)}"
                    )
                # torch's row b * num_heads + h is batch b, head h.
                am = attn_mask.view(batch, self.num_heads, tgt_len, src_len)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got shape {tuple(attn_mask.shape)}")
            allowed, additive = _split_mask(am, dtype)
            mask, bias = _and(mask, allowed), _add(bias, additive)
        return mask, bias
