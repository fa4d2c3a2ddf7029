"""The ``flex`` backend: PyTorch FlexAttention with a BlockMask and a bias ``score_mod``.

* mask -> ``BlockMask`` built at tile granularity from the compact mask (dead tiles skipped,
  full tiles run without ``mask_mod``); the ``mask_mod`` reads the mask through broadcast-aware
  indices, so nothing is expanded;
* bias and softcap -> ``score_mod``; the bias gradient comes from Flex's captured-buffer
  gradients (torch >= 2.6, computed with atomics, hence not deterministic);
* GQA via ``enable_gqa``; bottom-right causal in both the block map and ``mask_mod``.
* ``cache_seqlens`` (KV-cache decoding) -> ``mask_mod`` reads the per-batch used length
  (``kv < n[b]``, causal diagonal at ``n[b] - Lq``); the block map drops key tiles past it and
  marks no tile full, so ``mask_mod`` runs on every live tile.
* key intervals (:class:`~flash_dmattn.masks.KeyIntervals`) -> ``mask_mod`` reads the two
  bounds by (batch, head, key) and compares them with the query position (the causal
  diagonal); the block map classifies tiles from the bounds, one query tile against all keys
  at a time, so no (Lq, Lk) tensor is made.

On CUDA the call is compiled (fused kernels). On CPU FlexAttention runs its eager
implementation, which has no backward and materialises the score matrix; auto-dispatch
prefers the chunked reference there (:mod:`flash_dmattn.policy`).
"""
from __future__ import annotations

import functools
import inspect
import warnings
from collections import OrderedDict
from typing import List, Optional

import torch

from ..block_map import block_reduce, tile_liveness
from .. import registry
from ..intmath import cdiv
from .base import Backend, BackendDeclined

BLOCK = 128  # Flex's default tile; its kernels' tiles divide it.

_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_flex = None  # the torch.nn.attention.flex_attention module, once probed
_compiled = None


def _flex_module():
    global _flex
    if _flex is None:
        from torch.nn.attention import flex_attention as module

        _flex = module
    return _flex


def _compiled_flex():
    global _compiled
    if _compiled is None:
        # Static shapes: automatic dynamic shapes turn the scale into a symbolic float, which
        # FlexAttention's lowering cannot handle (seen with torch 2.11).
        _compiled = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _compiled


# Every distinct shape / score_mod constant is one compiled entry; dynamo's default of 8
# would silently drop to the eager (score-materialising) path in a model with many shapes.
_RECOMPILE_LIMIT = 64


