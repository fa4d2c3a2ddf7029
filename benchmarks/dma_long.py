"""The ``dma_long`` suite: Dynamic Mask Attention on long sequences with a key-interval mask.

Each attention workload is B1 H16/Hkv4 D128 (bf16 on a GPU) with a random per-key bias
``(B, Hkv, 1, L)`` (a gradient leaf in forward+backward) and a top-W key selection made from
it by :func:`flash_dmattn.utils.mask.topk_intervals`, as a :class:`flash_dmattn.KeyIntervals`:

* ``shared top-W``: ``topk_intervals(bias, W, is_causal=False)``, the same W keys for every
  query (attention itself is causal);
* ``causal top-W/query``: ``topk_intervals(bias, W, is_causal=True)``, each query keeps the W
  best keys of its causal prefix.

Rows of an attention workload:

* ``topk_intervals (selection)``: the selection build alone (forward column; no gradient);
* ``flash_dmattn[auto]`` (``flash_dmattn_func``, auto-dispatch) and ``flash_dmattn[<b>]`` for
  each backend of ``--backends`` (default ``triton``): attention with the KeyIntervals mask
  and the bias, causal; the intervals are built once, outside the timed region;
* ``sdpa-cudnn (dense causal)``: dense causal SDPA of the same shape (no mask, no bias), the
  point the DMA rows want to beat;
* ``sdpa-cudnn (selected keys only)``: SDPA of the L queries against the W selected keys
  gathered out of K/V (no mask, not causal): the cost of attending to W keys per query with
  nothing else to do, i.e. the limit a sparse kernel approaches.

Layer workloads time one training step (forward + backward) of
:class:`flash_dmattn.DynamicMaskAttention` against a dense layer with the same q/k/v/o
projections that calls causal SDPA.

The cuDNN rows try, in order: cuDNN with ``enable_gqa=True``; cuDNN with K/V repeated to H
heads (copies made outside the timed region); FLASH_ATTENTION with ``enable_gqa``; PyTorch's
default. The first that runs the row's forward and backward is kept and the note says why
the earlier ones did not.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from flash_dmattn import AttentionInputs, flash_dmattn_func_auto, get_available_backends, registry

from . import report
from .impls import REFERENCE_MAX_WORK_GPU, Declined, Impl, RunContext, Skipped, _short_decline
from .measure import GRAD_NAMES, REFERENCE_CHECK_MAX_WORK, derive_rates, run_suite_workload, time_impl
from .report import ERROR, OK, Row
from .workloads import Workload

try:  # public home of the selection helper
    from flash_dmattn.utils.mask import topk_intervals
except ImportError:
    try:  # where it is implemented
        from flash_dmattn.planning.selection import topk_intervals
    except ImportError:  # pragma: no cover  (a tree without it: the workloads say so)
        topk_intervals = None

SUITE = "dma_long"
SEED = 0
# Long rows take tens to hundreds of milliseconds a call: a time budget alone would time
# them once or twice, so every row gets at least this many timed calls (and 2 warm-ups).
MIN_RUNS = 10
# The float32 oracle (torch-reference with the intervals as a dense bool mask) is O(L²):
# checked up to measure.REFERENCE_CHECK_MAX_WORK.
SELECTION_LABEL = {"shared": "shared top-{w}", "causal": "causal top-{w}/query"}


@dataclass(frozen=True)
class DmaLongWorkload(Workload):
    """One ``dma_long`` problem.

    ``selection`` is ``"shared"`` or ``"causal"`` (attention workloads: the ``is_causal`` flag
    given to ``topk_intervals``) or ``"layer"`` (a training step of the layer, model width
    ``hidden``). ``window`` is W. Attention is always causal.
    """

    selection: str = "shared"
    hidden: int = 0

    @property
    def is_layer(self) -> bool:
        return self.selection == "layer"

    @property
    def name(self) -> str:
        heads = f"H{self.heads}" if self.heads == self.kv_heads else f"H{self.heads}/{self.kv_heads}"
        parts = [SUITE, "layer step" if self.is_layer else "", f"B{self.batch}", heads,
                 f"L{self.seqlen_k}", f"D{self.head_dim}"]
        if self.is_layer:
            parts.append(f"E{self.hidden} window{self.window}")
        else:
            parts.append(self.mask_label)
        parts.append("causal")
        return " ".join(p for p in parts if p)

    @property
    def short(self) -> str:
        tags = [f"L{self.seqlen_k}", f"W{self.window}"]
        tags.append("layer" if self.is_layer else "shared" if self.selection == "shared" else "causal")
        return " ".join(tags)

    @property
    def mask_label(self) -> str:
        if self.is_layer:
            return f"window{self.window}"
        return SELECTION_LABEL[self.selection].format(w=self.window) + "+bias"

    def io_bytes(self, dtype: torch.dtype) -> int:  # not a bandwidth suite
        return 0


def _attention(L: int, W: int, selection: str, heads: int, kv_heads: int, dim: int) -> DmaLongWorkload:
    return DmaLongWorkload(SUITE, 1, heads, kv_heads, L, L, dim, True, mask=f"intervals-{selection}",
                           bias=True, window=W, selection=selection)


def _layer(L: int, W: int, hidden: int, heads: int, kv_heads: int, dim: int) -> DmaLongWorkload:
    return DmaLongWorkload(SUITE, 1, heads, kv_heads, L, L, dim, True, mask="layer", bias=True,
                           window=W, selection="layer", hidden=hidden)


def dma_long_workloads(quick: bool) -> List[DmaLongWorkload]:
    """Attention workloads of both selection kinds, then the layer steps."""
    if quick:
        heads, kv_heads, dim = 4, 2, 16
        shapes = {"shared": [(256, 32), (256, 16)], "causal": [(256, 32), (256, 16), (512, 32)]}
        layers, hidden = [(256, 32)], 64
    else:
        heads, kv_heads, dim = 16, 4, 128
        shapes = {
            "shared": [(16384, 2048), (32768, 2048), (32768, 512), (131072, 2048)],
            "causal": [(16384, 2048), (32768, 2048), (32768, 512), (65536, 2048), (131072, 2048)],
        }
        layers, hidden = [(16384, 2048), (32768, 2048)], 2048
    out = [_attention(L, W, sel, heads, kv_heads, dim) for sel in ("shared", "causal") for L, W in shapes[sel]]
    out += [_layer(L, W, hidden, heads, kv_heads, dim) for L, W in layers]
    return out


def default_backends(ctx: RunContext) -> List[str]:
    """The explicit backends when ``--backends`` is not given: triton on a GPU (the backend
    that runs KeyIntervals at the cost of the selected keys), torch-reference on CPU."""
    wanted = "triton" if ctx.cuda else "torch-reference"
    return [wanted] if wanted in get_available_backends() else []


# ---------------------------------------------------------------------------------------------
# Inputs


class DmaCase:
    """A workload's tensors: ``q (B, L, H, D)``, ``k, v (B, L, Hkv, D)``, the per-key bias
    ``(B, Hkv, 1, L)`` and its KeyIntervals (attention), or hidden states ``(B, L, E)`` (layer)."""

    def __init__(self, w: DmaLongWorkload, device: torch.device, dtype: torch.dtype, seed: int = SEED) -> None:
        self.workload = w
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

        B, L = w.batch, w.seqlen_k
        self.intervals = None
        if w.is_layer:
            self.x = randn(B, L, w.hidden)
            self.grad_out = randn(B, L, w.hidden)
            return
        self.q = randn(B, L, w.heads, w.head_dim)
        self.k = randn(B, L, w.kv_heads, w.head_dim)
        self.v = randn(B, L, w.kv_heads, w.head_dim)
        self.grad_out = randn(B, L, w.heads, w.head_dim)
        self.bias = randn(B, w.kv_heads, 1, L)
        if topk_intervals is None:
            raise RuntimeError("topk_intervals is not in this tree (flash_dmattn.utils.mask / planning.selection)")
        # Built once, outside every timed region; the selection row times this same call.
        with torch.no_grad():
            self.intervals = select(self.bias, w)

    @property
    def device(self) -> torch.device:
        return self.grad_out.device

    @property
    def dtype(self) -> torch.dtype:
        return self.grad_out.dtype


def select(bias: torch.Tensor, w: DmaLongWorkload):
    """The workload's KeyIntervals from a (detached) bias."""
    return topk_intervals(bias, w.window, is_causal=w.selection == "causal")


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_() if grad else t


