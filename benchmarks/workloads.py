"""The benchmark workloads: shapes per suite (full and ``--quick``) and their inputs.

Every workload uses the flash_dmattn layout: ``q (B, Lq, H, D)``, ``k, v (B, Lk, Hkv, D)``,
a bool mask and a float bias broadcastable to ``(B, H or Hkv, Lq, Lk)``. Masks are built once
per workload, outside every timed region.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import List, Optional

import torch

from flash_dmattn.utils.mask import create_mask

# The suites whose workloads are plain :class:`Workload` rows built by :func:`build_case`; the
# others (varlen, dma_long, cp) have their own workload types and runners (see ``suites``).
CORE_SUITES = ("dense", "dynamic", "block_sparse", "upstream", "decode")


@dataclass(frozen=True)
class Workload:
    """One problem shape and the kind of mask / bias it carries.

    ``mask`` is one of ``"none"``, ``"topk-per-query"`` (top-``window`` keys of a per-key bias
    among each query's causally visible keys, ``(B, Hkv, Lq, Lk)``), ``"blocks-per-key"``
    (``density`` of the ``block``-key blocks live, ``(B, 1, 1, Lk)``), ``"topk-per-key"``
    (top-``window`` of a per-key bias, ``(B, Hkv, 1, Lk)``) or ``"relu-per-key"`` (keys whose
    per-key bias is positive, ``(B, Hkv, 1, Lk)``).

    ``cache_fill`` (decode): K/V are a cache of capacity ``seqlen_k`` of which the first
    ``round(cache_fill * seqlen_k)`` keys are used (``cache_seqlens``); FLOPs and bytes count
    the used keys only.
    """

    suite: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    mask: str = "none"
    bias: bool = False
    window: Optional[int] = None
    block: Optional[int] = None
    density: Optional[float] = None
    forward_only: bool = False
    cache_fill: Optional[float] = None

    @property
    def used_k(self) -> int:
        """Keys that take part: the used cache length, or all of ``seqlen_k``."""
        if self.cache_fill is None:
            return self.seqlen_k
        return max(1, round(self.cache_fill * self.seqlen_k))

    @property
    def name(self) -> str:
        """A readable one-line label, unique within a run."""
        heads = f"H{self.heads}" if self.heads == self.kv_heads else f"H{self.heads}/{self.kv_heads}"
        length = f"L{self.seqlen_k}" if self.seqlen_q == self.seqlen_k else f"Lq{self.seqlen_q} Lk{self.seqlen_k}"
        parts = [self.suite, f"B{self.batch}", heads, length, f"D{self.head_dim}"]
        parts.append(self.mask_label)
        parts.append("causal" if self.causal else "non-causal")
        if self.cache_fill is not None:
            parts.append(f"cache {round(100 * self.cache_fill)}% used")
        return " ".join(p for p in parts if p)

    @property
    def short(self) -> str:
        """A compact label for plot axes."""
        length = f"L{self.seqlen_k}" if self.seqlen_q == self.seqlen_k else f"Lk{self.seqlen_k}"
        tags = [length, f"D{self.head_dim}"]
        if self.mask != "none" or self.bias:
            tags.append(self.mask_label)
        if self.seqlen_q == self.seqlen_k:
            tags.append("c" if self.causal else "nc")
        if self.cache_fill is not None:
            tags.append(f"cache{round(100 * self.cache_fill)}%")
        return " ".join(tags)

    @property
    def mask_label(self) -> str:
        if self.mask == "topk-per-query":
            return f"top-{self.window}/query+bias"
        if self.mask == "blocks-per-key":
            return f"{round(100 * self.density)}%-of-{self.block}-key-blocks"
        if self.mask == "topk-per-key":
            return f"window{self.window}+bias"
        if self.mask == "relu-per-key":
            return "mask+bias"
        return "bias" if self.bias else ""

    @property
    def has_mask_or_bias(self) -> bool:
        return self.mask != "none" or self.bias

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def flops_fwd(self) -> float:
        """Nominal forward FLOPs: ``4·B·H·Lq·Lk·D``, halved when causal; sparsity ignored."""
        flops = 4.0 * self.batch * self.heads * self.seqlen_q * self.used_k * self.head_dim
        return flops / 2 if self.causal else flops

    def flops_fwd_bwd(self) -> float:
        """Nominal forward+backward FLOPs: the backward counts as 2.5 forwards."""
        return 3.5 * self.flops_fwd()

    def io_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, plus the per-key mask and bias when present (decode bandwidth).

        Only the used keys count (``used_k``): with a part-filled cache that is all a decode
        kernel needs to read.
        """
        elem = torch.finfo(dtype).bits // 8
        n = self.used_k
        kv = 2 * self.batch * n * self.kv_heads * self.head_dim * elem
        extra = 0
        if self.mask != "none":
            extra += self.batch * self.kv_heads * n  # bool: one byte a key
        if self.bias:
            extra += self.batch * self.kv_heads * n * elem
        return kv + extra

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


@dataclass
class Case:
    """A workload's tensors on one device: the inputs every implementation is timed on."""

    workload: Workload
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    grad_out: torch.Tensor
    cache_seqlens: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.q.device

    def used_prefix(self) -> "Case":
        """The same problem with K/V (and mask/bias) sliced to the used cache length (views).

        Baselines that know nothing of ``cache_seqlens`` run this: it is what a model without
        it would do (slice the cache), and it gives the same output.
        """
        w = self.workload
        if w.cache_fill is None:
            return self
        n = w.used_k

        def keys(t, dim):
            return t if t is None or t.size(dim) == 1 else t.narrow(dim, 0, n)

        sliced = replace(w, seqlen_k=n, cache_fill=None)
        return Case(sliced, self.q, keys(self.k, 1), keys(self.v, 1), keys(self.mask, -1),
                    keys(self.bias, -1), self.grad_out, None)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype


def _dense(L: int, D: int, causal: bool, heads: int) -> Workload:
    return Workload("dense", 1, heads, heads, L, L, D, causal)


def core_workloads(suite: str, quick: bool) -> List[Workload]:
    """The workloads of ``suite`` (one of :data:`CORE_SUITES`); tiny shapes when ``quick``."""
    if suite == "dense":
        if quick:
            # One head dim per length keeps the CPU smoke run short and still covers both loops.
            return [_dense(L, D, c, 4) for L, D in ((256, 32), (512, 64)) for c in (True, False)]
        return [_dense(L, D, c, 16) for L in (4096, 16384) for D in (64, 128) for c in (True, False)]
    if suite == "dynamic":
        if quick:
            return [Workload("dynamic", 1, 4, 2, 512, 512, 64, True, "topk-per-query", True, window=128)]
        return [Workload("dynamic", 1, 16, 4, 8192, 8192, 128, True, "topk-per-query", True, window=2048)]
    if suite == "block_sparse":
        if quick:
            # 32-key blocks so that 10% of a 512-key sequence is still more than one block.
            return [Workload("block_sparse", 1, 4, 4, 512, 512, 64, True, "blocks-per-key", block=32, density=0.1)]
        return [
            Workload("block_sparse", 1, 16, 16, 32768, 32768, 128, True, "blocks-per-key", block=128, density=0.1)
        ]
    if suite == "upstream":
        lengths, window = ((256, 512), 64) if quick else ((4096, 8192, 16384, 32768), 1024)
        return [
            Workload("upstream", 1, 2, 1, L, L, 64, True, "topk-per-key", True, window=window)
            for L in lengths
        ]
    if suite == "decode":
        if quick:
            lengths, heads, kv_heads, dim = (256, 512), 4, 2, 64
        else:
            lengths, heads, kv_heads, dim = (4096, 32768, 131072, 524288), 32, 8, 128
        out = []
        for L in lengths:
            dims = dict(heads=heads, kv_heads=kv_heads, head_dim=dim)
            out.append(decode_workload(1, L, False, **dims))
            out.append(decode_workload(1, L, True, **dims))
            # A KV cache half full (cache_seqlens): only the used half should be read.
            out.append(decode_workload(1, L, True, 0.5, **dims))
        if not quick:
            # Batched decoding (the B 8 / 64): enough (batch, kv head) pairs to fill
            # the GPU without splitting keys. Caches up to 8 GiB of K+V.
            for B, lengths_b in ((8, (4096, 32768, 131072)), (64, (4096, 32768))):
                for L in lengths_b:
                    out.append(decode_workload(B, L, False, heads=heads, kv_heads=kv_heads, head_dim=dim))
                    out.append(decode_workload(B, L, True, heads=heads, kv_heads=kv_heads, head_dim=dim))
        return out
    raise ValueError(f"unknown suite {suite!r}; expected one of {', '.join(CORE_SUITES)}")


def causal_visibility(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """``(1, 1, Lq, Lk)`` bool: key j visible to query i iff ``j <= i + Lk - Lq`` (bottom-right)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return (j <= i + (seqlen_k - seqlen_q))[None, None]


def decode_workload(batch: int, seqlen_k: int, masked: bool, cache_fill: Optional[float] = None,
                    heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> Workload:
    """One decode row: one query against ``seqlen_k`` keys, not causal (with Lq = 1 a
    bottom-right causal mask hides nothing, and SDPA's top-left one would hide every key but
    the first). ``masked``: the per-key relu mask and bias (about half the keys live)."""
    return Workload("decode", batch, heads, kv_heads, 1, seqlen_k, head_dim, False,
                    "relu-per-key" if masked else "none", masked, forward_only=True,
                    cache_fill=cache_fill)


def build_case(w: Workload, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    """Random inputs for ``w``; masks and biases are built here, outside any timed region."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    B, Lq, Lk = w.batch, w.seqlen_q, w.seqlen_k
    q = randn(B, Lq, w.heads, w.head_dim)
    k = randn(B, Lk, w.kv_heads, w.head_dim)
    v = randn(B, Lk, w.kv_heads, w.head_dim)
    grad_out = randn(B, Lq, w.heads, w.head_dim)
    bias = randn(B, w.kv_heads, 1, Lk) if w.bias else None
    min_dtype = torch.finfo(dtype).min

    if w.mask == "none":
        mask = None
    elif w.mask == "topk-per-query":
        # Candidates are the causally visible keys, so every query keeps `window` keys it
        # could actually see (or all of them, early in the sequence).
        visible = causal_visibility(Lq, Lk, device)
        mask = create_mask(bias, visible, B, Lq, Lk, w.window, min_dtype)
        del visible
    elif w.mask == "topk-per-key":
        mask = create_mask(bias, None, B, Lq, Lk, w.window, min_dtype)
    elif w.mask == "relu-per-key":
        # About half the keys, scattered: no tile is entirely dead, so a decode row measures
        # bandwidth rather than how many tiles a backend manages to skip.
        mask = create_mask(bias, None, B, Lq, Lk, Lk, min_dtype, type="relu")
    elif w.mask == "blocks-per-key":
        num_blocks = -(-Lk // w.block)
        live_count = max(1, round(w.density * num_blocks))
        # Block 0 is always live so every causal query has at least one visible key: fully
        # masked rows are legal for flash_dmattn but NaN for an SDPA additive mask.
        others = torch.randperm(num_blocks - 1, device=device, generator=gen)[: live_count - 1] + 1
        live = torch.zeros(num_blocks, dtype=torch.bool, device=device)
        live[0] = True
        live[others] = True
        mask = live.repeat_interleave(w.block)[:Lk].view(1, 1, 1, Lk).expand(B, 1, 1, Lk).contiguous()
    else:
        raise ValueError(f"unknown mask kind {w.mask!r}")
    cache_seqlens = None
    if w.cache_fill is not None:
        cache_seqlens = torch.full((B,), w.used_k, dtype=torch.int32, device=device)
    return Case(w, q, k, v, mask, bias, grad_out, cache_seqlens)
