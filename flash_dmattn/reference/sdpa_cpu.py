"""The torch-reference backend's CPU path: PyTorch's fused attention over bounded query chunks.

On CPU the oracle (:mod:`.attention`) runs each score block through separate PyTorch ops and
is several times slower than :func:`torch.nn.functional.scaled_dot_product_attention`. Where
SDPA computes exactly this library's attention -- no soft cap, no KV cache, no attention
probabilities asked for, no dropout, a bias in the query's dtype, float32 / bfloat16 / float16
(float64 stays on the oracle, the tests' ground truth) -- the backend calls SDPA instead, one
chunk of query rows at a time:

* the chunk's visibility (the mask's rows, the bottom-right causal diagonal, key intervals)
  and the bias become one additive float mask: the bias (or 0) where a key is visible,
  ``-inf`` where it is hidden (:func:`_additive_mask`). Parts with one head per kv head and
  parts per query head are combined as ``(Hkv, g)`` views, so the mask has the fewest heads
  they allow. A mask with one head per kv head on a large chunk is never repeated: SDPA runs
  once per member of a query-head group (query heads ``kv * g + m`` for one ``m``, against
  their own kv heads), each call reading the same mask; otherwise SDPA groups the query heads
  itself (``enable_gqa``) and the mask is repeated over each group once. K/V are never
  repeated;
* a mask with one row (the same keys for every query, as a per-key top-W selection is) that
  keeps few keys runs over the kept keys alone: their K/V, bias and positions are gathered
  (:func:`_kept_keys`), and the causal diagonal compares the kept keys' positions. SDPA then
  does the work of the kept keys, not of all of them;
* causal chunks stop at their last visible key: keys past the diagonal are not computed;
* a row that sees no key (hidden by the mask, or a ``-inf`` bias on every key) must give 0
  and nothing of it may reach a gradient. PyTorch's SDPA does exactly that for a row whose
  mask is ``-inf`` everywhere; :func:`sdpa_zeroes_empty_rows` checks it once per dtype on
  each CPU kernel. Where it does not, such rows attend to every key with finite scores
  instead and their output is multiplied by 0 afterwards (the guarded chunk);
* a training call keeps its chunks' masks for the backward while they total at most
  ``SAVED_ELEMENTS`` (128 MiB in float32); beyond that each chunk is checkpointed, and the
  backward recomputes its mask and attention: memory stays bounded, as in the oracle.

A short call is one SDPA call with its mask built in a few ops (fewer than a user of SDPA
spends building the same mask out). With no mask, bias or intervals (and causal only where
``Lq == Lk``, SDPA's own alignment) one SDPA call on the tensors as given covers the whole
problem and nothing of size ``(Lq, Lk)`` is built (:func:`sdpa_plain`; auto-dispatch calls it
directly for such calls of a signature it has decided, :func:`flash_dmattn.registry.run_plain`).
On CUDA tensors the same call is :func:`sdpa_plain_cuda`, which asks SDPA for cuDNN's
attention first when a gradient is wanted (policy rule ``hopper-plain-training``).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

# Elements of one chunk's scores (B * H * rows * Lk): about 32 MiB in float32.
CHUNK_ELEMENTS = 1 << 23
# Training calls whose masks together stay within this many elements keep them for the
# backward (as SDPA with a built mask would); larger ones recompute each chunk's.
SAVED_ELEMENTS = 1 << 25
# Causal calls split their queries into at least this many chunks (of at least
# CAUSAL_MIN_ROWS rows) so that each chunk skips the keys past its diagonal. Not more: on a
# machine whose cores other processes hold, every parallel op waits for its second thread,
# and each chunk adds ops (benchmarks/results/cpu-2core/cpu_sdpa.md).
CAUSAL_CHUNKS = 4
CAUSAL_MIN_ROWS = 128
# Below this many score elements a chunk's call overhead outweighs repeating its mask over the
# query heads: one SDPA call for all heads instead of one per group member.
PER_MEMBER_ELEMENTS = 1 << 19

# A mask with one row that keeps at most this fraction of the keys runs over the kept keys
# alone (_kept_keys): gathering them costs less than the scores of the keys it leaves out.
GATHER_MAX_FRACTION = 0.5

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NEG_INF = float("-inf")
_FILLS: dict = {}
# dtype -> whether SDPA zeroes rows that see no key (sdpa_zeroes_empty_rows).
_ZEROES_EMPTY_ROWS: dict = {}
# Additive causal masks by (rows, keys, diagonal, dtype, device) (_causal_additive), at most
# this many elements in all (16 MiB in float32), the oldest dropped first.
CAUSAL_CACHE_ELEMENTS = 1 << 22
_CAUSAL: dict = {}


def _fills(dtype: torch.dtype):
    """0-d ``(0, -inf)`` of ``dtype``, made once (never written to)."""
    if dtype not in _FILLS:
        _FILLS[dtype] = (torch.zeros((), dtype=dtype), torch.full((), _NEG_INF, dtype=dtype))
    return _FILLS[dtype]


def sdpa_cpu_reasons(inputs) -> list:
    """Why a call cannot take the SDPA path (empty: it can)."""
    reasons = []
    if inputs.device.type != "cpu":
        reasons.append("not on CPU")
    if inputs.dtype not in _DTYPES:
        reasons.append(f"dtype {inputs.dtype} stays on the oracle")
    if inputs.softcap > 0.0:
        reasons.append("soft cap")
    if inputs.return_attn_probs:
        reasons.append("attention probabilities asked for")
    if inputs.cache_seqlens is not None or inputs.block_table is not None:
        reasons.append("KV cache")
    if inputs.attn_bias is not None and inputs.attn_bias.dtype != inputs.dtype:
        reasons.append("bias dtype differs from the query's")
    if inputs.seqlen_q == 0 or inputs.seqlen_k == 0:
        reasons.append("no queries or no keys")
    if getattr(inputs, "dropout_p", 0.0) > 0.0:
        reasons.append("attention dropout (SDPA's own random stream is not flash_dmattn's)")
    return reasons


def sdpa_zeroes_empty_rows(dtype: torch.dtype) -> bool:
    """Whether PyTorch's CPU SDPA gives a query row whose additive mask is ``-inf`` on every
    key an output of 0 and gradients of 0 (no NaN), on each kernel that runs such calls: the
    fused kernel (a mask that needs no gradient) and the math kernel (a mask that needs one).

    Checked once per dtype on a tiny problem (about a millisecond), with its own random
    generator; inside a compiled graph an unchecked dtype counts as not zeroed (the guarded
    path, exact either way)."""
    known = _ZEROES_EMPTY_ROWS.get(dtype)
    if known is None:
        if torch.compiler.is_compiling():
            return False
        known = _ZEROES_EMPTY_ROWS[dtype] = _probe_empty_rows(dtype)
    return known


def _probe_empty_rows(dtype: torch.dtype) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    ran = False
    with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
        # A kernel that cannot take the probe's form warns why before it declines.
        warnings.simplefilter("ignore")
        for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
            for mask_grad in (False, True):
                # Two query heads on one kv head (enable_gqa); query row 1 sees no key.
                q, k, v = (torch.randn(1, h, n, 8, generator=gen).to(dtype).requires_grad_()
                           for h, n in ((2, 3), (1, 4), (1, 4)))
                mask = torch.zeros(1, 2, 3, 4, dtype=dtype)
                mask[:, :, 1] = _NEG_INF
                mask.requires_grad_(mask_grad)
                leaves = (q, k, v, mask) if mask_grad else (q, k, v)
                try:
                    with sdpa_kernel([kernel]):
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             enable_gqa=True)
                        grads = torch.autograd.grad(out.sum(), leaves)
                except RuntimeError:
                    continue  # this kernel does not run calls of this form
                ran = True
                if not (out.isfinite().all() and (out[:, :, 1] == 0).all()):
                    return False
                if not all(g.isfinite().all() for g in grads):
                    return False
                if (grads[0][:, :, 1] != 0).any() or (mask_grad and (grads[3][:, :, 1] != 0).any()):
                    return False
    return ran


def _grouped(t: Optional[Tensor], heads: int, kv_heads: int, dim: int = 1) -> Optional[Tensor]:
    """A mask / bias / bounds tensor whose ``dim`` holds 1, ``Hkv`` or ``H`` heads as a view
    with ``(Hkv | 1, g | 1)`` there: query head ``kv * g + m`` at ``(kv, m)``."""
    if t is None:
        return None
    if t.shape[dim] == heads and heads != kv_heads:
        return t.unflatten(dim, (kv_heads, heads // kv_heads))
    return t.unsqueeze(dim + 1)


def _keys(t: Optional[Tensor], end: int) -> Optional[Tensor]:
    """``t`` limited to keys ``0 .. end`` (last dim; a per-query value stays as it is)."""
    return t if t is None or t.shape[-1] == 1 else t[..., :end]


def _causal_additive(rows: int, keys: int, diag: int, dtype: torch.dtype, device) -> Tensor:
    """``(rows, keys)``: 0 where ``key <= row + diag``, ``-inf`` past it. Kept (never written to)
    within ``CAUSAL_CACHE_ELEMENTS``: a training loop asks for the same few every step."""
    key = (rows, keys, diag, dtype, device)
    cached = _CAUSAL.get(key)
    if cached is not None:
        return cached
    out = torch.full((rows, keys), _NEG_INF, dtype=dtype, device=device).triu_(diag + 1)
    if out.numel() <= CAUSAL_CACHE_ELEMENTS and not torch.compiler.is_compiling():
        while sum(t.numel() for t in _CAUSAL.values()) + out.numel() > CAUSAL_CACHE_ELEMENTS:
            del _CAUSAL[next(iter(_CAUSAL))]  # the oldest
        _CAUSAL[key] = out
    return out


def _repeat_groups(add: Tensor, group: int) -> Tensor:
    """A ``(B, Hkv, 1, r, k)`` mask with ``Hkv > 1`` repeated over each query-head group:
    ``(B, Hkv, g, r, k)``, one head per query head, as a view (the op that reads it next, or
    the final ``flatten``, writes it out); anything else is returned as it is."""
    if group > 1 and add.dim() == 5 and add.shape[1] > 1 and add.shape[2] == 1:
        return add.expand(*add.shape[:2], group, *add.shape[3:])
    return add


def _only_finite_or_neg_inf(t: Tensor) -> bool:
    """Whether ``t`` holds no NaN and no ``+inf`` (``-inf`` hides a key)."""
    return t.numel() == 0 or float(t.detach().amax()) < float("inf")


def _additive_mask(mask, bias, inside, is_causal, diag, rows, keys, dtype, device, group):
    """The chunk's float mask for SDPA: ``bias`` (or 0) where a key is visible, ``-inf`` where
    the mask, the key intervals (``inside``) or the causal diagonal hide it. ``group``: repeat
    a mask with one head per kv head over each group (0: don't).

    Built from the smallest parts up, and with the fewest passes over the full chunk: the
    user's mask and bias meet at their own (often per-key) size and are repeated over the
    groups there while they have a single row; the causal diagonal is a kept additive mask,
    added in one vectorised pass (``torch.where`` over broadcast operands costs several times
    more per element). Adding ``-inf`` is exact unless the bias holds NaN or ``+inf``, which
    must not reach hidden keys: such a bias takes ``torch.where`` instead.
    """
    zero, neg_inf = _fills(dtype)
    if bias is None:
        add = None if mask is None else torch.where(mask, zero, neg_inf)
    else:
        add = bias if mask is None else torch.where(mask, bias, neg_inf)
    if inside is not None:
        add = torch.where(inside, zero if add is None else add, neg_inf)
    if add is not None and add.shape[-2] == 1:
        add = _repeat_groups(add, group)
    if is_causal:
        causal = _causal_additive(rows, keys, diag, dtype, device)
        if add is None:
            add = causal
        elif bias is None or (not torch.compiler.is_compiling() and _only_finite_or_neg_inf(add)):
            add = add + causal  # add holds finite values and -inf only
        else:
            add = torch.where(causal == 0, add, neg_inf)
    return _repeat_groups(add, group)


def _guarded_mask(mask, bias, inside, is_causal, diag, rows, keys, bias_hides, device):
    """``(visibility, live)`` for a torch whose SDPA does not zero rows that see no key: the
    bool visibility (``bias > -inf`` included where ``bias_hides``) and, where a row may see
    no key, ``live`` ``(..., rows, 1)``: whether each row sees one (else None)."""
    visible = mask
    if is_causal:
        causal = torch.ones(rows, keys, dtype=torch.bool, device=device).tril_(diag)
        visible = causal if visible is None else visible & causal
    if inside is not None:
        visible = inside if visible is None else visible & inside
    if bias_hides:
        seen = bias > _NEG_INF
        visible = seen if visible is None else visible & seen
    # Every row sees key 0 when only the causal diagonal (with Lk >= Lq) hides keys.
    if visible is None or (mask is None and inside is None and not bias_hides and diag >= 0):
        return visible, None
    return visible, visible.any(-1, keepdim=True)


def _chunk(q, k, v, mask, bias, bounds, scale, is_causal, i0, shift, per_member, guard):
    """Attention ``(B, rows, H, Dv)`` of query rows ``i0 .. i0 + rows``.

    ``q`` is that chunk ``(B, rows, H, D)``, ``k``/``v`` all keys ``(B, Lk, Hkv, D)``, ``mask``
    and ``bias`` the chunk's rows (or their single broadcast row) as ``(B, Hkv|1, g|1, rows,
    Lk)`` views (:func:`_grouped`), ``bounds`` key intervals ``(2, Bx, Hkv|1, g|1, Lk)`` (or
    their starts alone, ``(1, ...)``: no end), ``shift`` the query's position less its index,
    ``Lk - Lq`` of the call (key ``j``'s position is ``j`` unless the keys were gathered, see
    :func:`_gather_kept`). ``per_member``: one SDPA call per query-head group member, against a mask with one head
    per kv head (no part has one head per query head). ``guard``: None where SDPA zeroes
    rows that see no key itself (:func:`sdpa_zeroes_empty_rows`); else such rows are zeroed
    here, and ``guard`` says whether the bias may hide keys (holds ``-inf``).
    """
    rows, heads = q.shape[1], q.shape[2]
    lk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    diag = i0 + shift  # query row r (position r + diag) sees keys 0 .. r + diag
    if is_causal:
        # Keys past the chunk's last diagonal are hidden from all its rows (at least one key
        # stays, so that a chunk whose rows see nothing is still one SDPA call).
        end = max(1, min(lk, rows + diag))
        if end < lk:
            k, v = k[:, :end], v[:, :end]
            mask, bias, bounds = _keys(mask, end), _keys(bias, end), _keys(bounds, end)
    keys = k.shape[1]
    inside = None
    if bounds is not None:
        pos = torch.arange(diag, rows + diag, device=q.device).unsqueeze(1)
        inside = bounds[0].unsqueeze(-2) <= pos
        if bounds.shape[0] > 1:
            inside = inside & (pos < bounds[1].unsqueeze(-2))
    live = None
    if guard is None:
        add = _additive_mask(mask, bias, inside, is_causal, diag, rows, keys, q.dtype,
                             q.device, 0 if per_member else group)
    else:
        visible, live = _guarded_mask(mask, bias, inside, is_causal, diag, rows, keys,
                                      guard and bias is not None, q.device)
        zero, neg_inf = _fills(q.dtype)
        if visible is None:
            add = bias
        else:
            # A row that sees no key attends to every key with finite scores instead, and its
            # output is zeroed below.
            fill = neg_inf if live is None else torch.where(live, neg_inf, zero)
            add = torch.where(visible, zero if bias is None else bias, fill)
        add = _repeat_groups(add, 0 if per_member else group)
    if add.dim() == 5:
        # (B, Hkv|1, g|1, rows, keys): 1, Hkv or H heads (a copy where still a repeating view).
        add = add.flatten(1, 2)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    if per_member:
        # Query heads kv * g + m for one m: (B, Hkv, rows, D) views, one SDPA call each.
        members = q.unflatten(2, (kv_heads, group)).unbind(3)
        outs = [F.scaled_dot_product_attention(m.transpose(1, 2), kh, vh, attn_mask=add,
                                               scale=scale).transpose(1, 2) for m in members]
        out = torch.stack(outs, dim=3)  # (B, rows, Hkv, g, Dv)
    else:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=add,
                                             scale=scale, enable_gqa=True).transpose(1, 2)
        if live is None:
            return out
        out = out.unflatten(2, (kv_heads, group))
    if live is not None:
        # (rows, 1) or (B|1, Hkv|1, g|1, rows, 1) against (B, rows, Hkv, g, Dv).
        out = out * (live.view(rows, 1, 1, 1) if live.dim() == 2 else live.permute(0, 3, 1, 2, 4))
    return out.flatten(2, 3)


def _rows(t: Optional[Tensor], rows: int, count: int) -> list:
    """``count`` chunks of ``t``'s query rows (dim 3 of a :func:`_grouped` view; split: its
    backward is one concatenation), or ``t`` itself for each when it has a single broadcast
    row."""
    if t is None or t.shape[3] == 1:
        return [t] * count
    return list(t.split(rows, dim=3))


def _kept_keys(mask: Optional[Tensor], kv_heads: int, lk: int) -> Optional[Tensor]:
    """For a mask with one row (the same keys for every query) and one head, or one per kv
    head, that keeps at most ``GATHER_MAX_FRACTION`` of the keys: the kept keys' indices
    ``(Bx, Hx, 1, n)``, ascending, padded to the most any ``(batch, head)`` keeps with keys it
    does not keep. None otherwise (a compiled graph never gathers: ``n`` is read on the host)."""
    if (mask is None or mask.shape[2] != 1 or mask.shape[3] != lk
            or mask.shape[1] not in (1, kv_heads) or torch.compiler.is_compiling()):
        return None
    kept = int(mask.sum(-1).amax())
    if kept == 0 or kept > GATHER_MAX_FRACTION * lk:
        return None
    # A stable descending sort of 1/0 lists the kept keys first, each group in index order.
    order = torch.sort(mask.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return order[..., :kept]


def _gather_kept(order, k, v, mask, bias, is_causal, heads):
    """The call over the kept keys alone (:func:`_kept_keys`): ``(k, v, mask, bias, bounds)``
    with the keys in ``order``'s places, ``mask`` False on the padding, and, for a causal call,
    the keys' positions as key-interval starts ``(1, Bx, Hx, n)`` (the causal diagonal then
    compares positions, not indices). Differentiable in K, V and the bias."""
    batch, _, kv_heads, _ = k.shape
    kept = order.shape[-1]
    index = order.squeeze(2).transpose(1, 2).unsqueeze(-1)  # (Bx, n, Hx, 1)
    k = k.gather(1, index.expand(batch, kept, kv_heads, k.shape[3]))
    v = v.gather(1, index.expand(batch, kept, kv_heads, v.shape[3]))
    mask = mask.gather(-1, order)
    if bias is not None and bias.shape[3] > 1:
        if bias.shape[1] == heads and order.shape[1] == kv_heads != heads:
            order = order.repeat_interleave(heads // kv_heads, dim=1)  # per query head
        shape = (max(bias.shape[0], order.shape[0]), max(bias.shape[1], order.shape[1]),
                 bias.shape[2])
        bias = bias.expand(*shape, bias.shape[3]).gather(-1, order.expand(*shape, kept))
    bounds = order.squeeze(2).unsqueeze(0) if is_causal else None
    return k, v, mask, bias, bounds


def sdpa_computes(dtype: torch.dtype, lq: int, lk: int, is_causal: bool,
                  scale: Optional[float]) -> bool:
    """Whether one SDPA call computes a plain call (:func:`sdpa_plain`): a dtype its fused
    kernels take, queries and keys, and causal only where SDPA's top-left diagonal is the
    library's bottom-right one (``Lq == Lk``) and the scale is not 0 (SDPA's causal masking
    scales scores it has already set to ``-inf``, and ``0 * -inf`` is NaN)."""
    return (dtype in _DTYPES and lq > 0 and lk > 0
            and not (is_causal and (lq != lk or scale == 0.0)))


def sdpa_plain(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], is_causal: bool,
               lq: int, lk: int) -> Optional[Tensor]:
    """``(B, Lq, H, Dv)`` attention of ``(B, L, H, D)`` tensors with no mask, bias, soft cap,
    KV cache, dropout or probabilities, as one SDPA call on their transposed views (as a user
    of SDPA writes it), differentiated by SDPA's own backward; ``lq``, ``lk`` their lengths.
    ``scale`` None is SDPA's default, ``1/sqrt(D)``, the library's.

    None where that call is not this library's attention: a dtype :func:`sdpa_cpu_reasons`
    leaves to the oracle, no queries or no keys, and a causal call with ``Lq != Lk`` (SDPA
    aligns its diagonal top-left) or scale 0 (SDPA's causal masking scales scores it has
    already set to ``-inf``, and ``0 * -inf`` is NaN): :func:`sdpa_cpu_attention` then puts
    causality in a mask."""
    if not sdpa_computes(q.dtype, lq, lk, is_causal, scale):
        return None
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=is_causal, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


# Whether this torch's sdpa_kernel takes ``set_priority`` (added after torch 2.5): only then can
# a call put cuDNN's attention ahead of SDPA's own kernel order. Without it the
# ``hopper-plain-training`` rule does not apply (flash_dmattn.policy) and sdpa_plain_cuda runs
# SDPA with its own order.
SDPA_SETS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters

# SDPA's kernels in the order a training call of sdpa_plain_cuda asks for them, each with the
# switch (torch.backends.cuda) that says whether it is enabled in this process: cuDNN's
# attention first (its backward measured fastest on Hopper), then SDPA's others.
_CUDNN_FIRST = (
    (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled),
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
)


def cudnn_first():
    """A context in which SDPA tries cuDNN's attention first, then flash, memory-efficient and
    math, each only if it is enabled now (a kernel the caller switched off, globally or with
    ``sdpa_kernel``, stays off). A do-nothing context where this torch's ``sdpa_kernel`` takes
    no ``set_priority`` (SDPA's own order then) or inside a compiled graph (the compiler picks
    the kernel)."""
    if not SDPA_SETS_PRIORITY or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return sdpa_kernel([kernel for kernel, enabled in _CUDNN_FIRST if enabled()],
                       set_priority=True)


def sdpa_plain_cuda(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], is_causal: bool,
                    lq: int, lk: int) -> Optional[Tensor]:
    """:func:`sdpa_plain` for CUDA tensors (the torch-reference backend's plain entry on a GPU).
    A call that needs a gradient runs with cuDNN's attention first (:func:`cudnn_first`):
    SDPA's own order takes its flash kernel, whose forward + backward measured well behind
    cuDNN's on Hopper (policy rule ``hopper-plain-training``). Forward-only calls (small
    decoding steps, rule ``gpu-plain-decode``) keep SDPA's own order and no context manager:
    their cost is host time. The query, key and value are passed as transposed views of the
    library's ``(B, L, H, D)`` tensors, as :func:`sdpa_plain` does; grouped heads go through
    ``enable_gqa`` (K/V are never repeated)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if not sdpa_computes(q.dtype, lq, lk, is_causal, scale):
            return None  # no SDPA call, so no context either
        with cudnn_first():
            return sdpa_plain(q, k, v, scale, is_causal, lq, lk)
    return sdpa_plain(q, k, v, scale, is_causal, lq, lk)


