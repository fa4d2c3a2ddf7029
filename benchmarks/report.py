"""Result rows and their outputs: JSON, a markdown table per suite, and a PNG plot."""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

# Row status values, in the order a reader cares about them.
OK, PARTIAL, DECLINED, SKIPPED, ERROR = "ok", "partial", "declined", "skipped", "error"


@dataclass
class Row:
    """One implementation on one workload (one line of the table)."""

    suite: str
    workload: str
    short: str
    impl: str
    kind: str
    shape: dict
    status: str = OK
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    tflops_fwd: Optional[float] = None
    tflops_fwd_bwd: Optional[float] = None
    speedup_fwd: Optional[float] = None
    speedup_fwd_bwd: Optional[float] = None
    tb_per_s: Optional[float] = None
    # Forward-only (decode) workloads on CUDA: one replay of the call captured in a CUDA graph
    # (the kernels' time without the host's launch overhead) and its bandwidth.
    fwd_graph_ms: Optional[float] = None
    tb_per_s_graph: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    peak_phase: Optional[str] = None
    rel_err: Optional[float] = None
    rel_err_detail: Dict[str, float] = field(default_factory=dict)
    rel_err_note: str = "-"
    is_speedup_baseline: bool = False
    notes: List[str] = field(default_factory=list)
    # varlen: on a backend's packed row, its time over its sequential / padded rows'
    # ("packed/sequential fwd", "packed/padded fwd+bwd", ...).
    ratios: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _num(x: Optional[float], fmt: str) -> str:
    if x is None:
        return "-"
    if fmt == "rate":  # TFLOP/s, TB/s: hundreds on a GPU, thousandths on a CPU
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2g}"
    if fmt == "ratio":  # speedups: 2 decimals, but never a misleading 0.00
        return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"
    return format(x, fmt)


def _pair(a: Optional[float], b: Optional[float], fmt: str, suffix: str = "") -> str:
    if a is None and b is None:
        return "-"
    left = "-" if a is None else _num(a, fmt) + suffix
    right = "-" if b is None else _num(b, fmt) + suffix
    return f"{left} / {right}"


def fmt_err(row: Row) -> str:
    """The row's relative error against the float32 reference, or why there is none."""
    if row.rel_err is None:
        return row.rel_err_note
    return f"{row.rel_err:.1e}"


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


AUTO_IMPL = "flash_dmattn[auto]"
# auto-dispatch more than this much slower than the fastest explicit backend is marked.
AUTO_SLACK = 1.05


