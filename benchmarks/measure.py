"""Timing one implementation on one workload into a result row: inputs, the float32 reference,
the error against it, rates and speedups. Shared by every suite's runner (``run``, ``varlen``,
``dma_long``); the command line lives in ``benchmarks.run``."""
from __future__ import annotations

import gc
import os
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from flash_dmattn import flash_dmattn_func_auto

from .impls import Declined, Impl, RunContext, Skipped
from .report import DECLINED, ERROR, OK, PARTIAL, SKIPPED, Row
from .timing import graph_time_ms, peak_extra_mib, time_ms
from .workloads import Case, Workload

# The float32 oracle is O(Lq·Lk) work per call: affordable up to 8192², not beyond.
REFERENCE_CHECK_MAX_WORK = 8192 * 8192
CPU_REPEATS = 3
GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def _describe(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def free_memory(device: torch.device) -> None:
    # Only CUDA needs this: the caching allocator keeps freed blocks (and reference cycles
    # keep tensors) that the next workload's peak-memory figure would otherwise count.
    # On CPU refcounting already freed everything, and gc.collect costs ~0.1 s a call.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


# ---------------------------------------------------------------------------------------------
# Inputs and the float32 reference


def _to_layout(t: torch.Tensor, impl: Impl) -> torch.Tensor:
    # Heads-first copies are made once, outside timing: SDPA/Flex get their native layout.
    return t.transpose(1, 2).contiguous() if impl.heads_first else t


def _from_layout(t: torch.Tensor, impl: Impl) -> torch.Tensor:
    return t.transpose(1, 2) if impl.heads_first else t


def _impl_inputs(case: Case, impl: Impl, grad: bool):
    """``(args, leaves, grad_out)`` for one implementation; leaves are fresh autograd leaves."""
    q, k, v = (_to_layout(t, impl) for t in (case.q, case.k, case.v))
    bias = case.bias if impl.uses_bias else None
    leaves: List[torch.Tensor] = []
    if grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        bias = bias.detach().requires_grad_() if bias is not None else None
        leaves = [q, k, v] + ([bias] if bias is not None else [])
    return (q, k, v, case.mask, bias), leaves, _to_layout(case.grad_out, impl)


def reference_outputs(case: Case, backward: bool) -> Dict[str, torch.Tensor]:
    """The torch-reference backend's output (and gradients) in float32 on the case's inputs."""
    w = case.workload
    fn = flash_dmattn_func_auto("torch-reference")
    # detach() first: on float32 inputs .float() is the identity, and requires_grad_ below
    # must not reach the case's own tensors (the forward-only timings use them).
    q, k, v = (t.detach().float() for t in (case.q, case.k, case.v))
    bias = case.bias.detach().float() if case.bias is not None else None
    kw = dict(attn_mask=case.mask, is_causal=w.causal, cache_seqlens=case.cache_seqlens)
    if not backward:
        with torch.no_grad():
            return {"out": fn(q, k, v, attn_bias=bias, **kw)}
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    leaves = [q, k, v] + ([bias.requires_grad_()] if bias is not None else [])
    out = fn(q, k, v, attn_bias=bias, **kw)
    grads = torch.autograd.grad(out, leaves, case.grad_out.float())
    result = {"out": out.detach()}
    result.update(zip(GRAD_NAMES, grads))
    return result


def _compare(row: Row, ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> None:
    non_finite = []
    for name, x in got.items():
        if name not in ref:
            continue
        r = ref[name].float()
        x = x.float()
        if not torch.isfinite(x).all():
            non_finite.append(name)
            x = x.nan_to_num(0.0, posinf=0.0, neginf=0.0)
        den = r.norm().item()
        num = (x - r).norm().item()
        row.rel_err_detail[name] = num / den if den > 0 else num
    if row.rel_err_detail:
        row.rel_err = max(row.rel_err_detail.values())
    if non_finite:
        row.notes.append(
            f"non-finite values in {', '.join(non_finite)} (queries with no visible key?); compared as 0"
        )


# ---------------------------------------------------------------------------------------------
# One implementation on one workload


def _first_call(impl: Impl, call, row: Row, phase: str):
    """Run ``call`` once (compiles, warms caches); on a pinned-kernel failure fall back and retry."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call()
        except (Declined, Skipped, torch.cuda.OutOfMemoryError):
            raise
        except RuntimeError as exc:
            if not impl.can_fall_back():
                raise
            # On CUDA PyTorch says why a pinned SDPA kernel cannot run in warnings ("... not
            # used because:" then the reasons), then raises a generic "No available kernel".
            said = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
            reason = " ".join(dict.fromkeys(said)) or _describe(exc)
    row.notes.append(f"{phase}: {impl.fall_back(reason[:200])}")
    return call()


def _run_phase(row: Row, phase: str, body) -> str:
    """Run one phase (fwd or fwd+bwd); return its outcome: ok / declined / skipped / error."""
    try:
        body()
        return OK
    except Declined as exc:
        row.notes.append(f"{phase} declined: {exc}")
        return DECLINED
    except Skipped as exc:
        row.notes.append(f"{phase} skipped: {exc}")
        return SKIPPED
    except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
        row.notes.append(f"{phase} error: {_describe(exc)}")
        return ERROR


def inputs_error_row(w, exc: BaseException, device: torch.device) -> Row:
    """The single row of a workload whose inputs could not be built."""
    row = Row(w.suite, w.name, w.short, "(inputs)", "-", w.to_dict(), status=ERROR)
    row.notes.append(f"building the inputs failed: {_describe(exc)}")
    print(f"   {row.notes[-1]}", flush=True)
    free_memory(device)
    return row


def start_row(case, impl, ctx: RunContext, have_ref: bool, ref_note: str) -> Tuple[Row, bool]:
    """``impl``'s row for ``case`` after ``impl.setup``; ``ready`` is False when the setup
    skipped, declined or failed (the row then says so and is final)."""
    w = case.workload
    row = Row(
        suite=w.suite, workload=w.name, short=w.short, impl=impl.name, kind=impl.kind,
        shape=w.to_dict(), is_speedup_baseline=impl.speedup_baseline,
    )
    try:
        impl.setup(case, ctx)
    except Skipped as exc:
        row.status, row.rel_err_note = SKIPPED, "-"
        row.notes.append(f"skipped: {exc}")
        return row, False
    except Declined as exc:
        row.status = DECLINED
        row.notes.append(f"declined: {exc}")
        return row, False
    except Exception as exc:  # noqa: BLE001
        row.status = ERROR
        row.notes.append(f"error in setup: {_describe(exc)}")
        return row, False
    row.notes.extend(impl.notes)
    if not impl.computes_workload:
        row.rel_err_note = "n/a"
    elif not have_ref:
        row.rel_err_note = ref_note
    return row, True


def time_impl(case, impl: Impl, ctx: RunContext, ref: Optional[Dict[str, torch.Tensor]], ref_note: str, *,
              inputs: Callable[[bool], tuple], out_for_ref: Callable[[object], torch.Tensor],
              grads_for_ref: Callable[[tuple], Dict[str, torch.Tensor]], backward: bool,
              min_runs: Optional[int] = None, fall_back: bool = True) -> Row:
    """Time ``impl`` on ``case`` (forward, then forward+backward when ``backward``) and check
    it against ``ref``; the row's rates are left to the caller.

    ``inputs(grad)`` gives ``(args, leaves, grad_outputs)``: ``impl(*args)`` returns one output
    or a list of them, ``grad_outputs`` is a list with one tensor per output and ``leaves`` are
    fresh autograd leaves when ``grad``. ``out_for_ref(out)`` and ``grads_for_ref(grads)`` map
    the output and the gradients of ``leaves`` to the reference's layout. ``min_runs`` goes to
    :func:`time_ms`. ``fall_back``: the first call of a phase goes through :func:`_first_call`
    (a pinned kernel that cannot run is retried with the general one); otherwise it is a plain
    call, for implementations that settle their kernel in setup.
    """
    w = case.workload
    row, ready = start_row(case, impl, ctx, ref is not None, ref_note)
    if not ready:
        return row
    check = ref is not None and impl.computes_workload
    device = case.device
    first_call = _first_call if fall_back else (lambda _impl, call, _row, _phase: call())

    def forward():
        args, _, _ = inputs(False)

        def fwd():
            with torch.no_grad():
                return impl(*args)

        out = first_call(impl, fwd, row, "fwd")
        if check:
            _compare(row, ref, {"out": out_for_ref(out)})
        del out
        if not backward:
            row.peak_extra_mib, row.peak_phase = peak_extra_mib(fwd, device), "fwd"
        row.fwd_ms = time_ms(fwd, device, CPU_REPEATS, min_runs=min_runs)
        if w.forward_only and device.type == "cuda":
            row.fwd_graph_ms, why = graph_time_ms(fwd, device)
            if why:
                row.notes.append(why)

    def forward_backward():
        reason = impl.backward_skip_reason(ctx)
        if reason:
            raise Skipped(reason)
        args, leaves, grad_outs = inputs(True)

        def step():
            out = impl(*args)
            outs = out if isinstance(out, list) else [out]
            return out, torch.autograd.grad(outs, leaves, grad_outs)

        out, grads = first_call(impl, step, row, "fwd+bwd")
        if check:
            got = grads_for_ref(grads)
            if "out" not in row.rel_err_detail:  # the forward phase failed or was skipped
                got["out"] = out_for_ref(out)
            _compare(row, ref, got)
        del out, grads
        row.peak_extra_mib, row.peak_phase = peak_extra_mib(step, device), "fwd+bwd"
        row.fwd_bwd_ms = time_ms(step, device, CPU_REPEATS, min_runs=min_runs)

    outcomes = [_run_phase(row, "fwd", forward)]
    free_memory(device)
    if backward:
        outcomes.append(_run_phase(row, "fwd+bwd", forward_backward))
        free_memory(device)
    row.notes = list(dict.fromkeys(row.notes))  # a decline often repeats for both phases
    if all(o == OK for o in outcomes):
        row.status = OK
    elif any(o == OK for o in outcomes):
        row.status = PARTIAL
    else:
        row.status = ERROR if ERROR in outcomes else DECLINED if DECLINED in outcomes else SKIPPED
    return row


def run_impl(case: Case, impl: Impl, ctx: RunContext, ref: Optional[Dict[str, torch.Tensor]], ref_note: str) -> Row:
    """Time ``impl`` on ``case`` (forward, then forward+backward) and check it against ``ref``."""
    w = case.workload

    def inputs(grad: bool):
        args, leaves, grad_out = _impl_inputs(case, impl, grad)
        return args, leaves, [grad_out]

    def grads_for_ref(grads):
        return {name: _from_layout(g, impl) if name != "dbias" else g for name, g in zip(GRAD_NAMES, grads)}

    row = time_impl(case, impl, ctx, ref, ref_note, inputs=inputs, out_for_ref=lambda out: _from_layout(out, impl),
                    grads_for_ref=grads_for_ref, backward=ctx.backward and not w.forward_only)
    derive_rates(row, w, case.dtype)
    return row


def derive_rates(row: Row, w: Workload, dtype: torch.dtype) -> None:
    if row.fwd_ms:
        row.tflops_fwd = w.flops_fwd() / (row.fwd_ms * 1e-3) / 1e12
        if w.forward_only:
            row.tb_per_s = w.io_bytes(dtype) / (row.fwd_ms * 1e-3) / 1e12
    if row.fwd_graph_ms:
        row.tb_per_s_graph = w.io_bytes(dtype) / (row.fwd_graph_ms * 1e-3) / 1e12
    if row.fwd_bwd_ms:
        row.tflops_fwd_bwd = w.flops_fwd_bwd() / (row.fwd_bwd_ms * 1e-3) / 1e12


def fill_speedups(rows: List[Row]) -> None:
    base = next((r for r in rows if r.is_speedup_baseline and r.fwd_ms), None)
    if base is None:
        for r in rows:
            r.notes.append("no speedup: the dense SDPA baseline did not run")
        return
    for r in rows:
        if r.fwd_ms:
            r.speedup_fwd = base.fwd_ms / r.fwd_ms
        if r.fwd_bwd_ms and base.fwd_bwd_ms:
            r.speedup_fwd_bwd = base.fwd_bwd_ms / r.fwd_bwd_ms


def workload_case(w, ctx: RunContext, make_case) -> Tuple[object, List[Row]]:
    """Print the workload's header and build its inputs, ``make_case(w, device, dtype)``:
    ``(case, [])``, or ``(None, [the inputs' error row])`` when that fails."""
    print(f"== {w.name}", flush=True)
    try:
        return make_case(w, ctx.device, ctx.dtype), []
    except Exception as exc:  # noqa: BLE001
        return None, [inputs_error_row(w, exc, ctx.device)]


def checked_reference(check: bool, compute: Callable[[], Dict[str, torch.Tensor]]
                      ) -> Tuple[Optional[Dict[str, torch.Tensor]], str]:
    """The float32 reference and the rows' note for it: ``(compute(), "-")`` when ``check``
    (the workload is small enough), else ``(None, "-")``; on failure, printed,
    ``(None, "ref failed")``."""
    if not check:
        return None, "-"
    try:
        return compute(), "-"
    except Exception as exc:  # noqa: BLE001
        print(f"   float32 reference failed: {_describe(exc)}", flush=True)
        return None, "ref failed"


def implementations_or_error_row(w, make: Callable[[], List[Impl]]) -> Tuple[List[Impl], List[Row]]:
    """``(make(), [])``; when creating the implementations fails, ``([], [its error row])``."""
    try:
        return make(), []
    except Exception as exc:  # noqa: BLE001
        row = Row(w.suite, w.name, w.short, "(setup)", "-", w.to_dict(), status=ERROR)
        row.notes.append(f"creating the implementations failed: {_describe(exc)}")
        return [], [row]


def run_suite_workload(w, ctx: RunContext, *, case_type, check_reference: bool,
                       reference: Callable[[object], Dict[str, torch.Tensor]],
                       implementations: Callable[[], List[Impl]], run_one, progress: Callable[[Row], str],
                       finish: Callable[[List[Row]], None]) -> List[Row]:
    """Every row of one workload of a suite with its own inputs and runner (varlen, dma_long);
    failures become rows, never exceptions.

    The inputs are ``case_type(w, device, dtype)``; ``reference(case)`` is the float32 oracle,
    computed when ``check_reference``; each of ``implementations()`` gets the row
    ``run_one(case, impl, ctx, ref, ref_note)``, is printed as ``progress(row)`` and is then
    dropped with its state (copies, masks, layer weights) before the next one runs. Speedups
    are filled in, then ``finish(rows)`` adds the suite's own columns.
    """
    case, failed = workload_case(w, ctx, case_type)
    if failed:
        return failed
    ref, ref_note = checked_reference(check_reference, lambda c=case: reference(c))
    if check_reference:
        free_memory(ctx.device)

    impls, rows = implementations_or_error_row(w, implementations)
    while impls:
        impl = impls.pop(0)
        row = run_one(case, impl, ctx, ref, ref_note)
        rows.append(row)
        print(progress(row), flush=True)
        del impl
        free_memory(ctx.device)
    fill_speedups(rows)
    finish(rows)
    del case, ref
    if ctx.cuda:
        # Flex (run directly or picked by auto-dispatch) compiles per shape: dropping its
        # kernels keeps the compile cache below torch's recompile limit.
        torch.compiler.reset()
    free_memory(ctx.device)
    return rows