# ---------------------------------------------------------------------------------------------
# Implementations. ``make_inputs(case, grad)`` gives ``(args, leaves, grad_outputs)``;
# ``as_case_layout(out)`` maps an output back to the case's layout for the reference check.


class DmaImpl(Impl):
    forward_only = False

    def setup(self, case: DmaCase, ctx: RunContext) -> None:
        self.workload = case.workload
        self.case = case

    def make_inputs(self, case: DmaCase, grad: bool):
        raise NotImplementedError

    def as_case_layout(self, out: torch.Tensor) -> torch.Tensor:
        return out


class Selection(DmaImpl):
    """``topk_intervals`` on the detached bias: the selection build, forward only."""

    name = "topk_intervals (selection)"
    kind = "selection"
    computes_workload = False
    uses_bias = False
    forward_only = True

    def setup(self, case, ctx):
        super().setup(case, ctx)
        causal = case.workload.selection == "causal"
        self.notes.append(f"topk_intervals(bias, {case.workload.window}, is_causal={causal}); no gradient")

    def make_inputs(self, case, grad):
        return (case.bias.detach(),), [], []

    def __call__(self, bias):
        return select(bias, self.workload).bounds


class FlashIntervals(DmaImpl):
    """flash_dmattn with the KeyIntervals mask and the bias, causal: auto-dispatch
    (``backend=None``) or one backend, no fallback."""

    kind = "flash_dmattn"

    def __init__(self, backend: Optional[str]) -> None:
        super().__init__()
        self.backend = backend
        self.name = f"flash_dmattn[{backend or 'auto'}]"
        self.fn = flash_dmattn_func_auto(backend)

    def setup(self, case, ctx):
        super().setup(case, ctx)
        w = case.workload
        runs = self.backend
        if runs is None:
            inputs = AttentionInputs.from_args(case.q, case.k, case.v, case.intervals, case.bias, None, True)
            try:
                runs = registry.select_backend(inputs).name
            except RuntimeError as exc:
                raise Declined(str(exc).splitlines()[0]) from None
            self.notes.append(f"auto-dispatch picks {runs}")
        if runs == "torch-reference" and ctx.cuda and not ctx.quick and w.seqlen_k ** 2 > REFERENCE_MAX_WORK_GPU:
            raise Skipped("torch-reference is plain PyTorch (O(L²) memory); not timed on GPU for L > 4096")

    def make_inputs(self, case, grad):
        q, k, v, bias = (_leaf(t, grad) for t in (case.q, case.k, case.v, case.bias))
        return (q, k, v, bias), ([q, k, v, bias] if grad else []), [case.grad_out]

    def __call__(self, q, k, v, bias):
        try:
            return self.fn(q, k, v, attn_mask=self.case.intervals, attn_bias=bias, is_causal=True)
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None


