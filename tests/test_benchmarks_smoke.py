"""The benchmark suite runs end to end on CPU in --quick mode and writes its reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_module(*args: str) -> subprocess.CompletedProcess:
    """``python -m <args>`` from the repository on the CPU path; asserts it succeeded."""
    env = dict(os.environ)
    # The smoke tests are about the CPU path, also on a machine that has a GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("FLASH_DMATTN_BACKEND", None)
    env.pop("FLASH_DMATTN_DISABLE", None)
    # conftest turns on Triton's interpreter for the kernel tests; a benchmark must not use it
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res


def _run_quick(tmp_path, suites: str):
    """``benchmarks.run --quick`` on ``suites`` (comma list): its result, the rows of its JSON
    report (checked to be of those suites) and the report folder."""
    res = _run_module("benchmarks.run", "--quick", "--suite", suites, "--out", str(tmp_path))
    out_dir = tmp_path / "cpu"
    names = [n.replace("-", "_") for n in suites.split(",")]
    doc = json.loads((out_dir / f"quick-{'-'.join(names)}.json").read_text())
    assert doc["environment"]["torch"] and doc["environment"]["date"]
    rows = doc["rows"]
    assert {r["suite"] for r in rows} == set(names)
    return res, rows, out_dir


def test_quick_benchmark_writes_reports(tmp_path):
    res, rows, out_dir = _run_quick(tmp_path, "dense,dynamic")
    json_files = sorted(out_dir.glob("*.json"))
    md_files = sorted(out_dir.glob("*.md"))
    assert len(json_files) == 1 and len(md_files) == 1, sorted(p.name for p in out_dir.iterdir())
    errors = [(r["workload"], r["impl"], r["notes"]) for r in rows if r["status"] == "error"]
    assert not errors, errors

    def ran(name_part):
        return [r for r in rows if name_part in r["impl"] and r["fwd_ms"] and r["fwd_ms"] > 0]

    reference, sdpa = ran("torch-reference"), ran("sdpa")
    assert reference and sdpa
    # Both suites, forward and backward, and the float32 reference check reached them.
    assert {r["suite"] for r in reference} == {"dense", "dynamic"}
    assert all(r["fwd_bwd_ms"] for r in reference)
    assert all(r["rel_err"] is not None and r["rel_err"] < 1e-4 for r in reference)
    assert any(r["is_speedup_baseline"] and r["speedup_fwd"] == 1.0 for r in sdpa)

    md = md_files[0].read_text()
    assert "torch-reference" in md and "sdpa" in md
    assert "## dense" in md and "## dynamic" in md
    assert "| workload | impl |" in res.stdout  # the table is printed at the end


def test_quick_varlen_benchmark(tmp_path):
    # The varlen suite (packed vs sequential vs padded) on CPU, every available backend.
    res, rows, out_dir = _run_quick(tmp_path, "varlen")
    errors = [(r["workload"], r["impl"], r["notes"]) for r in rows if r["status"] == "error"]
    assert not errors, errors
    assert len({r["workload"] for r in rows}) == 2  # without and with the per-key mask + bias

    by_impl = {}
    for r in rows:
        by_impl.setdefault(r["impl"], []).append(r)
    for mode in ("packed", "sequential", "padded"):
        mine = by_impl[f"flash_dmattn[torch-reference] {mode}"]
        assert len(mine) == 2
        for r in mine:
            assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
            # out, dq, dk, dv (and dbias on the masked workload) against the float32 oracle
            assert r["rel_err"] is not None and r["rel_err"] < 1e-4, r
            assert {"out", "dq", "dk", "dv"} <= set(r["rel_err_detail"])
    masked = [r for r in by_impl["flash_dmattn[torch-reference] padded"] if "mask+bias" in r["workload"]]
    assert masked and "dbias" in masked[0]["rel_err_detail"]
    for r in by_impl["flash_dmattn[torch-reference] packed"]:
        assert set(r["ratios"]) == {f"packed/{o} {p}" for o in ("sequential", "padded") for p in ("fwd", "fwd+bwd")}
        assert any(n.startswith("target (") for n in r["notes"])
    # A backend without a varlen path says so (and its sequential row is skipped, not run).
    for r in by_impl.get("flash_dmattn[flex] packed", []):
        assert r["status"] == "declined" and "varlen" in r["notes"][0], r
    for r in by_impl.get("flash_dmattn[flex] sequential", []):
        assert r["status"] == "skipped", r
    sdpa = [r for r in rows if r["impl"].startswith("sdpa padded")]
    assert sdpa and any(r["is_speedup_baseline"] and r["speedup_fwd"] == 1.0 for r in sdpa)
    # No mask: SDPA on the padded batch computes the workload (compared on the real tokens).
    assert all(r["rel_err"] < 1e-4 for r in sdpa if "mask+bias" not in r["workload"])

    md = (out_dir / "quick-varlen.md").read_text()
    assert "## varlen" in md and "packed/sequential" in md and "flash_dmattn[torch-reference] packed" in md


def test_profile_tables(tmp_path):
    """benchmarks.profile prints and writes a per-op table for each (workload, backend) pair."""
    _run_module("benchmarks.profile", "--quick", "--suite", "dynamic", "--backends", "torch-reference",
                "--rows", "5", "--iters", "1", "--out", str(tmp_path))
    text = (tmp_path / "profile-dynamic.txt").read_text()
    assert "| torch-reference | fwd+bwd" in text
    assert "flash_dmattn::reference_fwd" in text or "aten::" in text
    assert "not run" not in text


def test_quick_dma_long_benchmark(tmp_path):
    """The dma-long suite (KeyIntervals from topk_intervals, selection build, dense and
    selected-keys SDPA, layer steps) on CPU with torch-reference, float32, L 256-512."""
    res, rows, out_dir = _run_quick(tmp_path, "dma-long")
    errors = [(r["workload"], r["impl"], r["notes"]) for r in rows if r["status"] != "ok"]
    assert not errors, errors

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    attention = [w for w in workloads if "layer step" not in w]
    layers = [w for w in workloads if "layer step" in w]
    assert any("shared top-" in w for w in attention) and any("causal top-" in w for w in attention)
    assert layers

    def rows_of(workload):
        return {r["impl"]: r for r in rows if r["workload"] == workload}

    for w in attention:
        mine = rows_of(w)
        assert set(mine) == {"topk_intervals (selection)", "flash_dmattn[auto]", "flash_dmattn[torch-reference]",
                             "sdpa (dense causal)", "sdpa (selected keys only)"}, sorted(mine)
        sel = mine["topk_intervals (selection)"]
        assert sel["fwd_ms"] > 0 and sel["fwd_bwd_ms"] is None
        for impl in ("flash_dmattn[auto]", "flash_dmattn[torch-reference]"):
            r = mine[impl]
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
            # out, dq, dk, dv, dbias against the float32 oracle on the dense form of the intervals
            assert {"out", "dq", "dk", "dv", "dbias"} <= set(r["rel_err_detail"]), r
            assert r["rel_err"] < 1e-4, r
            assert set(r["ratios"]) == {f"/{o} {p}" for o in ("dense", "selected") for p in ("fwd", "fwd+bwd")}
        assert mine["sdpa (dense causal)"]["is_speedup_baseline"]
        assert mine["sdpa (selected keys only)"]["fwd_bwd_ms"] > 0
    for w in layers:
        mine = rows_of(w)
        assert set(mine) == {"DynamicMaskAttention[auto]", "DynamicMaskAttention[torch-reference]",
                             "dense layer (sdpa causal)"}, sorted(mine)
        for r in mine.values():
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
        assert set(mine["DynamicMaskAttention[auto]"]["ratios"]) == {"/dense fwd", "/dense fwd+bwd"}

    md = (out_dir / "quick-dma_long.md").read_text()
    assert "## dma_long" in md and "÷dense fwd / fwd+bwd" in md and "select ms" in md
    assert "÷selected fwd / fwd+bwd" in res.stdout  # the summary table is printed
