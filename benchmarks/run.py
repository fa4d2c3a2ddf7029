"""Benchmark flash_dmattn backends against SDPA and FlexAttention.

Usage::

    python -m benchmarks.run [--suite dense,dynamic,block_sparse,upstream,decode,varlen,dma_long | all]
                             [--quick] [--out benchmarks/results] [--backends flex,...] [--no-bwd]

Writes ``<out>/<device-slug>/<tag>.json``, ``.md`` and ``.png`` (``<device-slug>`` is the GPU
name, or ``cpu``) and prints the markdown table. See ``benchmarks/README.md``.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import flash_dmattn
from flash_dmattn import BackendUnavailableError, flash_dmattn_func_auto, get_available_backends
from flash_dmattn.registry import PRIORITY

from . import report
from .impls import RunContext, implementations
from .measure import (CPU_REPEATS, REFERENCE_CHECK_MAX_WORK, checked_reference, device_memory, fill_speedups,
                      free_memory, implementations_or_error_row, reference_outputs, run_impl, workload_case)
from .report import Row
from .timing import timing_method
from .suites import SUITES, workloads_for
from .workloads import Workload, build_case

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def run_workload(w: Workload, ctx: RunContext, backends: List[str]) -> List[Row]:
    """Every implementation on one workload; failures become rows, never exceptions."""
    if w.suite == "varlen":  # packed inputs, its own rows (benchmarks/varlen.py)
        from .varlen import run_varlen_workload

        return run_varlen_workload(w, ctx, backends)
    if w.suite == "dma_long":  # KeyIntervals, selection build and layer steps (benchmarks/dma_long.py)
        from .dma_long import run_dma_long_workload

        return run_dma_long_workload(w, ctx, backends)
    if w.suite == "cp":  # context parallelism: torchrun launches per variant (benchmarks/cp.py)
        from .cp import run_cp_workload

        return run_cp_workload(w, ctx, backends)
    case, failed = workload_case(w, ctx, build_case)
    if failed:
        return failed
    ref, ref_note = checked_reference(w.seqlen_q * w.seqlen_k <= REFERENCE_CHECK_MAX_WORK,
                                      lambda c=case: reference_outputs(c, ctx.backward and not w.forward_only))
    impls, rows = implementations_or_error_row(w, lambda: implementations(w, ctx, backends))
    for impl in impls:
        # Implementations without cache_seqlens run on the used prefix of a part-filled cache;
        # the row keeps the workload's own name and rates (counted on the used keys).
        impl_case = case if impl.takes_cache_seqlens else case.used_prefix()
        row = run_impl(impl_case, impl, ctx, ref, ref_note)
        if impl_case is not case:
            row.workload, row.short, row.shape = w.name, w.short, w.to_dict()
            row.notes.append("K/V sliced to the used cache length")
        rows.append(row)
        print(
            f"   {row.impl:<36} fwd {report.fmt_ms(row.fwd_ms):>9} ms  fwd+bwd {report.fmt_ms(row.fwd_bwd_ms):>9} ms"
            + (f"  graph {report.fmt_ms(row.fwd_graph_ms)} ms" if row.fwd_graph_ms else "")
            + f"  {row.status}  err {report.fmt_err(row)}"
            f"{'  ' + '; '.join(row.notes) if row.notes else ''}",
            flush=True,
        )
        del impl
        free_memory(ctx.device)
    fill_speedups(rows)
    del case, ref, impls
    if ctx.cuda:
        # Each workload compiles its own Flex kernels; dropping them keeps the compile cache
        # below torch's recompile limit (past it, compiled calls silently run eagerly).
        torch.compiler.reset()
    free_memory(ctx.device)
    return rows


# ---------------------------------------------------------------------------------------------
# Command line


def _parse_list(text: str, allowed: Sequence[str], what: str, parser) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="all", help=f"comma list of {', '.join(SUITES)}, or all (default)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (L <= 512, H <= 4): runs on CPU in seconds")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results root; files go to <out>/<device-slug>/")
    parser.add_argument("--backends", default=None, help="comma list of flash_dmattn backends (default: all available)")
    parser.add_argument("--no-bwd", action="store_true", help="forward only")
    parser.add_argument("--match", default=None,
                        help="comma list of substrings: run only workloads whose name contains one "
                             "(e.g. 'L16384 D128 causal')")
    parser.add_argument("--skip", default="",
                        help="comma list of substrings: leave out implementations whose name "
                             "contains one (e.g. 'flex' to spare its compiles)")
    args = parser.parse_args(argv)
    # Hyphens are accepted for underscores (``dma-long`` is ``dma_long``).
    suite_text = args.suite.replace("-", "_")
    args.suites = list(SUITES) if suite_text.strip() == "all" else _parse_list(suite_text, SUITES, "suite", parser)
    args.backend_list = _parse_list(args.backends, PRIORITY, "backend", parser) if args.backends else None
    return args


def _resolve_backends(requested: Optional[List[str]]) -> Tuple[List[str], Dict[str, str]]:
    """(backends to run, {unavailable backend: why})."""
    unavailable = {}
    for name in PRIORITY:
        try:
            flash_dmattn_func_auto(name)
        except BackendUnavailableError as exc:
            unavailable[name] = str(exc)
    available = get_available_backends()
    if requested is None:
        return available, unavailable
    return [n for n in requested if n in available], unavailable


def environment(ctx: RunContext, args: argparse.Namespace, backends: List[str], unavailable: Dict[str, str]) -> dict:
    """What the numbers were measured on."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(ctx.device),
        "gpu_name": None,
        "torch": torch.__version__,
        "triton": triton_version,
        "flash_dmattn": flash_dmattn.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "timing": timing_method(ctx.device, CPU_REPEATS),
        "quick": args.quick,
        "backward": ctx.backward,
        "suites": args.suites,
        "backends_available": get_available_backends(),
        "backends_run": backends,
        "backends_unavailable": unavailable,
        "argv": sys.argv[1:],
    }
    if ctx.cuda and "dma_long" in args.suites:
        from .dma_long import MIN_RUNS

        env["timing"] += f"; dma_long rows: CUDA events, median of >= {MIN_RUNS} runs after >= 2 warm-up calls"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(
            gpu_name=props.name,
            gpu_capability=f"sm_{props.major}{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        env.update(cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return env


def _suite_notes(suites: Sequence[str]):
    """The report's per-suite digests and reading notes of the suites with their own runners."""
    summaries, readings = {}, {}
    if "dma_long" in suites:
        from . import dma_long

        summaries["dma_long"], readings["dma_long"] = dma_long.summary_markdown, dma_long.READING
    if "cp" in suites:
        from . import cp

        summaries["cp"], readings["cp"] = cp.summary_markdown, cp.READING
    return summaries, readings


def main(argv=None) -> int:
    """Run the selected suites, write JSON / markdown / PNG and print the markdown."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 is what GPUs train in; CPU kernels for bf16 are slow and not what anyone deploys.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = RunContext(device, dtype, args.quick, device_memory(device), backward=not args.no_bwd,
                     skip=tuple(p for p in args.skip.split(",") if p))
    backends, unavailable = _resolve_backends(args.backend_list)
    for name in args.backend_list or []:
        if name in unavailable:
            print(f"note: {unavailable[name]}", flush=True)
    if device.type == "cpu" and not args.quick:
        print("note: full-size shapes on CPU take a very long time; --quick is the CPU mode", file=sys.stderr)
    env = environment(ctx, args, backends, unavailable)

    rows: List[Row] = []
    for suite in args.suites:
        suite_backends = backends
        if suite == "dma_long" and args.backend_list is None:
            # Its rows are auto-dispatch plus explicit backends; by default just triton (GPU).
            from .dma_long import default_backends

            suite_backends = default_backends(ctx)
        for w in workloads_for(suite, args.quick):
            if args.match and not any(m.strip() and m.strip() in w.name for m in args.match.split(",")):
                continue
            rows.extend(run_workload(w, ctx, suite_backends))
    for r in rows:
        r.fwd_ms, r.fwd_bwd_ms = report.finite_or_none(r.fwd_ms), report.finite_or_none(r.fwd_bwd_ms)
        r.rel_err = report.finite_or_none(r.rel_err)

    out_dir = Path(args.out) / (report.slug(env["gpu_name"]) if env["gpu_name"] else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = ("quick-" if args.quick else "") + ("all" if args.suites == list(SUITES) else "-".join(args.suites))
    json_path, md_path, png_path = (out_dir / f"{tag}.{ext}" for ext in ("json", "md", "png"))
    plot_note = report.plot(png_path, rows, args.suites)
    env["plot"] = plot_note or str(png_path)
    report.write_json(json_path, rows, env)
    text = report.markdown(rows, env, args.suites, *_suite_notes(args.suites))
    md_path.write_text(text)
    print()
    print(text)
    print(f"wrote {json_path}")
    print(f"wrote {md_path}")
    print(plot_note or f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