def _sdpa_modes(cuda: bool) -> List[Tuple[object, str]]:
    """(SDPA kernel or None for PyTorch's choice, "gqa" or "repeat"), in the order tried."""
    if not cuda:
        return [(None, "gqa")]
    from torch.nn.attention import SDPBackend

    return [(SDPBackend.CUDNN_ATTENTION, "gqa"), (SDPBackend.CUDNN_ATTENTION, "repeat"),
            (SDPBackend.FLASH_ATTENTION, "gqa"), (None, "gqa")]


def _mode_label(mode) -> str:
    kernel, gqa = mode
    name = "default" if kernel is None else str(kernel).split(".")[-1]
    return f"{name} ({'enable_gqa' if gqa == 'gqa' else 'K/V repeated'})"


def _sdpa_call(q, k, v, causal: bool, mode):
    kernel, gqa = mode
    kwargs = {"enable_gqa": True} if gqa == "gqa" and q.shape[1] != k.shape[1] else {}
    if kernel is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    from torch.nn.attention import sdpa_kernel

    # The kernel is fixed at forward time; autograd runs the matching backward.
    with sdpa_kernel([kernel]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)


class _SdpaChain(DmaImpl):
    """Picks the first SDPA mode (see :func:`_sdpa_modes`) that runs this row, in setup
    (outside timing; it doubles as the warm-up), and notes why earlier modes did not."""

    heads_first = True
    computes_workload = False
    uses_bias = False

    def _probe(self, ctx: RunContext) -> None:
        reasons = []
        for mode in _sdpa_modes(ctx.cuda):
            self.mode = mode
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    args, leaves, grad_outs = self.make_inputs(self.case, grad=ctx.backward)
                    out = self(*args)
                    if leaves:
                        torch.autograd.grad([out], leaves, grad_outs)
                    del out, args, leaves
                    if ctx.cuda:
                        torch.cuda.synchronize()
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as exc:
                    # PyTorch says why a pinned kernel cannot run in warnings, then raises
                    # a generic "No available kernel".
                    said = [str(m.message).strip().splitlines()[0] for m in caught if str(m.message).strip()]
                    why = " ".join(dict.fromkeys(said)) or str(exc).strip().splitlines()[0]
                    reasons.append(f"{_mode_label(mode)}: {why[:200]}")
                    continue
            if reasons:
                self.notes.append("not run: " + " | ".join(reasons))
            self.notes.append(f"SDPA {_mode_label(mode)}")
            return
        raise RuntimeError("no SDPA kernel ran: " + " | ".join(reasons))


