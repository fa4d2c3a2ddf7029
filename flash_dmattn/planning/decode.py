"""Decode planning shared by the triton and cuda decode kernels: how many rows a call packs, how
many key splits it runs, which ``cache_seqlens`` / paged-KV calls the kernels can take, and the
mask a decode call's backward runs with.

The decode kernels pack the ``G = H / Hkv`` query heads of a GQA group and all ``Lq`` queries
into one tile of at most :data:`DECODE_MAX_ROWS` rows and split the key range across
:func:`choose_num_splits` programs per (batch, kv head). Their backward is the main backward
kernels' with the cache folded into the mask (:func:`fold_cache_seqlens`).
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch

from ..intmath import cdiv

# Rows of the packed (query head, query) tile: 64 keeps the fp32 accumulator of a 128-dim head
# at 64 registers a thread with 4 warps. Beyond it the main kernel's 128-row tiles fit better.
DECODE_MAX_ROWS = 64
# Below this many keys one program per (batch, head) of the main kernel is already short, and
# splitting buys nothing; calls with cache_seqlens use the decode kernel at any length.
DECODE_MIN_SEQLEN_K = 128
# Split-count bounds: at most this many splits (the combine reads one partial per split), and
# at least this many keys per split so a split amortises its q load and partial write. Short
# caches decode faster with short splits while the programs still fit one wave, so the floor
# is one 128-key tile (benchmarks/results/nvidia-h200/SUMMARY.md, decode rows).
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 128


def decode_rows(seqlen_q: int, num_heads: int, num_kv_heads: int) -> int:
    """Rows of the packed tile: query heads per kv head times queries."""
    return (num_heads // max(num_kv_heads, 1)) * seqlen_q


def _folded_mask_shape(mask_shape, batch: int, seqlen_q: int, seqlen_k: int, is_causal: bool):
    """Shape of ``mask & cache-visibility`` (see :func:`fold_cache_seqlens`), nothing allocated."""
    vis = (batch, 1, seqlen_q if is_causal and seqlen_q > 1 else 1, seqlen_k)
    if mask_shape is None:
        return vis
    return tuple(torch.broadcast_shapes(tuple(mask_shape), vis))


def cache_seqlens_reasons(inputs) -> List[str]:
    """Why the triton backend (or the cuda one: its decode kernel has the same limits) cannot
    run these inputs' ``cache_seqlens`` (empty: it can).

    The forward needs the decode kernel (the main kernels read one key length for all
    batches). Gradients reuse the main backward with the cache folded into the mask, which
    is allowed only while that mask stays small: at most ``max(mask.numel(), B * Lq * Lk)``
    bools, where ``Lq <= DECODE_MAX_ROWS`` (so ``O(B * Lk)``, far below the size of K itself).
    """
    if inputs.cache_seqlens is None:
        return []
    rows = decode_rows(inputs.seqlen_q, inputs.num_heads, inputs.num_kv_heads)
    if rows > DECODE_MAX_ROWS:
        return [
            f"cache_seqlens needs the decode kernel, which takes Lq * (H / Hkv) <= "
            f"{DECODE_MAX_ROWS} rows; got {inputs.seqlen_q} * {inputs.group_size} = {rows} "
            f"(use torch-reference or flex)"
        ]
    if inputs.needs_grad:
        mask = inputs.attn_mask
        shape = _folded_mask_shape(
            None if mask is None else mask.shape, inputs.batch, inputs.seqlen_q, inputs.seqlen_k,
            inputs.is_causal,
        )
        limit = max(0 if mask is None else mask.numel(),
                    inputs.batch * inputs.seqlen_q * inputs.seqlen_k)
        if _numel(shape) > limit:
            return [
                f"gradients with cache_seqlens fold the cache into the mask, which would grow "
                f"to {shape} (more than max(mask size, B*Lq*Lk)); use torch-reference or flex"
            ]
    return []


def block_table_reasons(inputs, backend: str = "triton") -> List[str]:
    """Why ``backend`` (triton, or cuda, whose decode kernel has the same limits) cannot run
    these inputs' paged KV (``block_table``; empty: it can).

    Only the decode kernel reads pages, and only forwards: the main forward and backward
    kernels take contiguous ``(B, Lk, Hkv, D)`` K/V.
    """
    if inputs.block_table is None:
        return []
    reasons = []
    rows = decode_rows(inputs.seqlen_q, inputs.num_heads, inputs.num_kv_heads)
    if rows > DECODE_MAX_ROWS:
        reasons.append(
            f"paged KV (block_table) needs the decode kernel, which takes Lq * (H / Hkv) <= "
            f"{DECODE_MAX_ROWS} rows; got {inputs.seqlen_q} * {inputs.group_size} = {rows} "
            f"(use torch-reference)"
        )
    if inputs.needs_grad:
        reasons.append(
            f"paged KV (block_table) is forward-only in {backend} (the backward kernels need "
            f"contiguous K/V); use torch-reference for gradients, or run under torch.no_grad()"
        )
    return reasons


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def fold_cache_seqlens(mask: Optional[torch.Tensor], cache_seqlens: torch.Tensor, seqlen_q: int,
                       seqlen_k: int, is_causal: bool) -> torch.Tensor:
    """``mask`` combined with the KV-cache visibility, for the (non-decode) backward kernels.

    Returns a bool mask to use with ``is_causal=False``: ``(B, 1, 1, Lk)`` keys ``j < n[b]``, or
    with ``is_causal`` ``(B, 1, Lq, Lk)`` keys ``j <= i + n[b] - Lq`` (which implies ``j < n[b]``),
    and'ed with ``mask`` (broadcast, never per head unless ``mask`` is). Size: see
    :func:`cache_seqlens_reasons`. Equivalent to the visibility the decode kernel applies.
    """
    batch = cache_seqlens.shape[0]
    n = cache_seqlens.to(torch.int64).clamp(0, seqlen_k).view(batch, 1, 1, 1)
    j = torch.arange(seqlen_k, device=cache_seqlens.device)
    if is_causal:
        i = torch.arange(seqlen_q, device=cache_seqlens.device).view(seqlen_q, 1)
        vis = j <= i + (n - seqlen_q)
    else:
        vis = j < n
    return vis if mask is None else mask & vis


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when it has no index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(idx)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, seqlen_k: int, device: torch.device,
                      per_sm: int = 4) -> int:
    """Key splits per (batch, kv head); ``per_sm``: how many programs of the kernel an SM holds
    (four for the triton decode kernel's ``decode_config`` tiles; the cuda decode kernel passes
    its own).

    On a GPU: as many programs as fit four per SM, not more (``B * Hkv`` alone rarely fills
    one wave when decoding), but at least ``MIN_KEYS_PER_SPLIT`` keys each and at most
    ``MAX_SPLITS``.
    With the triton decode kernel's fixed launch config (``decode_config``) this count is the
    best, or within a few percent of it, against half and twice the count on every decode row
    of the benchmark, with and without a mask (the decode suite of
    ``benchmarks/results/<gpu>/SUMMARY.md``). With ``cache_seqlens`` the count is chosen from the capacity ``Lk`` (the used
    lengths live on the device) and each batch's used keys are divided among its splits in the
    kernel. Under the CPU interpreter: a few splits, so the combine step is always exercised.
    """
    if seqlen_k <= 0:
        return 1
    if device.type != "cuda":
        return max(1, min(3, cdiv(seqlen_k, 16)))
    # Rounded down: programs past one wave of four per SM (the residency of the decode_config
    # tiles) run as a second, nearly empty wave, which costs far more than the split saves
    # (the decode suite, benchmarks/results/<gpu>/SUMMARY.md).
    want = max(1, (per_sm * sm_count(device)) // max(1, batch * num_kv_heads))
    cap = max(1, min(MAX_SPLITS, cdiv(seqlen_k, MIN_KEYS_PER_SPLIT)))
    return max(1, min(want, cap))