def sdpa_cpu_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                       bias: Optional[Tensor], scale: float, is_causal: bool,
                       key_intervals: Optional[Tensor] = None) -> Tensor:
    """``(B, Lq, H, Dv)`` attention of ``(B, L, H, D)`` tensors (see the module docstring);
    ``mask``/``bias`` 4-D broadcastable to ``(B, H, Lq, Lk)`` with ``H`` or ``Hkv`` or 1
    heads, ``key_intervals`` the ``(2, Bx, Hx, Lk)`` bounds of a KeyIntervals mask."""
    batch, lq, heads = q.shape[0], q.shape[1], q.shape[2]
    lk, kv_heads = k.shape[1], k.shape[2]
    if mask is None and bias is None and key_intervals is None:
        out = sdpa_plain(q, k, v, scale, is_causal, lq, lk)
        if out is not None:
            return out
    shift = lk - lq
    order = _kept_keys(mask, kv_heads, lk) if key_intervals is None else None
    if order is not None:
        k, v, mask, bias, key_intervals = _gather_kept(order, k, v, mask, bias, is_causal, heads)
        is_causal = False  # the kept keys' positions carry it
        lk = k.shape[1]
    aux_heads = [t.shape[1] for t in (mask, bias) if t is not None]
    if key_intervals is not None:
        aux_heads.append(key_intervals.shape[2])
    rows = max(1, CHUNK_ELEMENTS // max(1, batch * heads * lk))
    if is_causal:
        rows = min(rows, max(CAUSAL_MIN_ROWS, -(-lq // CAUSAL_CHUNKS)))
    # With one kv head a mask per kv head is one for all query heads: SDPA broadcasts it.
    per_member = (1 < kv_heads < heads and kv_heads in aux_heads and heads not in aux_heads
                  and batch * heads * min(rows, lq) * lk >= PER_MEMBER_ELEMENTS)
    if sdpa_zeroes_empty_rows(q.dtype):
        guard = None
    else:
        # A bias without -inf hides nothing: visibility comes from the rest alone (a compiled
        # graph cannot branch on the bias's values, so it always takes the general path).
        guard = bias is not None and (torch.compiler.is_compiling()
                                      or not bool(bias.detach().amin() > _NEG_INF))
    count = -(-lq // rows)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (bias is not None and bias.requires_grad))
    recompute = needs_grad and batch * heads * lq * lk > SAVED_ELEMENTS
    mask5, bias5 = _grouped(mask, heads, kv_heads), _grouped(bias, heads, kv_heads)
    bounds5 = _grouped(key_intervals, heads, kv_heads, dim=2)
    if count == 1:
        args = (q, k, v, mask5, bias5, bounds5, scale, is_causal, 0, shift, per_member, guard)
        return checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
    chunks = zip(range(0, lq, rows), q.split(rows, dim=1), _rows(mask5, rows, count),
                 _rows(bias5, rows, count))
    outs = []
    for i0, qc, mc, bc in chunks:
        args = (qc, k, v, mc, bc, bounds5, scale, is_causal, i0, shift, per_member, guard)
        if recompute:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    return torch.cat(outs, dim=1)