class SdpaDense(_SdpaChain):
    """Dense causal SDPA of the workload's shape; ignores the mask and bias."""

    speedup_baseline = True

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.name = ("sdpa-cudnn" if cuda else "sdpa") + " (dense causal)"

    def setup(self, case, ctx):
        super().setup(case, ctx)
        self.tensors = {n: getattr(case, n).transpose(1, 2).contiguous() for n in ("q", "k", "v", "grad_out")}
        self._repeated = None
        self._probe(ctx)
        self.notes.append("dense: no mask, no bias (reference point)")

    def _kv(self):
        if self.mode[1] != "repeat":
            return self.tensors["k"], self.tensors["v"]
        if self._repeated is None:  # copies made once, outside the timed region
            g = self.workload.group
            self._repeated = tuple(self.tensors[n].repeat_interleave(g, dim=1) for n in ("k", "v"))
        return self._repeated

    def make_inputs(self, case, grad):
        k, v = self._kv()
        q, k, v = (_leaf(t, grad) for t in (self.tensors["q"], k, v))
        return (q, k, v), ([q, k, v] if grad else []), [self.tensors["grad_out"]]

    def __call__(self, q, k, v):
        return _sdpa_call(q, k, v, True, self.mode)


class SdpaSelected(SdpaDense):
    """SDPA of all L queries against the W keys of the top-W per kv head (by bias), gathered
    out of K/V outside the timed region; no mask, not causal. A cost limit, not an answer."""

    speedup_baseline = False

    def __init__(self, cuda: bool) -> None:
        DmaImpl.__init__(self)
        self.name = ("sdpa-cudnn" if cuda else "sdpa") + " (selected keys only)"

    def setup(self, case, ctx):
        DmaImpl.setup(self, case, ctx)
        w = case.workload
        # The W highest-bias keys of each (batch, kv head): as many keys as each query sees.
        top = case.bias.detach()[:, :, 0, :].topk(w.window, dim=-1).indices.sort(dim=-1).values
        index = top[..., None].expand(-1, -1, -1, w.head_dim)
        self.tensors = {
            "q": case.q.transpose(1, 2).contiguous(),
            "grad_out": case.grad_out.transpose(1, 2).contiguous(),
            "k": case.k.transpose(1, 2).gather(2, index).contiguous(),
            "v": case.v.transpose(1, 2).gather(2, index).contiguous(),
        }
        del top, index
        self._repeated = None
        self._probe(ctx)
        self.notes.append(f"q of L={w.seqlen_q} against K/V of the W={w.window} top-bias keys; not causal, no mask/bias")

    def __call__(self, q, k, v):
        return _sdpa_call(q, k, v, False, self.mode)


