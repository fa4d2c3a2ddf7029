"""Exact top-W key selections of a per-key bias, as key intervals.

Dynamic Mask Attention keeps, for every query, the ``W`` keys with the largest bias. When the
bias is per key (shape ``(B, H, 1, L)``, as the DMA bias is), every query ranks the keys the
same way, so the queries that keep a given key form one interval of query positions, and the
selection is a :class:`~flash_dmattn.masks.KeyIntervals` mask: two integers per key instead
of an ``(L, L)`` bool mask.

* Not causal: one shared top-W over all candidate keys; a kept key is seen by every query.
* Causal (query ``i`` keeps the W best candidates among keys ``0..i``): key ``j`` is kept by
  queries ``j .. t_j - 1`` where ``t_j`` is the position of the W-th candidate (in position
  order) that outranks ``j`` ("outranks" = larger bias, or the same bias and a lower index).

Computing ``t_j`` for every key
-------------------------------
Sort the keys once by rank (a stable descending sort of the bias; non-candidates last) and let
``P`` be the key positions in rank order. The keys that outrank ``j`` are ``P[0 : rank_j]``,
so ``t_j`` is the W-th smallest value of a prefix of ``P``. :func:`kth_smallest_of_prefixes`
answers such queries for all keys at once with a radix wavelet tree over ``P``: level by
level (``_RADIX_BITS`` bits of the position at a time, most significant first) each query
walks down to the child block of positions that holds its answer, using per-level prefix
counts of each child digit. Since ``P`` is a permutation of ``0..L-1``, every block of
positions is full except the last, which makes each node's start a closed form; a level is a
handful of vectorised ops over all ``(batch, head)`` rows, with no data-dependent shapes and
no host synchronisation. Work O(L · R · log_R L) and memory O(L · R) per row (R = 16), never
anything of size (L, L) or (L, L / C).

On CUDA (and on CPU under ``TRITON_INTERPRET=1``) the causal selection runs the same tree as
Triton kernels (:mod:`~flash_dmattn.planning.selection_kernels`): a handful of launches instead
of a few hundred small torch ops; this module's torch code stays the CPU fallback and the
tests' reference. ``tools/selection_probe.py`` times the call on a GPU (device and host time,
launches, a profiler table).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import KeyIntervals

__all__ = ["topk_intervals", "kth_smallest_of_prefixes"]

# Bits of the key position resolved per wavelet level: R = 2 ** _RADIX_BITS children per node.
# Larger radices mean fewer levels (fewer kernel launches: 4 levels for L = 32K) at the cost
# of R counters per key and level.
_RADIX_BITS = 4

# "Before every query" / "after every query" bounds of a key that every query sees; the same
# clamp value as KeyIntervals uses, so the bounds survive its int32 normalisation unchanged.
_ALWAYS = 1 << 30


_KERNELS = None


def _import_kernels():
    """The kernels' module, imported on the first call that may use it (it imports triton),
    then kept (no import machinery on every call)."""
    global _KERNELS
    from . import selection_kernels

    _KERNELS = selection_kernels
    return selection_kernels


def _check_window(window_size) -> int:
    # bool is a subclass of int; accepting True as a window of 1 would hide caller bugs.
    if isinstance(window_size, bool) or not isinstance(window_size, int):
        raise TypeError(f"window_size must be an int, got {type(window_size).__name__}")
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    return window_size


def _check_inputs(attention_bias, window_size, is_causal, padding_mask, min_dtype):
    """Validate the arguments; return ``(padding (B|1, L) or None, min_dtype)``.

    Takes no view of the bias (host time: the kernels read the ``(B, H, 1, L)`` bias through
    its strides; the plain path slices it itself)."""
    _check_window(window_size)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(attention_bias, torch.Tensor):
        raise TypeError(f"attention_bias must be a torch.Tensor, got {type(attention_bias).__name__}")
    if not attention_bias.is_floating_point():
        raise TypeError(
            f"attention_bias must be a floating-point tensor, got dtype {attention_bias.dtype}"
        )
    if attention_bias.dim() != 4 or attention_bias.shape[2] != 1:
        hint = ""
        if attention_bias.dim() == 4:
            hint = (": a per-query bias has no key-interval form; select with "
                    "create_mask(bias, window_size=W) (a dense mask), or pass one row per key "
                    "such as bias[:, :, -1:, :]")
        elif attention_bias.dim() == 3:
            hint = ": for a (batch, heads, L) bias pass bias[:, :, None, :]"
        raise ValueError(
            f"attention_bias must be a per-key bias of shape (batch, heads, 1, L), got shape "
            f"{tuple(attention_bias.shape)}{hint}"
        )
    batch, _, _, length = attention_bias.shape
    if padding_mask is not None:
        if not isinstance(padding_mask, torch.Tensor):
            raise TypeError(
                f"padding_mask must be a bool torch.Tensor or None, got {type(padding_mask).__name__}"
            )
        if padding_mask.dtype != torch.bool:
            raise TypeError(
                f"padding_mask must be a bool tensor (True = real token), got dtype {padding_mask.dtype}"
            )
        if padding_mask.dim() != 2 or padding_mask.shape[1] != length or (
            padding_mask.shape[0] not in (1, batch) and batch != 1
        ):
            raise ValueError(
                f"padding_mask must have shape (batch, L) = ({batch}, {length}), got "
                f"{tuple(padding_mask.shape)}"
            )
        if padding_mask.device != attention_bias.device:
            raise ValueError(
                f"padding_mask is on {padding_mask.device} but attention_bias is on "
                f"{attention_bias.device}"
            )
    return padding_mask, resolve_min_dtype(min_dtype, attention_bias.dtype)


def resolve_min_dtype(min_dtype, dtype: torch.dtype) -> float:
    """The bias value that marks a key as never selectable: ``min_dtype`` as a float (a number
    or a one-element tensor), or the lowest finite value of ``dtype`` when it is None."""
    if min_dtype is None:
        return torch.finfo(dtype).min
    if isinstance(min_dtype, torch.Tensor):
        if min_dtype.numel() != 1:
            raise ValueError(f"min_dtype must be a scalar, got a tensor of shape {tuple(min_dtype.shape)}")
        return float(min_dtype)
    if isinstance(min_dtype, bool) or not isinstance(min_dtype, (int, float)):
        raise TypeError(f"min_dtype must be a float or None, got {min_dtype.__class__.__name__}")
    return min_dtype


def kth_smallest_of_prefixes(perm: torch.Tensor, prefix_len: torch.Tensor, k: int) -> torch.Tensor:
    """For every query ``q``: the ``k``-th smallest value of ``perm[n, :prefix_len[n, q]]``.

    Args:
        perm: int64 ``(N, L)``; every row a permutation of ``0..L-1``.
        prefix_len: int64 ``(N, Q)``, every entry in ``k..L``.
        k: ``1 <= k <= L`` (1 = the smallest).

    Returns int64 ``(N, Q)``. Equivalent plain PyTorch (O(N·Q·L))::

        out = torch.empty_like(prefix_len)
        for n in range(N):
            for q in range(Q):
                out[n, q] = perm[n, :prefix_len[n, q]].sort().values[k - 1]

    How: a wavelet tree over positions in radix ``R = 2 ** _RADIX_BITS``. At the level of child
    size ``s``, ``seq`` lists the values block by block (blocks of ``R * s`` consecutive values,
    in value order) and, inside a block, in the order they have in ``perm``. A query sits in
    block ``[a, a + R*s)`` and knows ``m``, how many of the block's values lie in its prefix —
    they are the block's first ``m`` entries of ``seq``. Per-digit prefix counts over ``seq``
    say how many of those fall into each child; the query moves to the child holding its
    ``k``-th value. Blocks before ``a`` are full, so each has exactly ``s`` values per child and
    the counts before ``a`` are ``a / R`` per digit (closed form, no second lookup). ``seq`` of
    the next level is a stable partition of each block by digit (a scatter).
    """
    rows, length = perm.shape
    queries = prefix_len.shape[1]
    device = perm.device
    radix = 1 << _RADIX_BITS
    # Positions take ceil(log2 L) bits; round up to whole levels. Values past L-1 never exist:
    # they only leave the last block, and some children of it, short or empty.
    bits = max(1, (length - 1).bit_length())
    levels = -(-bits // _RADIX_BITS)
    top = levels * _RADIX_BITS
    # Counts are kept for the digits 0..R-2 only: "digit <= R-1" holds for every entry.
    lower = torch.arange(radix - 1, device=device).view(1, radix - 1, 1)
    # The flat scan counts up to rows * (R - 1) * L.
    count_dtype = torch.int32 if rows * (radix - 1) * length < 2**31 else torch.int64

    # Positions, counts and query state fit in int32 (L < 2**31); only gather/scatter indices
    # are int64, as torch requires.
    pos = torch.arange(length, device=device, dtype=torch.int32)
    lower = lower.to(count_dtype)
    seq = perm.to(torch.int32)
    a = torch.zeros(prefix_len.shape, dtype=count_dtype, device=device)  # the query's block start
    m = prefix_len.to(count_dtype)  # how many of the block's values lie in the query's prefix
    kk = torch.full_like(m, k)  # rank of the wanted value inside the block
    for level in range(levels):
        shift = top - _RADIX_BITS * (level + 1)
        child = 1 << shift  # values per child block
        digit = (seq >> shift) & (radix - 1)  # (N, L)
        # le[n, d, i]: how many of seq[n, :i+1] have a digit <= d. One flat scan over all rows
        # (torch runs 1-D scans as a single device-wide scan; row-wise scans of short inner
        # dims, or along an outer dim, are many times slower on GPUs), then each row's own
        # start is subtracted.
        below_eq = (digit.unsqueeze(1) <= lower).view(rows * (radix - 1), length)
        le = below_eq.view(-1).cumsum(0, dtype=count_dtype).view(rows * (radix - 1), length)
        le = (le - (le[:, :1] - below_eq[:, :1].to(count_dtype))).view(rows, radix - 1, length)
        del below_eq

        # Query step. The block's prefix entries are seq[a : a + m] (m >= kk >= 1, so a + m - 1
        # lies in the block); blocks before a hold a / R entries per child.
        idx = (a + m - 1).to(torch.int64).unsqueeze(1).expand(rows, radix - 1, queries)
        cum = le.gather(2, idx)
        cum -= (a // radix).unsqueeze(1) * (lower + 1)  # entries in the children <= d
        passed = cum < kk.unsqueeze(1)  # children wholly below the kk-th entry
        pick = passed.sum(1, dtype=count_dtype)  # the child holding it (R-1: every lower one passed)
        below = torch.where(passed, cum, 0).amax(1)  # entries in the children before pick
        upto = torch.where(passed, m.unsqueeze(1), cum).amin(1).clamp(max=m)  # ... up to pick
        del cum, passed
        kk = kk - below
        m = upto - below
        a = a + pick * child

        if level + 1 < levels:
            # Stable partition of every block by digit: entry i goes to its block start, plus its
            # child's offset, plus the number of same-digit entries before it in the block
            # (entries with digit <= d minus those with digit <= d - 1, before the block and
            # at i itself excluded).
            block = (pos >> (shift + _RADIX_BITS)) << (shift + _RADIX_BITS)  # (L,)
            le_d = le.gather(1, digit.clamp(max=radix - 2).to(torch.int64).unsqueeze(1)).squeeze(1)
            le_d = torch.where(digit == radix - 1, pos + 1, le_d)
            le_prev = le.gather(1, (digit - 1).clamp(min=0).to(torch.int64).unsqueeze(1)).squeeze(1)
            le_prev = torch.where(digit == 0, 0, le_prev)
            del le
            dest = block + digit * child + (le_d - le_prev - 1) - block // radix
            seq = torch.empty_like(seq).scatter_(1, dest.to(torch.int64), seq)
    return a.to(torch.int64)


def topk_intervals(
    attention_bias: torch.Tensor,
    window_size: int,
    is_causal: bool = True,
    padding_mask: Optional[torch.Tensor] = None,
    min_dtype: Optional[float] = None,
) -> KeyIntervals:
    """The top-``window_size`` selection of a per-key bias as a :class:`KeyIntervals` mask.

    Args:
        attention_bias: float ``(B, H, 1, L)``, one bias per key (``H`` usually ``Hkv``). It is
            detached: no gradient flows through the selection.
        window_size: keys kept per query (an int >= 1); with ``L <= window_size`` every
            candidate is kept.
        is_causal: ``False``: one shared top-W over all keys (every query keeps the same
            keys). ``True``: query ``i`` keeps the W best candidates among keys ``0..i``.
        padding_mask: None or bool ``(B, L)`` (True = real token); padded keys are never
            candidates.
        min_dtype: bias value meaning "masked"; None means ``torch.finfo(bias.dtype).min``. A
            key is a candidate iff ``bias > min_dtype`` (so never ``-inf`` or NaN) and padding
            allows it.

    Ties go to the lower key index. Returns ``KeyIntervals`` with start/end of shape
    ``(B, H, L)``:

    * ``is_causal=False``: a kept key gets ``[-2**30, 2**30)`` (every query), the others
      ``[0, 0)``. ``to_dense(L)`` equals ``create_mask(bias, padding_mask, B, L, L,
      window_size, min_dtype)`` (expanded over queries).
    * ``is_causal=True``: key ``j`` gets ``[j, t_j)`` with ``t_j`` the position of the W-th
      candidate (in position order) that outranks it, or ``L`` if fewer than W do. Keys that
      are never kept (``t_j <= j``, or not candidates) get the empty interval ``[0, 0)``.
      ``to_dense(L) & causal`` (i.e. the intervals with ``is_causal=True`` in the attention
      call) equals ``causal_topk_mask(bias, padding_mask, window_size, min_dtype)``. Built over
      the whole sequence, the intervals also serve a KV-cache step whose queries are the last
      positions (bottom-right alignment).

    Cost: one stable sort per (batch, head) row plus ``ceil(log2(L) / 4)`` levels of
    vectorised O(16 L) ops (causal only); O(16 L) memory per row; no host synchronisation.
    On CUDA (and on CPU under ``TRITON_INTERPRET=1``) the causal selection runs as Triton
    kernels (:mod:`~flash_dmattn.planning.selection_kernels`): a score pass, the sort (torch's
    radix sort; a 16-bit key for bf16/fp16 biases), a count pass, one partition per tree level
    but the last and one query pass that walks every key down all levels, one memory round trip
    a level. Host work: ``levels + 2`` Triton launches (5 for L = 32K, whose 15 position bits
    take 3 levels of 5; 6 for 64K and 128K), the sort and three allocations (the sort key, one
    int32 workspace for every level's sequence and counts, the bounds); sizes and grids cached
    per ``(L, rows)``. The same results bit for bit.

    Equivalent plain PyTorch (dense, O(L^2))::

        valid = (bias > min_dtype)[:, :, 0] & padding_mask[:, None, :]          # (B, H, L)
        if not is_causal:
            keep = create_mask(bias, padding_mask, B, L, L, W, min_dtype)[:, :, 0]
            start = torch.where(keep, -2**30, 0); end = torch.where(keep, 2**30, 0)
        else:
            dense = causal_topk_mask(bias, padding_mask, W, min_dtype)          # (B, H, L, L)
            j = torch.arange(L)
            seen = dense.any(2)                                                 # kept by some query
            last = L - 1 - dense.flip(2).int().argmax(2)                        # last query keeping j
            start = torch.where(seen, j, 0); end = torch.where(seen, last + 1, 0)
    """
    padding, min_dtype = _check_inputs(attention_bias, window_size, is_causal, padding_mask, min_dtype)
    bias_batch, heads, _, length = attention_bias.shape
    batch = max(bias_batch, 1 if padding is None else padding.shape[0])
    # Every query keeps at most W keys, and a query keeps at most one key the query before it
    # did not (its own position): the KeyIntervals window promise.
    _kernels = _KERNELS or _import_kernels()

    rows = batch * heads
    if rows * length > 0 and _kernels.available(attention_bias.device, rows, length):
        # Triton: one score pass, the sort and (causal) a launch per tree level plus two; the
        # same integers as the plain path below. The kernels only read the bias (no gradient
        # flows through the selection), through its strides.
        if length <= window_size:
            bounds = _kernels.all_kept_bounds(attention_bias, padding, min_dtype, batch, heads,
                                              is_causal)
            return KeyIntervals.from_bounds(bounds, window_size)
        if is_causal:
            bounds = _kernels.causal_bounds(attention_bias, padding, min_dtype, window_size,
                                            batch, heads)
            return KeyIntervals.from_bounds(bounds, window_size)
    bias = attention_bias.detach()[:, :, 0]
    out = _plain_intervals(bias, window_size, is_causal, padding, min_dtype)
    out.window = window_size
    return out


def _topk_intervals_torch(
    attention_bias: torch.Tensor,
    window_size: int,
    is_causal: bool = True,
    padding_mask: Optional[torch.Tensor] = None,
    min_dtype: Optional[float] = None,
) -> KeyIntervals:
    """:func:`topk_intervals` by the plain-PyTorch path only (the CPU fallback; the tests'
    reference for the Triton path)."""
    padding, min_dtype = _check_inputs(attention_bias, window_size, is_causal, padding_mask, min_dtype)
    return _plain_intervals(attention_bias.detach()[:, :, 0], window_size, is_causal, padding, min_dtype)


def _plain_intervals(bias, window_size, is_causal, padding, min_dtype) -> KeyIntervals:
    """The plain-PyTorch path on validated inputs (``bias (B|1, H, L)``)."""
    # Comparing with `>` (as create_mask does) also rejects -inf and NaN.
    valid = bias > min_dtype
    if padding is not None:
        valid = valid & padding[:, None, :]
    batch, heads, length = valid.shape
    device = valid.device
    pos = torch.arange(length, device=device, dtype=torch.int32)

    # Scalars stay Python numbers (no host-to-device copies, so the function can be captured
    # in a CUDA graph).
    def result(keep: torch.Tensor, start, end) -> KeyIntervals:
        bounds = torch.empty((2, batch, heads, length), dtype=torch.int32, device=device)
        bounds[0] = torch.where(keep, start, 0)
        bounds[1] = torch.where(keep, end, 0)
        return KeyIntervals.from_bounds(bounds)

    if length <= window_size or valid.numel() == 0:
        # Every candidate fits in the window.
        if not is_causal:
            return result(valid, -_ALWAYS, _ALWAYS)
        return result(valid, pos, length)

    # Rank the keys: a stable descending sort puts equal biases in ascending key order (ties
    # go to the lower index) and the non-candidates (-inf here) last. `+ 0.0` turns -0.0 into
    # +0.0, which the dense helpers' comparisons treat as equal but a radix sort might not.
    score = torch.where(valid, bias + 0.0, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # (B, H, L) int64
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=device).expand_as(order))
    if not is_causal:
        return result(valid & (rank < window_size), -_ALWAYS, _ALWAYS)

    # t_j: the W-th smallest position among the keys that outrank j, i.e. in order[:rank_j].
    # Keys with fewer than W keys above them are kept to the end; their query is run on a
    # valid prefix length and its answer discarded.
    rows = batch * heads
    first = rank.reshape(rows, length).clamp(min=window_size)
    t = kth_smallest_of_prefixes(order.reshape(rows, length), first, window_size)
    t = torch.where(rank.reshape(rows, length) < window_size, length, t).view(batch, heads, length)
    keep = valid & (t > pos)
    return result(keep, pos, t)
