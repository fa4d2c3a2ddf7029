"""The ``varlen`` suite: a batch of packed sequences of random lengths vs the same batch padded.

One workload is a seeded batch of sequences (16 of lengths 1–8192 in full, 4 of lengths 1–64
with ``--quick``), causal, without and with a per-key mask + bias ``(Hkv, total_k)``. For every
flash_dmattn backend three rows are timed:

* ``packed``: the backend's varlen path (``registry.get_backend(name).varlen_attention`` on
  ``VarlenInputs.from_args(...)``, i.e. ``flash_dmattn_varlen_func`` pinned to that backend);
* ``sequential``: one dense call of the same backend per sequence, all in one timed region;
* ``padded``: one dense call on the batch padded to the longest sequence, with a
  ``(B, 1|Hkv, 1, Lmax)`` mask = key padding & the per-key mask (bias padded with zeros).

Baselines: SDPA on the padded batch (``is_causal`` only, which is exact for the real tokens of
a right-padded batch, and with a boolean ``(B, 1, Lmax, Lmax)`` padding & causal mask, as a
model with a padding mask does), and FlexAttention with a document-id BlockMask on the packed
tokens. Outputs and gradients are compared, on the real tokens only, with the torch-reference
varlen path in float32 on the packed inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from flash_dmattn import flash_dmattn_func_auto, registry
from flash_dmattn.inputs import VarlenInputs
from flash_dmattn.utils.padding import cu_seqlens_from_lengths, pad_input

from . import report
from .impls import (REFERENCE_MAX_WORK_GPU, Declined, FlexCalls, Impl, RunContext,
                    SdpaKernelChoice, Skipped, _short_decline)
from .measure import GRAD_NAMES, derive_rates, run_suite_workload, time_impl
from .report import Row
from .workloads import Workload

SEED = 0
# The float32 reference runs each sequence densely (O(L²) each): allowed while the longest
# sequence is within the other suites' limit and the batch totals at most 8 such sequences.
REFERENCE_MAX_SEQ_WORK = 8192 * 8192
REFERENCE_MAX_TOTAL_WORK = 8 * REFERENCE_MAX_SEQ_WORK
# The packed row should cost at most this much more than the sum of its sequences.
TARGET_VS_SEQUENTIAL = 1.1


@dataclass(frozen=True)
class VarlenWorkload(Workload):
    """``batch`` sequences of the given ``lengths`` (``seqlen_q = seqlen_k`` = the longest).

    ``mask == "per-key"``: mask and bias ``(Hkv, total_k)``, mask = bias > -1 (about 84% of
    the keys live, scattered).
    """

    lengths: Tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def name(self) -> str:
        heads = f"H{self.heads}" if self.heads == self.kv_heads else f"H{self.heads}/{self.kv_heads}"
        parts = [
            "varlen", f"{len(self.lengths)} seqs L{min(self.lengths)}–{max(self.lengths)}",
            f"(total {self.total})", heads, f"D{self.head_dim}", self.mask_label,
            "causal" if self.causal else "non-causal",
        ]
        return " ".join(p for p in parts if p)

    @property
    def short(self) -> str:
        tags = [f"{len(self.lengths)}×L≤{max(self.lengths)}", f"D{self.head_dim}"]
        if self.has_mask_or_bias:
            tags.append(self.mask_label)
        return " ".join(tags)

    @property
    def mask_label(self) -> str:
        if self.mask == "per-key":
            return "mask+bias"
        return "bias" if self.bias else ""

    def flops_fwd(self) -> float:
        """Real (unpadded) nominal FLOPs: ``Σ 4·H·L_i²·D``, halved when causal."""
        flops = sum(4.0 * self.heads * n * n * self.head_dim for n in self.lengths)
        return flops / 2 if self.causal else flops

    def io_bytes(self, dtype: torch.dtype) -> int:  # not a bandwidth suite
        return 0


def varlen_workloads(quick: bool) -> List[VarlenWorkload]:
    """The ``varlen`` suite: seeded random lengths, without and with a per-key mask + bias."""
    if quick:
        count, max_len, heads, kv_heads, dim = 4, 64, 2, 1, 16
    else:
        count, max_len, heads, kv_heads, dim = 16, 8192, 16, 4, 128
    gen = torch.Generator().manual_seed(SEED)  # CPU generator: the same lengths everywhere
    lengths = tuple(int(n) for n in torch.randint(1, max_len + 1, (count,), generator=gen))
    out = []
    for masked in (False, True):
        out.append(VarlenWorkload(
            "varlen", count, heads, kv_heads, max(lengths), max(lengths), dim, True,
            mask="per-key" if masked else "none", bias=masked, lengths=lengths,
        ))
    return out


class VarlenCase:
    """Packed inputs ``q (total, H, D)``, ``k, v (total, Hkv, D)``, mask/bias ``(Hkv, total)``.

    The per-sequence and padded forms are derived on first use (outside timing) and shared by
    the rows that need them.
    """

    def __init__(self, w: VarlenWorkload, device: torch.device, dtype: torch.dtype, seed: int = SEED) -> None:
        self.workload = w
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

        T = w.total
        self.q = randn(T, w.heads, w.head_dim)
        self.k = randn(T, w.kv_heads, w.head_dim)
        self.v = randn(T, w.kv_heads, w.head_dim)
        self.grad_out = randn(T, w.heads, w.head_dim)
        self.bias = randn(w.kv_heads, T) if w.bias else None
        self.mask = (self.bias > -1) if w.mask == "per-key" else None
        self.lengths = list(w.lengths)
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.cu_seqlens = cu_seqlens_from_lengths(self.lengths).to(device)
        self.max_len = max(self.lengths)
        self._split = None
        self._padded = None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def split(self) -> dict:
        """Per-sequence contiguous copies: q ``(1, L_i, H, D)``, mask/bias ``(1, Hkv, 1, L_i)``."""
        if self._split is None:
            spans = list(zip(self.offsets, self.offsets[1:]))

            def seqs(t):
                return [t[a:b].unsqueeze(0).contiguous() for a, b in spans]

            def keys(t):
                return None if t is None else [t[:, a:b][None, :, None].contiguous() for a, b in spans]

            self._split = dict(q=seqs(self.q), k=seqs(self.k), v=seqs(self.v), grad_out=seqs(self.grad_out),
                               mask=keys(self.mask), bias=keys(self.bias))
        return self._split

    def padded(self) -> dict:
        """The batch right-padded to ``Lmax``: q ``(B, Lmax, H, D)``, ``valid (B, Lmax)``, ..."""
        if self._padded is None:
            B, L, dev = len(self.lengths), self.max_len, self.device
            indices = torch.cat([b * L + torch.arange(n, device=dev) for b, n in enumerate(self.lengths)])
            valid = torch.zeros(B * L, dtype=torch.bool, device=dev)
            valid[indices] = True
            valid = valid.view(B, L)

            def pad(t):
                return pad_input(t, indices, B, L)

            def keys(t):  # (Hx, total) -> (B, Hx, 1, Lmax), zero / False at padding
                return None if t is None else pad(t.t()).permute(0, 2, 1).unsqueeze(2).contiguous()

            mask = valid[:, None, None, :]
            if self.mask is not None:
                mask = mask & keys(self.mask)
            self._padded = dict(q=pad(self.q), k=pad(self.k), v=pad(self.v), grad_out=pad(self.grad_out),
                                bias=keys(self.bias), mask=mask.contiguous(), valid=valid, indices=indices)
        return self._padded

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, Lmax, ...)`` -> ``(total, ...)`` (the real tokens, packed)."""
        return t.flatten(0, 1).index_select(0, self.padded()["indices"])

    def unpad_keys(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, Hx, 1, Lmax)`` per-key tensor -> ``(Hx, total)``."""
        return self.unpad(t.squeeze(2).permute(0, 2, 1)).t()


# ---------------------------------------------------------------------------------------------
# Implementations. Each makes its own inputs (``make_inputs``) from the packed case and maps
# its output and gradients back to the packed layout for the reference check.


class VarlenImpl(Impl):
    kind = "baseline"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        self.workload = case.workload
        self.case = case

    def make_inputs(self, case: VarlenCase, grad: bool):
        """``(args, leaves, grad_outputs)``; ``leaves`` are fresh autograd leaves when ``grad``."""
        raise NotImplementedError

    def packed_out(self, out) -> torch.Tensor:
        raise NotImplementedError

    def packed_grads(self, grads) -> Dict[str, torch.Tensor]:
        raise NotImplementedError


def _leaf(t: Optional[torch.Tensor], grad: bool) -> Optional[torch.Tensor]:
    return t.detach().requires_grad_() if grad and t is not None else t


class _Backend(VarlenImpl):
    kind = "flash_dmattn"
    mode = ""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.name = f"flash_dmattn[{backend}] {self.mode}"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        if self.backend == "torch-reference" and ctx.cuda and not ctx.quick:
            if case.max_len ** 2 > REFERENCE_MAX_WORK_GPU:
                raise Skipped("torch-reference is plain PyTorch (O(L²) traffic); not timed on GPU for L > 4096")


class Packed(_Backend):
    """The backend's varlen path: what ``flash_dmattn_varlen_func`` runs when it picks it."""

    mode = "packed"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        self.impl = registry.get_backend(self.backend)
        # Decline up front (with the backend's own reason) rather than once per phase.
        self._inputs(case.q, case.k, case.v, case.mask, case.bias)

    def _inputs(self, q, k, v, mask, bias) -> VarlenInputs:
        c = self.case
        try:
            inputs = VarlenInputs.from_args(
                q, k, v, c.cu_seqlens, c.cu_seqlens, c.max_len, c.max_len, attn_mask=mask, attn_bias=bias,
                is_causal=self.workload.causal,
            )
            registry.check_explicit(self.impl, inputs)
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None
        return inputs

    def make_inputs(self, case, grad):
        q, k, v, bias = (_leaf(t, grad) for t in (case.q, case.k, case.v, case.bias))
        leaves = [t for t in (q, k, v, bias) if t is not None] if grad else []
        return (q, k, v, case.mask, bias), leaves, [case.grad_out]

    def __call__(self, q, k, v, mask, bias):
        # Validation and the capability check are part of every public call, so they are timed.
        return self.impl.varlen_attention(self._inputs(q, k, v, mask, bias))

    def packed_out(self, out):
        return out

    def packed_grads(self, grads):
        return dict(zip(GRAD_NAMES, grads))