def _seeded_layer(build, case: DmaCase) -> nn.Module:
    # The same initial weights for every row of a workload (and every run).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        layer = build()
    return layer.to(case.device, case.dtype)


class DmaLayer(DmaImpl):
    """One training step of :class:`flash_dmattn.DynamicMaskAttention` (forward + backward
    with respect to the input and every parameter), causal, on ``backend`` (None: auto)."""

    kind = "flash_dmattn"
    computes_workload = False  # no float32 oracle for a whole layer

    def __init__(self, backend: Optional[str]) -> None:
        super().__init__()
        self.backend = backend
        self.name = f"DynamicMaskAttention[{backend or 'auto'}]"

    def setup(self, case, ctx):
        super().setup(case, ctx)
        from flash_dmattn import DynamicMaskAttention

        w = case.workload
        if self.backend == "torch-reference" and ctx.cuda and not ctx.quick and w.seqlen_k ** 2 > REFERENCE_MAX_WORK_GPU:
            raise Skipped("torch-reference is plain PyTorch (O(L²) memory); not timed on GPU for L > 4096")
        self.layer = _seeded_layer(lambda: DynamicMaskAttention(
            w.hidden, w.heads, w.kv_heads, w.head_dim, window_size=w.window, is_causal=True,
            backend=self.backend), case)
        self.notes.append(f"window {w.window}; grads of the input and all parameters")

    def make_inputs(self, case, grad):
        x = _leaf(case.x, grad)
        leaves = [x] + [p for p in self.layer.parameters() if p.requires_grad] if grad else []
        return (x,), leaves, [case.grad_out]

    def __call__(self, x):
        try:
            return self.layer(x)
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None


class DenseLayerModule(nn.Module):
    """A dense causal self-attention layer: the same q/k/v/o projections as the DMA layer
    (no bias terms, no dt_proj / A), SDPA with no mask."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mode = (None, "gqa")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.mode[1] == "repeat" and self.heads != self.kv_heads:
            g = self.heads // self.kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out = _sdpa_call(q, k, v, True, self.mode)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))


class DenseLayer(_SdpaChain):
    """The dense layer's training step (same grads as :class:`DmaLayer`)."""

    heads_first = False
    speedup_baseline = True

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.name = "dense layer (" + ("sdpa-cudnn" if cuda else "sdpa") + " causal)"

    def setup(self, case, ctx):
        super().setup(case, ctx)
        w = case.workload
        self.layer = _seeded_layer(lambda: DenseLayerModule(w.hidden, w.heads, w.kv_heads, w.head_dim), case)
        self._probe(ctx)
        if self.mode[1] == "repeat":
            self.notes.append("K/V repeated inside the step")

    @property
    def mode(self):
        return self.layer.mode

    @mode.setter
    def mode(self, value):
        self.layer.mode = value

    def make_inputs(self, case, grad):
        x = _leaf(case.x, grad)
        leaves = [x] + list(self.layer.parameters()) if grad else []
        return (x,), leaves, [case.grad_out]

    def __call__(self, x):
        return self.layer(x)


