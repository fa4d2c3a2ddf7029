"""The implementations compared: flash_dmattn backends and the baselines.

Each implementation takes ``(q, k, v, mask, bias)`` in its own layout (flash_dmattn's
``(B, L, H, D)`` or SDPA/Flex's heads-first ``(B, H, L, D)``, see :attr:`Impl.heads_first`)
and returns the attention output in that layout. The driver (:mod:`benchmarks.run`) builds
the inputs, times forward and forward+backward, and compares the outputs with a float32
reference.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from flash_dmattn import flash_dmattn_func_auto

from .workloads import Case, Workload, causal_visibility

_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_HAS_ENABLE_GQA = _TORCH_VERSION >= (2, 5)

# On GPU the plain-PyTorch oracle is O(Lq·Lk) memory traffic per call; beyond 4096² its
# timing says nothing useful and it takes minutes.
REFERENCE_MAX_WORK_GPU = 4096 * 4096

# Fraction of device memory a materialised (B, H, Lq, Lk) mask may take before the
# materialised-SDPA baseline is skipped.
MATERIALISED_MEMORY_FRACTION = 0.4


class Declined(Exception):
    """The implementation cannot run these inputs (flash_dmattn's ValueError, or a known limit)."""


class Skipped(Exception):
    """The benchmark chose not to run this implementation here (too slow, too much memory)."""


@dataclass
class RunContext:
    """What every implementation may need to know about the run."""

    device: torch.device
    dtype: torch.dtype
    quick: bool
    memory_bytes: int  # device memory (GPU) or physical RAM (CPU)
    backward: bool
    skip: tuple = ()  # implementations whose name contains one of these are left out

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Impl:
    """One way of computing a workload's attention.

    Attributes:
        name: the ``impl`` column.
        kind: ``"flash_dmattn"`` or ``"baseline"``.
        heads_first: inputs are ``(B, H, L, D)`` instead of ``(B, L, H, D)``.
        computes_workload: the output is the workload's attention (mask and bias included),
            so comparing it with the reference makes sense.
        uses_bias: the bias is an input (and receives a gradient in forward+backward).
        speedup_baseline: the row every row of the workload is compared with.
        takes_cache_seqlens: runs a part-filled KV cache through ``cache_seqlens``; the others
            get K/V sliced to the used length (:meth:`Case.used_prefix`).
    """

    name = ""
    kind = "baseline"
    takes_cache_seqlens = False
    heads_first = False
    computes_workload = True
    uses_bias = True
    speedup_baseline = False

    def __init__(self) -> None:
        self.notes: List[str] = []
        self.workload: Optional[Workload] = None

    def setup(self, case: Case, ctx: RunContext) -> None:
        """Prepare for ``case`` outside the timed region; raise Skipped / Declined to opt out."""
        self.workload = case.workload

    def backward_skip_reason(self, ctx: RunContext) -> Optional[str]:
        """Why forward+backward is not run (None = it is)."""
        return None

    def can_fall_back(self) -> bool:
        """Whether a RuntimeError on first call may be retried with a more general kernel."""
        return False

    def fall_back(self, reason: str) -> str:
        """Switch to the general kernel; return the note that says so."""
        raise NotImplementedError

    def __call__(self, q, k, v, mask, bias):
        raise NotImplementedError


def _short_decline(exc: Exception) -> str:
    # "backend 'flex' cannot run these inputs (<long description>): <reasons>" -> "<reasons>"
    msg = str(exc)
    marker = "cannot run these inputs ("
    if marker in msg and "): " in msg.split(marker, 1)[1]:
        return msg.split(marker, 1)[1].split("): ", 1)[1]
    return msg


class FlashDmattn(Impl):
    """``flash_dmattn_func_auto(backend)``: one flash_dmattn backend, no fallback; ``None``:
    auto-dispatch (``flash_dmattn[auto]``, its notes name the backend it picks)."""

    kind = "flash_dmattn"
    takes_cache_seqlens = True

    def __init__(self, backend: Optional[str]) -> None:
        super().__init__()
        self.backend = backend
        self.name = f"flash_dmattn[{backend or 'auto'}]"
        self.fn = flash_dmattn_func_auto(backend)

    def setup(self, case: Case, ctx: RunContext) -> None:
        super().setup(case, ctx)
        self.cache_seqlens = case.cache_seqlens
        w = case.workload
        runs = self.backend
        if runs is None:
            runs = auto_picks(case, ctx.backward and not w.forward_only)
            self.notes.append("auto-dispatch picks " + " / ".join(
                f"{name} ({mode})" for mode, name in runs.items()))
            runs = runs["fwd"]
        if runs == "torch-reference" and ctx.cuda and not ctx.quick:
            if w.seqlen_q * w.seqlen_k > REFERENCE_MAX_WORK_GPU:
                raise Skipped("torch-reference is plain PyTorch (O(Lq·Lk) traffic); not timed on GPU for L > 4096")

    def __call__(self, q, k, v, mask, bias):
        try:
            return self.fn(
                q, k, v, attn_mask=mask, attn_bias=bias, is_causal=self.workload.causal,
                cache_seqlens=self.cache_seqlens,
            )
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None


def auto_picks(case: Case, backward: bool) -> dict:
    """``{"fwd": backend, "fwd+bwd": backend}``: what auto-dispatch runs for ``case`` without
    and (``backward``) with gradients of q, k, v and the bias."""
    from flash_dmattn import registry
    from flash_dmattn.inputs import AttentionInputs

    picks = {}
    for mode, grad in (("fwd", False), ("fwd+bwd", True)):
        if grad and not backward:
            continue
        q, k, v, bias = (None if t is None else t.detach().requires_grad_(grad)
                         for t in (case.q, case.k, case.v, case.bias))
        inputs = AttentionInputs.from_args(q, k, v, case.mask, bias, None, case.workload.causal,
                                           cache_seqlens=case.cache_seqlens)
        picks[mode] = registry.auto_backend_name(inputs) or "none"
    return picks


# Paged decode rows: the page size of vLLM-style caches, pages in a shuffled order.
PAGED_PAGE_SIZE = 64


def shuffled_page_pools(k: torch.Tensor, v: torch.Tensor, page: int):
    """``(k_pool, v_pool, block_table)``: K/V ``(B, Lk, Hkv, D)`` (``Lk`` a multiple of
    ``page``) copied into pools of ``page``-key pages laid out in a shuffled order (seed 0),
    and the int32 ``(B, Lk // page)`` table that maps each batch's logical pages to them."""
    B, Lk, Hkv, D = k.shape
    pages = Lk // page
    perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(0)).to(k.device)
    k_pool = k.new_empty(B * pages, page, Hkv, D)
    v_pool = v.new_empty(B * pages, page, Hkv, D)
    k_pool[perm] = k.reshape(B * pages, page, Hkv, D)
    v_pool[perm] = v.reshape(B * pages, page, Hkv, D)
    return k_pool, v_pool, perm.view(B, pages).to(torch.int32)