def _broadcast_index(t4, num_heads: int, num_kv_heads: int):
    """A function ``(b, h, q, kv) -> t4[...]`` honouring size-1 dims and per-kv-head tensors."""
    bx, hx, qx, kx = t4.shape
    group = num_heads // num_kv_heads
    per_kv_head = hx == num_kv_heads and hx != num_heads

    def read(b, h, q, kv):
        return t4[
            b if bx > 1 else 0,
            (h // group if per_kv_head else h) if hx > 1 else 0,
            q if qx > 1 else 0,
            kv if kx > 1 else 0,
        ]

    return read


_causal_cache: "OrderedDict" = OrderedDict()


def _block_mask(inputs):
    """BlockMask from the compact mask and causal flag, or None when every key is visible."""
    intervals = inputs.key_intervals
    if (inputs.attn_mask is None and not inputs.is_causal and inputs.cache_seqlens is None
            and intervals is None):
        return None
    if inputs.attn_mask is None and inputs.cache_seqlens is None and intervals is None:
        # A causal-only map depends on the lengths alone: build it once per shape.
        key = (inputs.seqlen_q, inputs.seqlen_k, inputs.device, inputs.needs_grad)
        if key not in _causal_cache:
            _causal_cache[key] = _build_block_mask(inputs)
            if len(_causal_cache) > 32:
                _causal_cache.popitem(last=False)
        _causal_cache.move_to_end(key)
        return _causal_cache[key]
    return _build_block_mask(inputs)


@functools.lru_cache(maxsize=None)
def _from_kv_blocks_params():
    """Keyword names of this torch's ``BlockMask.from_kv_blocks`` (they vary by version);
    looked up once, not on every BlockMask build."""
    return frozenset(inspect.signature(_flex_module().BlockMask.from_kv_blocks).parameters)


def _tile_maps(mask, lq: int, lk: int, causal: bool, device, use_summary: Optional[bool] = None):
    """``(live, full)`` BLOCK x BLOCK tile maps (see :func:`..block_map.tile_liveness`).

    A per-query mask on CUDA is read once by the Triton backend's summary kernel instead of
    twice (an ``any`` and an ``all`` pass) by torch reductions: on the dynamic-mask workload
    that mask is 268 MB, and the flex path rebuilds its BlockMask on every call.
    """
    if use_summary is None:
        use_summary = mask is not None and mask.is_cuda
    if not (use_summary and mask is not None):
        return tile_liveness(mask, lq, lk, BLOCK, BLOCK, causal, device)
    try:
        from ..planning.mask_summary import summarize_mask, wants_summary
        from ..planning.tiles import classify_tiles
    except ImportError:  # no triton: torch reductions
        return tile_liveness(mask, lq, lk, BLOCK, BLOCK, causal, device)
    if not wants_summary(mask, lq, lk):
        return tile_liveness(mask, lq, lk, BLOCK, BLOCK, causal, device)
    summary = summarize_mask(mask, BLOCK, BLOCK)
    return classify_tiles(mask, lq, lk, causal, BLOCK, BLOCK, device, summary)


# Elements of one (Bx, Hx, query tiles, Lk) block of the key-interval tile classification.
_INTERVAL_CHUNK_ELEMENTS = 1 << 24


def _interval_tiles(bounds, lq: int, lk: int):
    """``(live, full)`` ``(Bx, Hx, nQ, nK)`` tile maps of key intervals ``(2, Bx, Hx, Lk)``.

    A key is live in a query tile when its interval meets the tile's positions, full when its
    interval covers all of them; a tile is live when any of its keys is, full when all its
    (in-range) keys are. Query tiles are taken a chunk at a time against all keys: at most
    ``_INTERVAL_CHUNK_ELEMENTS`` booleans, never (Lq, Lk).
    """
    start = bounds[0].to(torch.int64).unsqueeze(2)  # (Bx, Hx, 1, Lk)
    end = bounds[1].to(torch.int64).unsqueeze(2)
    bx, hx = bounds.shape[1], bounds.shape[2]
    tile_q0 = torch.arange(0, lq, BLOCK, device=bounds.device)
    first = (tile_q0 + (lk - lq)).view(-1, 1)  # first query position of each tile
    stop = (torch.clamp(tile_q0 + BLOCK, max=lq) + (lk - lq)).view(-1, 1)  # one past its last
    step = max(1, _INTERVAL_CHUNK_ELEMENTS // max(1, bx * hx * lk))
    lives, fulls = [], []
    for t0 in range(0, tile_q0.numel(), step):
        p0, p1 = first[t0:t0 + step], stop[t0:t0 + step]
        live_keys = torch.maximum(start, p0) < torch.minimum(end, p1)
        full_keys = (start <= p0) & (p1 <= end)
        lives.append(block_reduce(live_keys, 3, BLOCK, "any"))
        fulls.append(block_reduce(full_keys, 3, BLOCK, "all"))
    return torch.cat(lives, 2), torch.cat(fulls, 2)


def _per_query_head(t, num_heads: int, group: int):
    """A tile map with one entry per kv head -> one per query head (small)."""
    return t if t.shape[1] in (1, num_heads) else t.repeat_interleave(group, dim=1)


def _read_intervals(bounds, num_heads: int, num_kv_heads: int):
    """A function ``(b, h, kv) -> (start, end)`` honouring size-1 dims and per-kv-head bounds."""
    starts, ends = bounds[0], bounds[1]
    bx, hx = starts.shape[0], starts.shape[1]
    group = num_heads // num_kv_heads
    per_kv_head = hx == num_kv_heads and hx != num_heads

    def read(b, h, kv):
        bi = b if bx > 1 else 0
        hi = (h // group if per_kv_head else h) if hx > 1 else 0
        return starts[bi, hi, kv], ends[bi, hi, kv]

    return read


def _build_block_mask(inputs):
    fa = _flex_module()
    lq, lk = inputs.seqlen_q, inputs.seqlen_k
    cache = inputs.cache_seqlens
    intervals = inputs.key_intervals
    # With a per-batch used length the causal diagonal moves per batch: classify tiles from the
    # mask alone (a superset of the live tiles) and let mask_mod decide inside them.
    live, full = _tile_maps(inputs.attn_mask, lq, lk, inputs.is_causal and cache is None,
                            inputs.device)
    if intervals is not None and cache is None:
        # (With cache_seqlens the query positions move per batch; the tiles stay a superset
        # and mask_mod decides, as for the causal diagonal.)
        heads, group = inputs.num_heads, inputs.group_size
        i_live, i_full = _interval_tiles(intervals, lq, lk)
        live = _per_query_head(live.to(inputs.device), heads, group) & _per_query_head(
            i_live, heads, group)
        full = _per_query_head(full.to(inputs.device), heads, group) & _per_query_head(
            i_full, heads, group)
    n_q, n_k = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    if cache is not None:
        # (B, 1, 1, nK): key tiles that start before the used length; nothing is full.
        starts = torch.arange(n_k, device=inputs.device) * BLOCK
        used = (starts < cache.to(torch.int64).view(-1, 1)).view(-1, 1, 1, n_k)
        live = live.to(inputs.device) & used
        full = torch.zeros_like(live)
    if live.shape[1] not in (1, inputs.num_heads):  # per kv head -> per query head (small)
        live = live.repeat_interleave(inputs.group_size, dim=1)
        full = full.repeat_interleave(inputs.group_size, dim=1)
    shape = (live.shape[0], live.shape[1], n_q, n_k)
    full = full.expand(shape).to(inputs.device)
    partial = live.expand(shape).to(inputs.device) & ~full

    offset = lk - lq
    read_mask = (
        _broadcast_index(inputs.attn_mask, inputs.num_heads, inputs.num_kv_heads)
        if inputs.attn_mask is not None
        else None
    )
    read_bounds = (
        _read_intervals(intervals, inputs.num_heads, inputs.num_kv_heads)
        if intervals is not None
        else None
    )
    causal = inputs.is_causal

    if cache is not None:
        n_used = cache.clamp(0, lk)  # clamped: values are unchecked on GPU

        def mask_mod(b, h, q, kv):
            n = n_used[b]
            visible = (kv <= q + (n - lq)) if causal else (kv < n)
            if read_mask is not None:
                visible = visible & read_mask(b, h, q, kv)
            if read_bounds is not None:
                # The query's position is the causal diagonal: q + n - Lq.
                start, end = read_bounds(b, h, kv)
                pos = q + (n - lq)
                visible = visible & (start <= pos) & (pos < end)
            return visible

        return _from_kv_blocks(fa, partial, full, mask_mod, lq, lk, inputs.needs_grad)

    def mask_mod(b, h, q, kv):
        visible = kv <= q + offset if causal else q >= 0
        if read_mask is not None:
            visible = visible & read_mask(b, h, q, kv)
        if read_bounds is not None:
            start, end = read_bounds(b, h, kv)
            pos = q + offset
            visible = visible & (start <= pos) & (pos < end)
        return visible

    return _from_kv_blocks(fa, partial, full, mask_mod, lq, lk, inputs.needs_grad)


def _from_kv_blocks(fa, partial, full, mask_mod, lq, lk, needs_grad):
    def compact(tiles):
        counts = tiles.sum(dim=-1, dtype=torch.int32).contiguous()
        order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts, order.to(torch.int32).contiguous()

    kv_num, kv_idx = compact(partial)
    full_num, full_idx = compact(full)
    kwargs = dict(BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod)
    params = _from_kv_blocks_params()
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (lq, lk)
    if "compute_q_blocks" in params and not needs_grad:
        kwargs["compute_q_blocks"] = False  # the transposed map only serves the backward
    return fa.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kwargs)


def _score_mod(inputs):
    bias, cap = inputs.attn_bias, inputs.softcap
    if bias is None and cap == 0.0:
        return None
    read_bias = _broadcast_index(bias, inputs.num_heads, inputs.num_kv_heads) if bias is not None else None

    def score_mod(score, b, h, q, kv):
        if cap > 0.0:
            score = cap * torch.tanh(score / cap)
        if read_bias is not None:
            score = score + read_bias(b, h, q, kv)
        return score

    return score_mod


# Lighter kernel settings for shapes whose default Flex configs exceed shared memory
# (seen with torch 2.11 on Hopper: head_dim 64 with a full-size captured bias).
_FALLBACK_KERNEL_OPTIONS = {"num_stages": 1, "num_warps": 4}


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def decode_kernel_cannot_tile(seqlen_q: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether Inductor would lower the call to its flex-decoding kernel and find no config.

    Inductor takes the decoding kernel for queries shorter than 128 whose query heads share a
    kv head in a power-of-2 group (and whose block map has one head); that kernel packs the
    group's queries into one row tile of ``BLOCK_M = next_power_of_2(Lq * group)`` rows, and
    skips every config whose Q block (our :data:`BLOCK`) that tile does not divide. With
    ``Lq * group > BLOCK`` no config is left: ``NoValidChoicesError`` at compile time (e.g.
    Lq 100 or 65 with 4 query heads per kv head). Such calls must run the main kernel.
    """
    group = num_heads // max(num_kv_heads, 1)
    if seqlen_q >= 128 or group <= 1 or group & (group - 1):
        return False
    return BLOCK % _next_power_of_2(seqlen_q * group) != 0


def kernel_options_for(inputs, light: bool) -> Optional[dict]:
    """The ``kernel_options`` of a compiled call (None: Flex's defaults): the main kernel
    where the decoding kernel has no config (:func:`decode_kernel_cannot_tile`), and the
    lighter settings when ``light``."""
    options = {}
    if decode_kernel_cannot_tile(inputs.seqlen_q, inputs.num_heads, inputs.num_kv_heads):
        options["FORCE_USE_FLEX_ATTENTION"] = True
    if light:
        options.update(_FALLBACK_KERNEL_OPTIONS)
    return options or None


def _run_compiled(q, k, v, kwargs, options: Optional[dict]):
    with torch._dynamo.config.patch(cache_size_limit=_RECOMPILE_LIMIT):
        try:
            return _compiled_flex()(q, k, v, kernel_options=options, **kwargs)
        except Exception as exc:  # inductor wraps the resource error in its own types
            if "out of resource" not in str(exc) and "No valid triton configs" not in str(exc):
                raise
            lighter = dict(options or {}, **_FALLBACK_KERNEL_OPTIONS)
            return _compiled_flex()(q, k, v, kernel_options=lighter, **kwargs)


class FlexBackend(Backend):
    name = "flex"


    def probe(self) -> Optional[str]:
        if _TORCH_VERSION < (2, 5):
            return f"FlexAttention needs torch >= 2.5, found {torch.__version__}"
        try:
            _flex_module()
        except ImportError as exc:
            return f"torch.nn.attention.flex_attention cannot be imported: {exc}"
        return None

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def not_supported_reasons(self, inputs) -> List[str]:
        reasons = []
        if inputs.block_table is not None:
            # FlexAttention reads K/V as (B, Hkv, Lk, D) tensors; pages would need a gather.
            reasons.append(
                "paged KV (block_table) is not supported by flex; use triton or torch-reference"
            )
        dev = inputs.device.type
        if dev not in ("cuda", "cpu"):
            reasons.append(f"device type {dev!r} is not supported (cuda, cpu)")
        if dev == "cpu" and inputs.needs_grad:
            reasons.append("FlexAttention has no backward pass on CPU")
        if dev == "cuda":
            if inputs.dtype == torch.float64:
                reasons.append("float64 is not supported on CUDA")
            if inputs.head_dim < 16:
                reasons.append(f"head_dim {inputs.head_dim} < 16 (Flex's Triton tiles need >= 16)")
            bias = inputs.attn_bias
            if inputs.bias_needs_grad and bias.shape[2] == 1 and bias.shape[3] == 1:
                # Its gradient is scattered to an address that depends on neither the query nor
                # the key block, which Inductor's Flex backward template fails to compile (a
                # scalar index broadcast to a 2-D tile); found at run time, after the forward.
                reasons.append("the gradient of a bias broadcast over both queries and keys: "
                               "Inductor cannot compile Flex's backward for it")
        if inputs.bias_needs_grad and _TORCH_VERSION < (2, 6):
            reasons.append(f"bias gradients need torch >= 2.6 (found {torch.__version__})")
        if inputs.deterministic and inputs.bias_needs_grad:
            reasons.append("the bias gradient uses atomics: deterministic=True is not possible")
        if inputs.return_attn_probs:
            reasons.append("return_attn_probs is not supported")
        if inputs.dropout_p > 0.0:
            reasons.append("attention dropout is not supported by FlexAttention")
        if inputs.seqlen_q == 0 or inputs.seqlen_k == 0:
            reasons.append("empty sequences are not supported")
        return reasons

    def attention(self, inputs):
        fa = _flex_module()
        q = inputs.query.transpose(1, 2)
        k = inputs.key.transpose(1, 2)
        v = inputs.value.transpose(1, 2)
        kwargs = dict(
            score_mod=_score_mod(inputs),
            block_mask=_block_mask(inputs),
            scale=inputs.softmax_scale,
            enable_gqa=inputs.num_heads != inputs.num_kv_heads,
        )
        if torch.compiler.is_compiling():
            # The enclosing compile fuses it.
            out = fa.flex_attention(q, k, v, kernel_options=kernel_options_for(inputs, False),
                                    **kwargs)
        elif inputs.device.type == "cuda":
            # A per-query bias gradient is scattered from the backward kernel, whose default
            # configs then overflow shared memory (torch 2.11 on Hopper); the backward compiles
            # lazily, so it cannot be retried: choose the lighter settings up front.
            bias = inputs.attn_bias
            light = inputs.bias_needs_grad and bias.shape[2] > 1
            try:
                out = _run_compiled(q, k, v, kwargs, kernel_options_for(inputs, light))
            except Exception as exc:
                if not registry.is_compile_failure(exc):
                    raise
                # Nothing was computed: calls like this one are declined from now on (also
                # when flex is asked for by name), and auto-dispatch runs the next backend.
                reason = registry.failure_reason(exc)
                registry.remember_decline(self.name, inputs, reason)
                raise BackendDeclined(self.name, reason) from exc
        else:
            with warnings.catch_warnings():
                # On CPU the eager path is the intended one; its advice to compile is noise.
                warnings.filterwarnings("ignore", message="flex_attention called without")
                out = fa.flex_attention(q, k, v, **kwargs)
        return out.transpose(1, 2)