def dma_long_implementations(w: DmaLongWorkload, ctx: RunContext, backends: List[str]) -> List[DmaImpl]:
    if w.is_layer:
        impls: List[DmaImpl] = [DmaLayer(None)] + [DmaLayer(b) for b in backends]
        impls.append(DenseLayer(ctx.cuda))
    else:
        impls = [Selection(), FlashIntervals(None)] + [FlashIntervals(b) for b in backends]
        impls += [SdpaDense(ctx.cuda), SdpaSelected(ctx.cuda)]
    return [i for i in impls if not any(part in i.name for part in ctx.skip)]


# ---------------------------------------------------------------------------------------------
# Running


def reference_outputs(case: DmaCase, backward: bool) -> Dict[str, torch.Tensor]:
    """torch-reference in float32 with the intervals expanded to a dense bool mask."""
    fn = flash_dmattn_func_auto("torch-reference")
    L = case.workload.seqlen_k
    mask = case.intervals.to_dense(L)
    q, k, v, bias = (t.detach().float() for t in (case.q, case.k, case.v, case.bias))
    if not backward:
        with torch.no_grad():
            return {"out": fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)}
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    out = fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    grads = torch.autograd.grad(out, leaves, case.grad_out.float())
    result = {"out": out.detach()}
    result.update(zip(GRAD_NAMES, grads))
    return result


def _run_impl(case: DmaCase, impl: DmaImpl, ctx: RunContext, ref, ref_note: str) -> Row:
    w = case.workload
    # At least MIN_RUNS timed calls a phase (CUDA events); the first call is a plain call:
    # every kernel choice (the SDPA modes) is settled in setup.
    row = time_impl(
        case, impl, ctx, ref, ref_note, inputs=lambda grad: impl.make_inputs(case, grad),
        out_for_ref=impl.as_case_layout, grads_for_ref=lambda grads: dict(zip(GRAD_NAMES, grads)),
        backward=ctx.backward and not impl.forward_only, min_runs=MIN_RUNS, fall_back=False,
    )
    if not w.is_layer and impl.kind != "selection":
        # Nominal dense-causal FLOPs (as the other suites), comparable across the rows.
        derive_rates(row, w, case.dtype)
    return row


DENSE, SELECTED = "dense", "selected"


def fill_ratios(rows: List[Row]) -> None:
    """On every flash_dmattn row: its time / the dense row's and / the selected-keys row's."""
    dense = next((r for r in rows if r.is_speedup_baseline), None)
    limit = next((r for r in rows if r.impl.endswith("(selected keys only)")), None)
    for r in rows:
        if r.kind != "flash_dmattn":
            continue
        for label, other in ((DENSE, dense), (SELECTED, limit)):
            if other is None:
                continue
            for phase, a, b in (("fwd", r.fwd_ms, other.fwd_ms), ("fwd+bwd", r.fwd_bwd_ms, other.fwd_bwd_ms)):
                if a and b:
                    r.ratios[f"/{label} {phase}"] = a / b


def run_dma_long_workload(w: DmaLongWorkload, ctx: RunContext, backends: List[str]) -> List[Row]:
    """Every row of one workload; failures become rows, never exceptions."""
    def progress(row: Row) -> str:
        return (
            f"   {row.impl:<36} fwd {report.fmt_ms(row.fwd_ms):>9} ms  fwd+bwd {report.fmt_ms(row.fwd_bwd_ms):>9} ms"
            f"  peak {report._num(row.peak_extra_mib, '.0f'):>6} MiB  {row.status}  err {report.fmt_err(row)}"
            f"{'  ' + '; '.join(row.notes) if row.notes else ''}"
        )

    def finish(rows: List[Row]) -> None:
        for r in rows:
            if r.kind == "selection":  # not attention: a speedup over attention means nothing
                r.speedup_fwd = r.speedup_fwd_bwd = None
        fill_ratios(rows)

    return run_suite_workload(
        w, ctx, case_type=DmaCase,
        check_reference=not w.is_layer and w.seqlen_k ** 2 <= REFERENCE_CHECK_MAX_WORK,
        reference=lambda case: reference_outputs(case, ctx.backward),
        implementations=lambda: dma_long_implementations(w, ctx, backends),
        run_one=_run_impl, progress=progress, finish=finish,
    )