class FlashDmattnPaged(FlashDmattn):
    """``FlashDmattn`` on a paged KV cache (``block_table``): decode workloads, forward only.

    :meth:`setup` copies the case's K/V into page pools of :data:`PAGED_PAGE_SIZE` keys whose
    pages lie in a shuffled order (outside the timed region); each call then reads the pools
    through the block table instead of the contiguous K/V it is handed (same values, so the
    output is compared with the same reference).
    """

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.name = f"flash_dmattn[{backend}] paged{PAGED_PAGE_SIZE}"

    def setup(self, case: Case, ctx: RunContext) -> None:
        super().setup(case, ctx)
        Lk = case.k.shape[1]
        page = PAGED_PAGE_SIZE
        if Lk % page:
            raise Declined(f"Lk {Lk} is not a multiple of the page size {page}")
        self.k_pool, self.v_pool, self.block_table = shuffled_page_pools(case.k, case.v, page)
        self.notes.append(f"paged KV: {page}-key pages in shuffled order")

    def backward_skip_reason(self, ctx: RunContext) -> Optional[str]:
        return "paged KV runs forward only"

    def __call__(self, q, k, v, mask, bias):
        try:
            return self.fn(
                q, self.k_pool, self.v_pool, attn_mask=mask, attn_bias=bias,
                is_causal=self.workload.causal, cache_seqlens=self.cache_seqlens,
                block_table=self.block_table,
            )
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None


