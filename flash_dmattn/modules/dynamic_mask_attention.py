"""A self-attention layer with Dynamic Mask Attention (DMA): a learned, value-dependent
per-key bias that is added to the scores and, for long sequences, selects the keys each
query attends to."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..masks import KeyIntervals
from ..planning.selection import topk_intervals
from ..utils.dynamic import dynamic_mask_bias
from ._common import attention_function, check_backend_name, check_positive_int

__all__ = ["DynamicMaskAttention", "apply_rotary_pos_emb", "rotate_half"]

# Initial value of every entry of ``A``. Not zero: with ``A == 0`` the bias is the constant 1,
# which (a) leaves ``dt_proj`` without gradient until ``A`` has moved (d bias / d dt is
# proportional to A), and (b) makes every key tie in the top-k selection, which then keeps
# the *earliest* keys of long sequences. A small negative value keeps the layer close to
# plain attention at initialisation (the bias varies little across keys) while the key
# selection already depends on the values and every parameter receives gradient.
A_INIT = -0.1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotary helper: ``cat(-x2, x1)`` where ``x1, x2`` are the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding for ``q (B, L, H, D)`` and ``k (B, L, Hkv, D)``.

    ``cos``/``sin`` are ``(B, L, D)`` or ``(L, D)`` (Llama's layout: the frequencies repeated
    over both halves). Equivalent plain PyTorch::

        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)   # broadcast over heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    """
    # The head dim sits between L and D in this layout, so the tables get a size-1 head dim.
    cos = cos.unsqueeze(-2).to(q.dtype)
    sin = sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class DynamicMaskAttention(nn.Module):
    """Multi-head (GQA/MQA) self-attention with a Dynamic Mask Attention bias and key selection.

    Args:
        hidden_size: model width ``E`` (input and output feature size).
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H % Hkv == 0``.
        head_dim: ``D`` (default ``E // H``, which then must divide exactly).
        window_size: keys kept per query when the sequence is longer than this; shorter
            sequences attend to every (visible, non-padded) key.
        is_causal: causal self-attention.
        bias: bias flag of the q/k/v/o projections and of ``dt_proj``.
        backend: flash_dmattn backend name, or ``None`` for per-call auto-dispatch.
        dropout: attention dropout probability in ``[0, 1)``, applied by the kernel to the
            normalised probabilities in training mode only (as ``nn.MultiheadAttention``);
            ``torch.manual_seed`` reproduces it.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``), ``dt_proj``
    (``nn.Linear(Hkv * D, Hkv)``) and ``A`` (``(Hkv,)``, initialised to ``A_INIT = -0.1``; see
    the comment at ``A_INIT`` for why not zero).

    ``forward(hidden_states (B, L, E), attention_mask=None, position_embeddings=None)``
    returns ``(B, L, E)``. ``attention_mask`` is a ``(B, L)`` bool/int padding mask (1 / True
    = real token); padded keys are never attended to and never take a window slot.
    ``position_embeddings`` is an optional ``(cos, sin)`` pair, each ``(B, L, D)`` or
    ``(L, D)``, applied to q and k as in Llama. Rows with no visible key (e.g. a left-padded
    query under causal attention) output ``o_proj(0)``.

    The mask memory: for ``L > window_size`` the key selection is handed to the kernel as a
    :class:`~flash_dmattn.masks.KeyIntervals` mask (two int32 per key and kv head, built by
    :func:`~flash_dmattn.planning.selection.topk_intervals` in O(L log L)): with ``is_causal``
    each query keeps the ``window_size`` best keys it can see (key ``j`` is kept by the
    queries ``j .. t_j - 1``), otherwise every query keeps the same ``window_size`` keys. No
    ``(L, L)`` mask is ever built; for shorter sequences the mask is at most the
    ``(B, 1, 1, L)`` padding mask.

    Equivalent plain PyTorch::

        q = self.q_proj(x).view(B, L, H, D)
        k = self.k_proj(x).view(B, L, Hkv, D)
        v = self.v_proj(x).view(B, L, Hkv, D)
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        dt = self.dt_proj(v.reshape(B, L, Hkv * D))                     # (B, L, Hkv)
        bias = torch.exp(self.A * F.softplus(dt)).transpose(1, 2)[:, :, None, :]  # (B, Hkv, 1, L)
        i, j = torch.arange(L)[:, None], torch.arange(L)
        allowed = (j <= i) if is_causal else torch.ones(L, L, dtype=torch.bool)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]   # (B, 1, L, L)
        if L > window_size:
            score = bias.detach().masked_fill(~allowed, float("-inf"))
            top = score.sort(dim=-1, descending=True, stable=True).indices[..., :window_size]
            allowed = allowed & torch.zeros_like(score, dtype=torch.bool).scatter(-1, top, True)
        g = H // Hkv
        k, v = (einops.repeat(t, "b j hkv d -> b j (hkv g) d", g=g) for t in (k, v))
        bias, allowed = (einops.repeat(t, "b hkv i j -> b (hkv g) i j", g=g)
                         for t in (bias, allowed.expand(B, Hkv, L, L)))
        s = torch.einsum("bihd,bjhd->bhij", q, k) / D ** 0.5 + bias
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)                        # empty rows -> 0
        if self.training:
            p = p * keep / (1 - dropout)     # keep: the call's keep-mask (flash_dmattn.testing)
        out = torch.einsum("bhij,bjhd->bihd", p, v)
        return self.o_proj(out.reshape(B, L, H * D))
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        window_size: int = 2048,
        is_causal: bool = True,
        bias: bool = False,
        backend: Optional[str] = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); "
                    f"pass head_dim explicitly"
                )
            head_dim = hidden_size // num_heads
        else:
            check_positive_int("head_dim", head_dim)
        if head_dim % 2 != 0:
            # rotate_half splits the head dim in two halves.
            raise ValueError(f"head_dim must be even (rotary embeddings split it in halves), got {head_dim}")
        check_positive_int("window_size", window_size)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window_size = window_size
        self.is_causal = is_causal
        self.dropout = float(dropout)
        self.backend = check_backend_name(backend)

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        # The same bias flag as the projections (as in the Doge models that introduced DMA).
        self.dt_proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, bias=bias)
        self.A = nn.Parameter(torch.full((num_kv_heads,), A_INIT))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window_size={self.window_size}, is_causal={self.is_causal}, dropout={self.dropout}, "
            f"backend={self.backend!r}"
        )

    # Input checks ---------------------------------------------------------------------------
    def _check_hidden(self, hidden_states) -> None:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be (batch, seq_len, hidden_size={self.hidden_size}), "
                f"got shape {tuple(hidden_states.shape)}"
            )

    @staticmethod
    def _padding_mask(attention_mask, batch: int, length: int, device) -> Optional[torch.Tensor]:
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.dtype != torch.bool and attention_mask.is_floating_point():
            # A float mask is ambiguous (0/1 keep flags or an additive 0/-inf mask).
            raise TypeError(
                f"attention_mask must be bool or integer (1 = real token), got {attention_mask.dtype}"
            )
        if attention_mask.dtype != torch.bool and attention_mask.is_complex():
            raise TypeError(f"attention_mask must be bool or integer, got {attention_mask.dtype}")
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(
                f"attention_mask must be a (batch, seq_len) = {(batch, length)} padding mask, "
                f"got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but hidden_states is on {device}")
        return attention_mask.bool()

    def _rotary_tables(self, position_embeddings, batch: int, length: int, device):
        if not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
            raise TypeError("position_embeddings must be a (cos, sin) pair of tensors")
        cos, sin = position_embeddings
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"position_embeddings {name} must be a floating-point tensor")
            if tuple(t.shape) not in ((batch, length, self.head_dim), (length, self.head_dim)):
                raise ValueError(
                    f"position_embeddings {name} must be (batch, seq_len, head_dim) = "
                    f"{(batch, length, self.head_dim)} or (seq_len, head_dim) = {(length, self.head_dim)}, "
                    f"got shape {tuple(t.shape)}"
                )
            if t.device != device:
                raise ValueError(f"position_embeddings {name} is on {t.device} but hidden_states is on {device}")
        return cos, sin

    # Mask -------------------------------------------------------------------------------------
    def _key_mask(
        self, bias: torch.Tensor, padding: Optional[torch.Tensor]
    ) -> Optional[Union[torch.Tensor, KeyIntervals]]:
        """The mask handed to the kernel: None, the bool padding mask, or the key intervals of
        the top-``window_size`` selection."""
        batch, _, _, length = bias.shape
        if length <= self.window_size:
            # Every candidate fits in the window; causality is left to the kernel's is_causal.
            return None if padding is None else padding.view(batch, 1, 1, length)
        # Causal: the window is filled from the keys each query can see (otherwise slots go
        # to future keys that the kernel then masks, and early queries could be left with no
        # key at all). The bias is per key, so each key is kept by one interval of queries;
        # the intervals give exactly the dense top-k masks (create_mask / causal_topk_mask)
        # in O(L) memory. Not causal: one shared selection, every query sees the kept keys.
        return topk_intervals(bias, self.window_size, is_causal=self.is_causal, padding_mask=padding)

    # Forward ------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        self._check_hidden(hidden_states)
        batch, length, _ = hidden_states.shape
        padding = self._padding_mask(attention_mask, batch, length, hidden_states.device)

        q = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        if position_embeddings is not None:
            cos, sin = self._rotary_tables(position_embeddings, batch, length, hidden_states.device)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)

        # (B, Hkv, 1, L), differentiable w.r.t. v, dt_proj and A; the mask uses it detached.
        bias = dynamic_mask_bias(v, self.dt_proj, self.A)
        mask = self._key_mask(bias, padding)
        out = attention_function(self.backend)(
            q, k, v, attn_mask=mask, attn_bias=bias, is_causal=self.is_causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))