def auto_digest(rows: List[Row]) -> List[str]:
    """One line per workload that has an auto-dispatch row: its fwd and fwd+bwd times beside
    the fastest explicit flash_dmattn backend's (same run), marked where auto is slower than
    that by more than ``AUTO_SLACK``."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        auto = next((r for r in mine if r.impl == AUTO_IMPL), None)
        if auto is None:
            continue
        explicit = [r for r in mine if r.kind == "flash_dmattn" and r.impl != AUTO_IMPL
                    and r.impl.startswith("flash_dmattn[") and r.impl.endswith("]")]
        cells = []
        for label, attr in (("fwd", "fwd_ms"), ("fwd+bwd", "fwd_bwd_ms")):
            timed = [(getattr(r, attr), r.impl[len("flash_dmattn["):-1]) for r in explicit
                     if getattr(r, attr) is not None]
            mine_ms = getattr(auto, attr)
            if mine_ms is None or not timed:
                continue
            best_ms, best = min(timed)
            mark = " **slower**" if mine_ms > AUTO_SLACK * best_ms else ""
            cells.append(f"{label} auto {fmt_ms(mine_ms)} ms, best {best} {fmt_ms(best_ms)} ms"
                         f" ({mine_ms / best_ms:.2f}×){mark}")
        if cells:
            picks = next((n for n in auto.notes if n.startswith("auto-dispatch picks")), "")
            out.append(f"- {workload}: " + "; ".join(cells) + (f" — {picks}" if picks else ""))
    if out:
        out.insert(0, "Auto-dispatch against the fastest explicit backend of the same run:")
    return out


def markdown(rows: List[Row], env: dict, suites: List[str],
             summaries: Optional[Dict[str, Callable[[List[Row]], List[str]]]] = None,
             readings: Optional[Dict[str, str]] = None) -> str:
    """Markdown report: an environment header, one table per suite, then how to read it.

    ``summaries[suite](rows)``: lines printed above that suite's table (a suite's own digest);
    ``readings[suite]``: that suite's paragraph of the how-to-read notes. Suites with their own
    runners supply both (``benchmarks.run`` collects them), so this module imports none of them.
    """
    summaries, readings = summaries or {}, readings or {}
    out = ["# flash_dmattn benchmarks", ""]
    device = env.get("gpu_name") or "cpu"
    out.append(
        f"- device: {device}; dtype {env['dtype']}; torch {env['torch']}; triton {env['triton']}; "
        f"flash_dmattn {env['flash_dmattn']}; {env['date']}"
    )
    out.append(f"- timing: {env['timing']}")
    out.append(f"- backends available: {', '.join(env['backends_available']) or 'none'}")
    if env.get("quick"):
        out.append("- `--quick`: tiny shapes, for checking that the suite runs, not for conclusions")
    out.append("")
    for suite in suites:
        suite_rows = [r for r in rows if r.suite == suite]
        if not suite_rows:
            continue
        decode = suite == "decode"
        cols = ["workload", "impl", "fwd ms", "fwd+bwd ms", "TFLOP/s fwd / fwd+bwd", "speedup fwd / fwd+bwd"]
        if decode:
            cols = ["workload", "impl", "fwd ms", "TB/s", "speedup", "graph fwd ms", "graph TB/s"]
        varlen = suite == "varlen"
        if varlen:
            cols += ["packed/sequential fwd / fwd+bwd", "packed/padded fwd / fwd+bwd"]
        cols += ["peak extra MiB", "rel err", "notes"]
        out += [f"## {suite}", ""]
        if suite in summaries:
            out += summaries[suite](suite_rows) + [""]
        else:
            digest = auto_digest(suite_rows)
            if digest:
                out += digest + [""]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        previous = None
        for r in suite_rows:
            label = r.workload if r.workload != previous else ""
            previous = r.workload
            if decode:
                cells = [label, r.impl, fmt_ms(r.fwd_ms), _num(r.tb_per_s, "rate"),
                         _num(r.speedup_fwd, "ratio") + ("×" if r.speedup_fwd is not None else ""),
                         fmt_ms(r.fwd_graph_ms), _num(r.tb_per_s_graph, "rate")]
            else:
                cells = [label, r.impl, fmt_ms(r.fwd_ms), fmt_ms(r.fwd_bwd_ms),
                         _pair(r.tflops_fwd, r.tflops_fwd_bwd, "rate"),
                         _pair(r.speedup_fwd, r.speedup_fwd_bwd, "ratio", "×")]
            if varlen:
                cells += [_pair(r.ratios.get(f"packed/{o} fwd"), r.ratios.get(f"packed/{o} fwd+bwd"), "ratio", "×")
                          for o in ("sequential", "padded")]
            cells += [_num(r.peak_extra_mib, ".0f"), fmt_err(r), _cell("; ".join(r.notes))]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += [
        "How to read: times are medians. FLOPs are nominal, 4·B·H·Lq·Lk·D per forward (halved when "
        "causal, backward = 2.5× forward) whatever the sparsity, so a sparse kernel can exceed the "
        "hardware peak. Speedup = time of the row marked as the workload's dense SDPA baseline "
        "(cuDNN on CUDA, PyTorch's default on CPU; dense causal for masked workloads) / this row's "
        "time. TB/s (decode) = bytes of K+V (+ per-key mask and bias) / forward time, counting only the used keys of a part-filled cache (flash_dmattn gets cache_seqlens; the baselines K/V sliced to the used length). graph fwd ms / graph TB/s (decode, CUDA): the same call captured once in a CUDA graph and replayed, i.e. the kernels' time without the host's launch overhead, which dominates eager decode steps of a few microseconds. Peak extra = "
        "max_memory_allocated during one call minus what was allocated before it (inputs excluded). "
        "rel err = max over out, dq, dk, dv (and dbias) of ‖x−ref‖/‖ref‖ against the torch-reference "
        "backend in float32 on the same inputs, computed where Lq·Lk ≤ 8192². flex-direct's "
        "BlockMask is built outside the timed region; the materialised SDPA mask inside it.",
        "",
    ]
    for suite in suites:
        if suite in readings:
            out += [readings[suite], ""]
    if "varlen" in suites:
        out += [
            "varlen: FLOPs count the real tokens only (Σ over sequences of 4·H·L²·D, halved when "
            "causal), also for the padded rows; the speedup reference is cuDNN SDPA on the padded "
            "batch (is_causal only). packed/sequential and packed/padded = a backend's packed time / "
            "its own sequential (one dense call per sequence) or padded time; the target is "
            "fwd+bwd ≤ 1.1× sequential and < 1× padded. rel err is on the real tokens, against the "
            "torch-reference varlen path in float32 on the packed inputs.",
            "",
        ]
    return "\n".join(out)


def write_json(path: Path, rows: List[Row], env: dict) -> None:
    """All rows and the environment as one JSON document."""
    doc = {"environment": env, "rows": [r.to_dict() for r in rows]}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def plot(path: Path, rows: List[Row], suites: List[str]) -> Optional[str]:
    """Bar charts of time per workload and implementation; returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on benchmark machines
        import matplotlib.patches  # noqa: F401  (legend handles)
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"plot skipped: matplotlib is not importable ({type(exc).__name__}: {exc})"

    grid = []
    for suite in suites:
        suite_rows = [r for r in rows if r.suite == suite]
        second = ("tb_per_s", "TB/s (higher is better)") if suite == "decode" else (
            "fwd_bwd_ms", "forward+backward ms (lower is better)")
        grid.append((suite, suite_rows, [("fwd_ms", "forward ms (lower is better)"), second]))
    grid = [g for g in grid if any(getattr(r, m) for r in g[1] for m, _ in g[2])]
    if not grid:
        return "plot skipped: no timings"
    # One colour per implementation across all panels, and one legend for the figure.
    labels = list(dict.fromkeys(
        _plot_label(r.impl) for _, suite_rows, metrics in grid for r in suite_rows
        if any(getattr(r, m) for m, _ in metrics)
    ))
    # More than 10 implementations (all suites, or varlen's packed/sequential/padded rows):
    # tab20, so that no two share a colour.
    palette = plt.get_cmap("tab20") if len(labels) > 10 else None
    colours = {label: palette(i % 20) if palette else f"C{i}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(len(grid), 2, figsize=(16, 3.8 * len(grid) + 0.8), squeeze=False)
    for (suite, suite_rows, metrics), ax_row in zip(grid, axes):
        for ax, (metric, label) in zip(ax_row, metrics):
            ax.set_title(f"{suite}: {label}", fontsize=10)
            if not any(getattr(r, metric) for r in suite_rows):
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            _bars(ax, suite_rows, metric, colours)
            if metric.endswith("_ms"):
                ax.set_yscale("log")
    handles = [matplotlib.patches.Patch(color=colours[label], label=label) for label in labels]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(labels), 6), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _plot_label(impl: str) -> str:
    # "sdpa-cudnn (dense causal)" and "sdpa-cudnn" are the same kernel: one colour per kernel.
    return impl.split(" (")[0]


def _bars(ax, suite_rows: List[Row], metric: str, colours: Dict[str, str]) -> None:
    workloads = list(dict.fromkeys(r.short for r in suite_rows))
    values: Dict[str, Dict[str, float]] = {}
    for r in suite_rows:
        if getattr(r, metric):
            values.setdefault(_plot_label(r.impl), {})[r.short] = getattr(r, metric)
    width = 0.8 / max(1, len(values))
    for i, (impl, by_workload) in enumerate(values.items()):
        offset = (i - (len(values) - 1) / 2) * width
        xs = [j + offset for j, w in enumerate(workloads) if w in by_workload]
        ys = [by_workload[w] for w in workloads if w in by_workload]
        ax.bar(xs, ys, width=width, color=colours[impl])
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)


def finite_or_none(x: Optional[float]) -> Optional[float]:
    """JSON has no NaN/inf: keep those out of the numeric fields."""
    if x is None or not math.isfinite(x):
        return None
    return x
