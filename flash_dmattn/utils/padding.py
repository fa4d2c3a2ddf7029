"""Variable-length ("varlen") helpers: pack padded batches into one token stream and back.

Packed layout: the real tokens of batch row 0 (in position order), then row 1, ...;
``cu_seqlens[b]:cu_seqlens[b + 1]`` is the slice holding row ``b``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Tuple, Union

import torch

__all__ = ["unpad_input", "pad_input", "cu_seqlens_from_lengths", "unpad_indices", "gather_tokens"]

_INT32_MAX = torch.iinfo(torch.int32).max


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value.__class__.__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def cu_seqlens_from_lengths(lengths: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
    """Cumulative sequence offsets ``[0, l0, l0 + l1, ...]`` as int32 of shape ``(n + 1,)``.

    Args:
        lengths: 1-D integer tensor (or sequence of ints) of non-negative lengths.

    Returns:
        int32 tensor on ``lengths``' device.

    Equivalent plain PyTorch::

        torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    """
    if not isinstance(lengths, torch.Tensor):
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise TypeError(f"lengths must be a tensor or a sequence of ints, got {lengths.__class__.__name__}")
        if any(isinstance(x, bool) or not isinstance(x, int) for x in lengths):
            raise TypeError("lengths must contain only ints")
        lengths = torch.tensor(list(lengths), dtype=torch.int64)
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    # Sum in int64 so an int32 overflow is detected instead of wrapping silently.
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=cu[1:])
    if lengths.numel() > 0:
        if bool((lengths < 0).any()):
            raise ValueError("lengths must be non-negative")
        if int(cu[-1]) > _INT32_MAX:
            raise ValueError(f"total length {int(cu[-1])} does not fit in int32")
    return cu.to(torch.int32)


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Drop padding tokens, packing the real ones into a single leading dim.

    Args:
        hidden_states: ``(B, L, ...)``.
        attention_mask: ``(B, L)`` bool or integer; True / non-zero marks a real token.
            Padding may be on the left, the right, or anywhere.

    Returns:
        ``(hidden_unpadded, indices, cu_seqlens, max_seqlen, seqused)``:
        ``hidden_unpadded`` ``(total, ...)``; ``indices`` ``(total,)`` int64 positions in
        the flattened ``(B * L)`` batch; ``cu_seqlens`` ``(B + 1,)`` int32;
        ``max_seqlen`` a Python int; ``seqused`` ``(B,)`` int32 tokens per row.
        Differentiable w.r.t. ``hidden_states``.

    Equivalent plain PyTorch (the first four as :func:`unpad_indices` computes them)::

        indices, cu_seqlens, max_seqlen, seqused = unpad_indices(attention_mask)
        hidden_unpadded = hidden_states.flatten(0, 1)[indices]
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {hidden_states.__class__.__name__}")
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {attention_mask.__class__.__name__}")
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be (B, L, ...), got shape {tuple(hidden_states.shape)}")
    if attention_mask.dim() == 2 and attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must be (B, L) = {tuple(hidden_states.shape[:2])}"
        )
    if attention_mask.device != hidden_states.device:
        raise ValueError(
            f"attention_mask is on {attention_mask.device} but hidden_states is on {hidden_states.device}"
        )
    indices, cu_seqlens, max_seqlen, seqused = unpad_indices(attention_mask)
    # index_select's backward is an index_add, so gradients reach hidden_states.
    hidden_unpadded = hidden_states.flatten(0, 1).index_select(0, indices)
    return hidden_unpadded, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_unpadded: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: scatter packed tokens back into ``(B, L, ...)``.

    Positions not listed in ``indices`` are zero. Differentiable w.r.t.
    ``hidden_unpadded``.

    Equivalent plain PyTorch::

        out = hidden_unpadded.new_zeros(batch * seqlen, *hidden_unpadded.shape[1:])
        out[indices] = hidden_unpadded
        out = out.view(batch, seqlen, *hidden_unpadded.shape[1:])
    """
    if not isinstance(hidden_unpadded, torch.Tensor):
        raise TypeError(f"hidden_unpadded must be a torch.Tensor, got {hidden_unpadded.__class__.__name__}")
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {indices.__class__.__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be an int64 or int32 tensor, got dtype {indices.dtype}")
    _check_count("batch", batch)
    _check_count("seqlen", seqlen)
    if hidden_unpadded.dim() < 1:
        raise ValueError("hidden_unpadded must have a leading token dim")
    if indices.dim() != 1 or indices.shape[0] != hidden_unpadded.shape[0]:
        raise ValueError(
            f"indices shape {tuple(indices.shape)} must be ({hidden_unpadded.shape[0]},) "
            f"to match hidden_unpadded shape {tuple(hidden_unpadded.shape)}"
        )
    rest = hidden_unpadded.shape[1:]
    out = hidden_unpadded.new_zeros(batch * seqlen, *rest)
    # Out-of-place index_copy keeps autograd happy (its backward is an index_select) and
    # raises on indices outside [0, batch * seqlen).
    out = out.index_copy(0, indices.to(torch.int64), hidden_unpadded)
    return out.view(batch, seqlen, *rest)


def unpad_indices(attention_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The packing metadata of :func:`unpad_input`, without touching any hidden states.

    Computed once per padding mask and reused for every tensor packed with it (queries,
    keys, values of every layer), which is what the transformers integration does.

    Args:
        attention_mask: ``(B, L)`` bool or integer; True / non-zero marks a real token.

    Returns:
        ``(indices, cu_seqlens, max_seqlen, seqused)`` exactly as :func:`unpad_input` returns
        them: ``indices`` ``(total,)`` int64 into the flattened ``(B * L)`` batch,
        ``cu_seqlens`` ``(B + 1,)`` int32, ``max_seqlen`` a Python int, ``seqused`` ``(B,)``
        int32.

    Equivalent plain PyTorch::

        m = attention_mask.bool()
        seqused = m.sum(-1, dtype=torch.int32)
        indices = m.flatten().nonzero().flatten()
        cu_seqlens = torch.nn.functional.pad(seqused.cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen = int(seqused.max())
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {attention_mask.__class__.__name__}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(
            f"attention_mask must be bool or integer, got dtype {attention_mask.dtype}; use `.bool()`"
        )
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, L), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    seqused = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = cu_seqlens_from_lengths(seqused)
    max_seqlen = int(seqused.max()) if seqused.numel() > 0 else 0
    return indices, cu_seqlens, max_seqlen, seqused


def gather_tokens(hidden_states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``hidden_states`` ``(B, L, ...)`` flattened to ``(B * L, ...)``.

    Unlike ``hidden_states.flatten(0, 1)[indices]`` this never copies the whole tensor when
    its first two dims cannot be merged into a view, e.g. the ``(B, L, H, D)`` view
    ``q.transpose(1, 2)`` of a heads-first ``(B, H, L, D)`` tensor: only the selected rows
    are read. Differentiable w.r.t. ``hidden_states``.

    Args:
        hidden_states: ``(B, L, ...)``, any strides.
        indices: ``(total,)`` int64 / int32 positions in ``[0, B * L)`` (as returned by
            :func:`unpad_input` / :func:`unpad_indices`).

    Returns:
        ``(total, ...)``, a new tensor.

    Equivalent plain PyTorch::

        hidden_states.reshape(B * L, *hidden_states.shape[2:])[indices]
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {hidden_states.__class__.__name__}")
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {indices.__class__.__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be an int64 or int32 tensor, got dtype {indices.dtype}")
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be (B, L, ...), got shape {tuple(hidden_states.shape)}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    batch, seqlen = hidden_states.shape[:2]
    if hidden_states.stride(0) == seqlen * hidden_states.stride(1) or batch == 1:
        # The first two dims merge into a view: one index_select, no copy of the rest.
        flat = hidden_states.flatten(0, 1)
        return flat.index_select(0, indices.to(torch.int64))
    # Two-index gather reads the selected rows through the original strides.
    idx = indices.to(torch.int64)
    return hidden_states[idx // seqlen, idx % seqlen]