class Sequential(_Backend):
    """One dense call of the backend per sequence, one after the other (one timed region)."""

    mode = "sequential"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        # The row exists for the packed / sequential ratio: without a packed row it would only
        # cost time (flex compiles its kernels once per distinct length: minutes on a GPU).
        packed = Packed(self.backend)
        try:
            packed.setup(case, ctx)
        except Declined as exc:
            raise Skipped(f"no packed row to compare with ({exc})") from None
        self.fn = flash_dmattn_func_auto(self.backend)
        case.split()

    def make_inputs(self, case, grad):
        s = case.split()
        q, k, v = ([_leaf(t, grad) for t in s[name]] for name in ("q", "k", "v"))
        bias = [_leaf(t, grad) for t in s["bias"]] if s["bias"] is not None else None
        leaves = (q + k + v + (bias or [])) if grad else []
        return (q, k, v, s["mask"], bias), leaves, s["grad_out"]

    def __call__(self, qs, ks, vs, masks, biases):
        n = len(qs)
        masks = masks or [None] * n
        biases = biases or [None] * n
        causal = self.workload.causal
        try:
            return [self.fn(q, k, v, attn_mask=m, attn_bias=b, is_causal=causal)
                    for q, k, v, m, b in zip(qs, ks, vs, masks, biases)]
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None

    def packed_out(self, out):
        return torch.cat([o[0] for o in out])

    def packed_grads(self, grads):
        n = len(self.case.lengths)
        groups = [grads[i * n:(i + 1) * n] for i in range(len(grads) // n)]
        got = {name: torch.cat([g[0] for g in group]) for name, group in zip(("dq", "dk", "dv"), groups)}
        if len(groups) > 3:
            got["dbias"] = torch.cat([g[0, :, 0] for g in groups[3]], dim=-1)
        return got


class Padded(_Backend):
    """One dense call on the right-padded batch with key padding & per-key mask."""

    mode = "padded"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        self.fn = flash_dmattn_func_auto(self.backend)
        case.padded()
        self.notes.append(f"padded to B{len(case.lengths)}×L{case.max_len}")

    def make_inputs(self, case, grad):
        p = case.padded()
        q, k, v, bias = (_leaf(p[n], grad) for n in ("q", "k", "v", "bias"))
        leaves = [t for t in (q, k, v, bias) if t is not None] if grad else []
        return (q, k, v, p["mask"], bias), leaves, [p["grad_out"]]

    def __call__(self, q, k, v, mask, bias):
        try:
            return self.fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=self.workload.causal)
        except ValueError as exc:
            raise Declined(_short_decline(exc)) from None

    def packed_out(self, out):
        return self.case.unpad(out)

    def packed_grads(self, grads):
        got = {name: self.case.unpad(g) for name, g in zip(("dq", "dk", "dv"), grads)}
        if len(grads) > 3:
            got["dbias"] = self.case.unpad_keys(grads[3])
        return got


class SdpaPadded(SdpaKernelChoice, VarlenImpl):
    """SDPA on the right-padded batch (heads-first copies made outside timing).

    ``bool_mask=False``: ``is_causal`` only; for a right-padded causal batch that is exact on
    the real tokens (causality already hides every padding key from them). ``bool_mask=True``:
    a ``(B, 1, Lmax, Lmax)`` padding & causal mask (SDPA forbids ``attn_mask`` with
    ``is_causal``), as a model that passes its padding mask does. Mask and bias of the
    workload are ignored: on masked workloads the row is a reference point, not an answer.
    """

    def __init__(self, name: str, kernel=None, bool_mask: bool = False, speedup_baseline: bool = False) -> None:
        super().__init__()
        self.name = name
        self.kernel = kernel
        self.bool_mask = bool_mask
        self.speedup_baseline = speedup_baseline

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        w = case.workload
        p = case.padded()
        self.tensors = {n: p[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "grad_out")}
        self.attn_mask = None
        if self.bool_mask:
            L = case.max_len
            causal = torch.ones(L, L, dtype=torch.bool, device=case.device).tril()
            self.attn_mask = (causal[None, None] & p["valid"][:, None, None, :]).contiguous()
            self.notes.append(f"padded to B{len(case.lengths)}×L{L}; bool (B,1,L,L) padding & causal mask")
            if w.group > 1:
                # As transformers does whenever it passes a mask (the memory-efficient kernel has
                # no GQA), inside the timed region.
                self.notes.append("K/V repeated to H heads")
        else:
            self.notes.append(f"padded to B{len(case.lengths)}×L{case.max_len}; is_causal only "
                              "(exact on the real tokens of a right-padded batch)")
        if w.has_mask_or_bias:
            self.computes_workload = False
            self.uses_bias = False
            self.notes.append("ignores the mask and bias (reference point only)")

    def make_inputs(self, case, grad):
        q, k, v = (_leaf(self.tensors[n], grad) for n in ("q", "k", "v"))
        return (q, k, v), ([q, k, v] if grad else []), [self.tensors["grad_out"]]

    def __call__(self, q, k, v):
        causal = self.workload.causal and self.attn_mask is None
        g = self.workload.group
        if self.attn_mask is not None and g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return self._run_sdpa(q, k, v, causal, attn_mask=self.attn_mask)

    def packed_out(self, out):
        return self.case.unpad(out.transpose(1, 2))

    def packed_grads(self, grads):
        return {name: self.case.unpad(g.transpose(1, 2)) for name, g in zip(("dq", "dk", "dv"), grads)}


class FlexDocument(FlexCalls, VarlenImpl):
    """``flex_attention`` on the packed tokens as one ``(1, H, total, D)`` sequence.

    A document-id ``BlockMask`` (same sequence & causal & per-key mask) is built outside the
    timed region; the bias is a ``score_mod``. Compiled on CUDA; eager and forward only on CPU.
    """

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.name = "flex-direct (document mask)" if compiled else "flex-direct (document mask, eager)"

    def setup(self, case: VarlenCase, ctx: RunContext) -> None:
        super().setup(case, ctx)
        from torch.nn.attention.flex_attention import create_block_mask

        w = case.workload
        self._flex_setup(w.head_dim, ctx)
        doc = torch.repeat_interleave(
            torch.arange(len(case.lengths), device=case.device, dtype=torch.int32),
            torch.tensor(case.lengths, device=case.device),
        )
        mask, group, causal = case.mask, w.group, w.causal

        def mask_mod(b, h, q, kv):
            visible = doc[q] == doc[kv]
            if causal:  # same sequence, same offsets: packed positions order like local ones
                visible = visible & (kv <= q)
            if mask is not None:
                visible = visible & mask[h // group, kv]
            return visible

        self.block_mask = create_block_mask(
            mask_mod, B=None, H=w.heads if mask is not None else None, Q_LEN=w.total, KV_LEN=w.total,
            device=case.device, _compile=ctx.cuda,
        )
        self.notes.append("document BlockMask built outside the timed region")
        self._eager_note()

    def make_inputs(self, case, grad):
        q, k, v, go = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (case.q, case.k, case.v, case.grad_out))
        q, k, v = (_leaf(t, grad) for t in (q, k, v))
        bias = _leaf(case.bias, grad)
        leaves = [t for t in (q, k, v, bias) if t is not None] if grad else []
        # One score_mod per phase, capturing that phase's bias tensor (the leaf, for fwd+bwd):
        # the same function object on every timed call, so compiled code is reused.
        score_mod = None
        if bias is not None:
            group = self.workload.group

            def score_mod(score, b, h, q_idx, kv):
                return score + bias[h // group, kv]

        return (q, k, v, score_mod), leaves, [go]

    def __call__(self, q, k, v, score_mod):
        return self._flex(q, k, v, score_mod)

    def packed_out(self, out):
        return out[0].transpose(0, 1)

    def packed_grads(self, grads):
        got = {name: g[0].transpose(0, 1) for name, g in zip(("dq", "dk", "dv"), grads)}
        if len(grads) > 3:
            got["dbias"] = grads[3]
        return got


def varlen_implementations(w: VarlenWorkload, ctx: RunContext, backends: List[str]) -> List[VarlenImpl]:
    impls: List[VarlenImpl] = []
    for b in backends:
        impls += [Packed(b), Sequential(b), Padded(b)]
    if ctx.cuda:
        from torch.nn.attention import SDPBackend

        impls.append(SdpaPadded("sdpa-cudnn padded (is_causal only)", SDPBackend.CUDNN_ATTENTION,
                                speedup_baseline=True))
        if not w.has_mask_or_bias:
            impls.append(SdpaPadded("sdpa-cudnn padded+bool-mask", SDPBackend.CUDNN_ATTENTION, bool_mask=True))
            impls.append(SdpaPadded("sdpa-efficient padded+bool-mask", SDPBackend.EFFICIENT_ATTENTION,
                                    bool_mask=True))
    else:
        impls.append(SdpaPadded("sdpa padded (is_causal only)", None, speedup_baseline=True))
        if not w.has_mask_or_bias:
            impls.append(SdpaPadded("sdpa padded+bool-mask", None, bool_mask=True))
    impls.append(FlexDocument(compiled=ctx.cuda))
    return impls


# ---------------------------------------------------------------------------------------------
# Running


def reference_outputs(case: VarlenCase, backward: bool) -> Dict[str, torch.Tensor]:
    """The torch-reference varlen path in float32 on the packed inputs (out and gradients)."""
    backend = registry.get_backend("torch-reference")
    q, k, v = (t.detach().float() for t in (case.q, case.k, case.v))
    bias = case.bias.detach().float() if case.bias is not None else None

    def run():
        inputs = VarlenInputs.from_args(q, k, v, case.cu_seqlens, case.cu_seqlens, case.max_len, case.max_len,
                                        attn_mask=case.mask, attn_bias=bias, is_causal=case.workload.causal)
        return backend.varlen_attention(inputs)

    if not backward:
        with torch.no_grad():
            return {"out": run()}
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    leaves = [q, k, v] + ([bias.requires_grad_()] if bias is not None else [])
    out = run()
    grads = torch.autograd.grad(out, leaves, case.grad_out.float())
    result = {"out": out.detach()}
    result.update(zip(GRAD_NAMES, grads))
    return result


def _run_impl(case: VarlenCase, impl: VarlenImpl, ctx: RunContext, ref, ref_note: str) -> Row:
    row = time_impl(case, impl, ctx, ref, ref_note, inputs=lambda grad: impl.make_inputs(case, grad),
                    out_for_ref=impl.packed_out, grads_for_ref=impl.packed_grads, backward=ctx.backward)
    derive_rates(row, case.workload, case.dtype)
    return row


def _fill_ratios(rows: List[Row], backends: List[str]) -> None:
    """On each backend's packed row: packed / sequential and packed / padded time, and the target."""
    by_name = {r.impl: r for r in rows}
    for b in backends:
        packed = by_name.get(f"flash_dmattn[{b}] packed")
        if packed is None:
            continue
        for other in ("sequential", "padded"):
            r = by_name.get(f"flash_dmattn[{b}] {other}")
            if r is None:
                continue
            for phase, a, c in (("fwd", packed.fwd_ms, r.fwd_ms), ("fwd+bwd", packed.fwd_bwd_ms, r.fwd_bwd_ms)):
                if a and c:
                    packed.ratios[f"packed/{other} {phase}"] = a / c
        seq, pad = packed.ratios.get("packed/sequential fwd+bwd"), packed.ratios.get("packed/padded fwd+bwd")
        if seq is not None and pad is not None:
            met = seq <= TARGET_VS_SEQUENTIAL and pad < 1
            packed.notes.append(
                f"target (fwd+bwd ≤ {TARGET_VS_SEQUENTIAL}× sequential and < padded): {'met' if met else 'missed'}"
            )


def run_varlen_workload(w: VarlenWorkload, ctx: RunContext, backends: List[str]) -> List[Row]:
    """Every implementation on one varlen workload; failures become rows, never exceptions."""
    def progress(row: Row) -> str:
        return (
            f"   {row.impl:<40} fwd {report.fmt_ms(row.fwd_ms):>9} ms  fwd+bwd {report.fmt_ms(row.fwd_bwd_ms):>9} ms"
            f"  {row.status}{'  ' + '; '.join(row.notes) if row.notes else ''}"
        )

    work = [n * n for n in w.lengths]
    return run_suite_workload(
        w, ctx, case_type=VarlenCase,
        check_reference=max(work) <= REFERENCE_MAX_SEQ_WORK and sum(work) <= REFERENCE_MAX_TOTAL_WORK,
        reference=lambda case: reference_outputs(case, ctx.backward),
        implementations=lambda: varlen_implementations(w, ctx, backends),
        run_one=_run_impl, progress=progress, finish=lambda rows: _fill_ratios(rows, backends),
    )