def _sdpa(q, k, v, causal: bool, attn_mask=None):
    """SDPA on heads-first tensors, with native GQA where torch has it."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        if _HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=True)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)


class SdpaKernelChoice:
    """What the SDPA impls share (this file's :class:`Sdpa`, varlen.py's ``SdpaPadded``): a
    ``kernel``, an ``SDPBackend`` to pin or None for PyTorch's own choice, given up for the
    default choice (with a note) when it cannot run the shape. A mixin, listed before the
    :class:`Impl` base."""

    kernel = None

    def can_fall_back(self) -> bool:
        return self.kernel is not None

    def fall_back(self, reason: str) -> str:
        label = str(self.kernel).split(".")[-1]
        self.kernel = None
        return f"{label} unsupported here ({reason}); ran PyTorch's default SDPA kernel"

    def _run_sdpa(self, q, k, v, causal: bool, attn_mask=None):
        if self.kernel is None:
            return _sdpa(q, k, v, causal, attn_mask=attn_mask)
        from torch.nn.attention import sdpa_kernel

        # The kernel is fixed at forward time; autograd replays the matching backward
        # outside the context, so only the forward needs to be inside it.
        with sdpa_kernel([self.kernel]):
            return _sdpa(q, k, v, causal, attn_mask=attn_mask)


class Sdpa(SdpaKernelChoice, Impl):
    """Dense ``F.scaled_dot_product_attention`` (no mask, no bias), optionally pinned to one kernel.

    ``kernel`` is an ``SDPBackend`` (CUDA) or None for PyTorch's own choice. When the pinned
    kernel cannot run the shape, the first call fails and the driver falls back to the default
    choice, with a note. On a workload that has a mask or bias this row ignores them: it is
    the dense causal reference point for the speedup column, not a correct answer.
    """

    heads_first = True

    def __init__(self, name: str, kernel=None, speedup_baseline: bool = False) -> None:
        super().__init__()
        self.name = name
        self.kernel = kernel
        self.speedup_baseline = speedup_baseline

    def setup(self, case: Case, ctx: RunContext) -> None:
        super().setup(case, ctx)
        if case.workload.has_mask_or_bias:
            self.computes_workload = False
            self.uses_bias = False
            self.notes.append("dense: ignores the mask and bias (speedup reference only)")
        if case.workload.heads != case.workload.kv_heads and not _HAS_ENABLE_GQA:
            self.notes.append("K/V repeated to H heads (torch < 2.5 has no enable_gqa)")

    def __call__(self, q, k, v, mask, bias):
        return self._run_sdpa(q, k, v, self.workload.causal)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _five_d(t: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """A 4-D mask/bias as ``(B, Hkv or 1, g or 1, Q, K)``: query head h = kv * g + member."""
    if t.shape[1] == heads and heads != kv_heads:
        return t.unflatten(1, (kv_heads, heads // kv_heads))
    return t.unsqueeze(2)


class SdpaMaterialised(Impl):
    """SDPA with the full ``(B, H, Lq, Lk)`` additive mask: bias + (-inf where masked).

    This is what a model does today without flash_dmattn (transformers' eager/SDPA paths):
    the mask is rebuilt from the (trainable) bias on every step, inside the timed region, and
    K/V are repeated to H heads because transformers does that whenever a mask is given.
    Causality and the bool mask are folded into the additive mask (SDPA forbids
    ``attn_mask`` with ``is_causal``). Queries with no visible key give NaN here.
    """

    name = "sdpa+materialised-mask"
    heads_first = True

    def setup(self, case: Case, ctx: RunContext) -> None:
        super().setup(case, ctx)
        w = case.workload
        elem = torch.finfo(case.dtype).bits // 8
        full = w.batch * w.heads * w.seqlen_q * w.seqlen_k * elem
        limit = MATERIALISED_MEMORY_FRACTION * ctx.memory_bytes
        if full > limit:
            raise Skipped(
                f"the (B,H,Lq,Lk) mask needs {_size(full)} > "
                f"{MATERIALISED_MEMORY_FRACTION:.0%} of {_size(ctx.memory_bytes)}"
            )
        # The bool visibility is an input like the mask itself, so it is combined once here;
        # it stays in its broadcast shape (never per query head).
        visible = None
        if case.mask is not None:
            visible = _five_d(case.mask, w.heads, w.kv_heads)
        if w.causal:
            causal = causal_visibility(w.seqlen_q, w.seqlen_k, case.device).unsqueeze(2)
            visible = causal if visible is None else visible & causal
        self.visible = visible
        self.zero = torch.zeros((), dtype=case.dtype, device=case.device)
        self.neg_inf = torch.full((), float("-inf"), dtype=case.dtype, device=case.device)
        self.notes.append("mask built inside the timed region")
        if w.group > 1:
            self.notes.append("K/V repeated to H heads")

    def __call__(self, q, k, v, mask, bias):
        w = self.workload
        B, H, Hkv, g = w.batch, w.heads, w.kv_heads, w.group
        shape5 = (B, Hkv, g, w.seqlen_q, w.seqlen_k)
        add = self.zero if bias is None else _five_d(bias, H, Hkv)
        if self.visible is not None:
            add = torch.where(self.visible, add, self.neg_inf)
        # expand + reshape copies whatever is still broadcast: the full per-head mask.
        full = add.expand(shape5).reshape(B, H, w.seqlen_q, w.seqlen_k)
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full)


def _reader(t: torch.Tensor, heads: int, kv_heads: int):
    """``(b, h, q, kv) -> t[...]`` honouring size-1 dims and per-kv-head tensors (for Flex mods)."""
    tb, th, tq, tk = t.shape
    group = heads // kv_heads
    per_kv_head = th == kv_heads and th != heads

    def read(b, h, q, kv):
        head = (h // group if per_kv_head else h) if th > 1 else 0
        return t[b if tb > 1 else 0, head, q if tq > 1 else 0, kv if tk > 1 else 0]

    return read


def _bias_score_mod(bias: torch.Tensor, heads: int, kv_heads: int):
    """A Flex ``score_mod`` adding ``bias`` (broadcast-aware, per-kv-head aware)."""
    read_bias = _reader(bias, heads, kv_heads)

    def score_mod(score, b, h, q, kv):
        return score + read_bias(b, h, q, kv)

    return score_mod


_compiled_flex = None


def _flex_fn(compiled: bool):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        # dynamic=False: each workload has fixed shapes; automatic dynamic shapes would
        # compile a slower, shape-generic kernel after the second workload.
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexCalls:
    """What the impls calling ``flex_attention`` directly share (this file's :class:`FlexDirect`,
    varlen.py's ``FlexDocument``); a mixin, listed before their :class:`Impl` base.

    Compiled on CUDA, which takes power-of-two head dims >= 16; on CPU eager and forward only
    (FlexAttention has no CPU backward).
    """

    compiled: bool
    block_mask = None

    def _flex_setup(self, head_dim: int, ctx: RunContext) -> None:
        """Declines the head dims compiled Flex does not take; picks the compiled or eager call."""
        if ctx.cuda and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise Declined(f"head_dim {head_dim} is not a power of two >= 16")
        self.fn = _flex_fn(self.compiled)

    def _eager_note(self) -> None:
        if not self.compiled:
            self.notes.append("eager (not compiled) on CPU")

    def backward_skip_reason(self, ctx: RunContext) -> Optional[str]:
        return None if ctx.cuda else "FlexAttention has no backward on CPU"

    def _flex(self, q, k, v, score_mod):
        w = self.workload
        with warnings.catch_warnings():
            # The eager CPU path is chosen deliberately; Flex's advice to compile is noise.
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return self.fn(
                q, k, v, score_mod=score_mod, block_mask=self.block_mask, enable_gqa=w.heads != w.kv_heads
            )


class FlexDirect(FlexCalls, Impl):
    """``flex_attention`` called directly: a BlockMask from ``create_block_mask`` and a bias ``score_mod``.

    The BlockMask is built once in :meth:`setup`, outside the timed region (flash_dmattn's
    flex backend builds its block map inside every call). Compiled on CUDA; on CPU it runs
    eagerly, forward only (FlexAttention has no CPU backward).
    """

    heads_first = True

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.name = "flex-direct" + ("" if compiled else " (eager)")

    def setup(self, case: Case, ctx: RunContext) -> None:
        super().setup(case, ctx)
        from torch.nn.attention.flex_attention import create_block_mask

        w = case.workload
        self._flex_setup(w.head_dim, ctx)
        self.block_mask = None
        if case.mask is not None or w.causal:
            read_mask = _reader(case.mask, w.heads, w.kv_heads) if case.mask is not None else None
            offset, causal = w.seqlen_k - w.seqlen_q, w.causal

            def mask_mod(b, h, q, kv):
                visible = kv <= q + offset if causal else kv >= 0
                if read_mask is not None:
                    visible = visible & read_mask(b, h, q, kv)
                return visible

            mb, mh = (case.mask.shape[0], case.mask.shape[1]) if case.mask is not None else (1, 1)
            self.block_mask = create_block_mask(
                mask_mod,
                B=mb if mb > 1 else None,
                H=w.heads if mh > 1 else None,  # per-kv-head masks become per query head
                Q_LEN=w.seqlen_q,
                KV_LEN=w.seqlen_k,
                device=case.device,
                _compile=ctx.cuda,
            )
            self.notes.append("BlockMask built outside the timed region")
        self._eager_note()

    def __call__(self, q, k, v, mask, bias):
        w = self.workload
        # Built per call so it captures this call's bias tensor (the one that needs grad).
        score_mod = _bias_score_mod(bias, w.heads, w.kv_heads) if bias is not None else None
        return self._flex(q, k, v, score_mod)


def implementations(w: Workload, ctx: RunContext, backends: List[str]) -> List[Impl]:
    """The implementations to run on ``w``: the given flash_dmattn backends, then the baselines."""
    impls: List[Impl] = [FlashDmattn(b) for b in backends]
    if len(backends) > 1:
        # Auto-dispatch beside the backends it chooses from (the report compares it with the
        # fastest of them, report.auto_digest).
        impls.insert(0, FlashDmattn(None))
    if w.suite == "decode" and "triton" in backends:
        impls.append(FlashDmattnPaged("triton"))
    dense_suffix = (" (dense causal)" if w.causal else " (dense)") if w.has_mask_or_bias else ""
    if ctx.cuda:
        from torch.nn.attention import SDPBackend

        impls.append(Sdpa("sdpa-cudnn" + dense_suffix, SDPBackend.CUDNN_ATTENTION, speedup_baseline=True))
        if not w.has_mask_or_bias:
            impls.append(Sdpa("sdpa-flash", SDPBackend.FLASH_ATTENTION))
    else:
        impls.append(Sdpa("sdpa" + dense_suffix, None, speedup_baseline=True))
    if w.has_mask_or_bias:
        impls.append(SdpaMaterialised())
    impls.append(FlexDirect(compiled=ctx.cuda))
    return [i for i in impls if not any(part in i.name for part in ctx.skip)]