# ---------------------------------------------------------------------------------------------
# The summary table: one line per workload and flash_dmattn row


def summary_markdown(rows: List[Row]) -> List[str]:
    """Markdown lines of the summary table (see README: the ``dma_long`` columns)."""
    cols = ["workload", "impl", "select ms", "fwd ms", "fwd+bwd ms", "peak extra MiB",
            "dense fwd / fwd+bwd ms", "selected-keys fwd / fwd+bwd ms",
            "÷dense fwd / fwd+bwd", "÷selected fwd / fwd+bwd", "notes"]
    out = ["One line per workload and flash_dmattn row (its time beside the dense and "
           "selected-keys SDPA rows of the same workload); every row in full below.", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    by_workload: Dict[str, List[Row]] = {}
    for r in rows:
        by_workload.setdefault(r.workload, []).append(r)
    for name, group in by_workload.items():
        selection = next((r for r in group if r.kind == "selection"), None)
        dense = next((r for r in group if r.is_speedup_baseline), None)
        limit = next((r for r in group if r.impl.endswith("(selected keys only)")), None)
        mine = [r for r in group if r.kind == "flash_dmattn"] or [r for r in group if r.status == ERROR][:1]
        for r in mine:
            notes = [] if r.status == OK else [r.status]
            notes += [n for n in r.notes if "error" in n or "declined" in n or "skipped" in n or "picks" in n]
            for label, other in (("dense", dense), ("selected", limit)):
                if other is not None and other.status != OK:
                    notes.append(f"{label} row {other.status}")
            cells = [
                name if r is mine[0] else "", r.impl,
                report.fmt_ms(selection.fwd_ms) if selection else "-",
                report.fmt_ms(r.fwd_ms), report.fmt_ms(r.fwd_bwd_ms),
                report._num(r.peak_extra_mib, ".0f"),
                _ms_pair(dense), _ms_pair(limit),
                report._pair(r.ratios.get("/dense fwd"), r.ratios.get("/dense fwd+bwd"), "ratio"),
                report._pair(r.ratios.get("/selected fwd"), r.ratios.get("/selected fwd+bwd"), "ratio"),
                report._cell("; ".join(notes)),
            ]
            out.append("| " + " | ".join(cells) + " |")
    return out


def _ms_pair(r: Optional[Row]) -> str:
    if r is None or (r.fwd_ms is None and r.fwd_bwd_ms is None):
        return "-"
    return f"{report.fmt_ms(r.fwd_ms)} / {report.fmt_ms(r.fwd_bwd_ms)}"


READING = (
    "dma_long: select ms = topk_intervals alone (the KeyIntervals build, outside the attention "
    "timings). fwd / fwd+bwd ms = flash_dmattn with the KeyIntervals mask and the per-key bias "
    "(fwd+bwd: gradients of q, k, v and the bias); on layer rows, one step of the "
    "DynamicMaskAttention layer (gradients of the input and all parameters). dense = causal "
    "SDPA (cuDNN, or the kernel its note names) of the same shape, no mask (layer rows: the "
    "dense layer's step). selected-keys = SDPA of all L queries against the W top-bias keys "
    "gathered out of K/V, not causal, no mask: the cost of exactly W keys per query. "
    "÷dense, ÷selected = this row's time / theirs (below 1: faster). Peak extra MiB = "
    "max_memory_allocated during one fwd+bwd minus what was allocated before (inputs, bias, "
    "intervals excluded). Times are medians: on CUDA of at least "
    f"{MIN_RUNS} runs timed with CUDA events after at least 2 warm-up calls."
)
