"""The built package carries the CUDA kernel sources, so a wheel can compile them on first use.

Runs the project's own ``build_py`` (setup.py) into a temporary directory and checks that
every source the JIT compiles, and every header, lands in ``flash_dmattn/csrc`` -- the first
place :func:`flash_dmattn.backends.cuda.jit.find_csrc_dir` looks.
"""
import subprocess
import sys
from pathlib import Path

from flash_dmattn.backends.cuda import jit

ROOT = Path(__file__).resolve().parents[1]


def test_build_py_ships_kernel_sources(tmp_path):
    res = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    shipped = tmp_path / "flash_dmattn" / "csrc"
    for name in jit.KERNEL_SOURCES:
        assert (shipped / name).is_file(), name
    headers = sorted(p.relative_to(ROOT / "csrc") for p in (ROOT / "csrc").rglob("*.h*"))
    assert headers, "csrc has no headers?"
    for rel in headers:
        assert (shipped / rel).read_bytes() == (ROOT / "csrc" / rel).read_bytes(), rel
    # The installed layout is what the JIT resolves first: <package>/csrc.
    assert jit.package_csrc_dirs()[0].parts[-2:] == ("flash_dmattn", "csrc")
