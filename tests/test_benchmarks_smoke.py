"""The benchmark suite runs end to end on CPU in --quick mode and writes its reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_reports(tmp_path):
    env = dict(os.environ)
    # The smoke test is about the CPU path, also on a machine that has a GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("FLASH_DMATTN_BACKEND", None)
    env.pop("FLASH_DMATTN_DISABLE", None)
    # conftest turns on Triton's interpreter for the kernel tests; a benchmark must not use it
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--suite", "dense,dynamic", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"

    out_dir = tmp_path / "cpu"
    json_files = sorted(out_dir.glob("*.json"))
    md_files = sorted(out_dir.glob("*.md"))
    assert len(json_files) == 1 and len(md_files) == 1, sorted(p.name for p in out_dir.iterdir())

    doc = json.loads(json_files[0].read_text())
    assert doc["environment"]["torch"] and doc["environment"]["date"]
    rows = doc["rows"]
    assert {r["suite"] for r in rows} == {"dense", "dynamic"}
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
