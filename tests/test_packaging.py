"""The built package carries the CUDA kernel sources, so a wheel can compile them on first use.

Runs the project's own ``build_py`` (setup.py) into a temporary directory and checks that
every source the JIT compiles, and every header, lands in ``flash_dmattn/csrc`` -- the first
place :func:`flash_dmattn.backends.cuda.jit.find_csrc_dir` looks.
"""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from flash_dmattn._version import __version__
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


# The distributions a user installs -------------------------------------------------------------
# `python -m build` makes the sdist, then the wheel from that sdist: the wheel can carry the
# kernel sources only if the sdist did. Built once per module, from a copy of what the build
# reads, so the working tree gets no build/ or egg-info from the tests.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE")
KERNEL_SOURCE_SUFFIXES = (".cu", ".cpp", ".cuh", ".h", ".hpp", ".inl")


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist")
    src = work / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("flash_dmattn", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    res = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"), str(src)],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (sdist,) = (work / "dist").glob("*.tar.gz")
    (wheel,) = (work / "dist").glob("*.whl")
    return work, sdist, wheel


def kernel_sources():
    files = sorted(p.relative_to(ROOT / "csrc").as_posix() for p in (ROOT / "csrc").rglob("*")
                   if p.is_file() and p.name.endswith(KERNEL_SOURCE_SUFFIXES))
    assert len(files) >= len(jit.KERNEL_SOURCES)
    return files


def test_sdist_carries_the_kernel_sources_and_the_license(dists):
    _, sdist, _ = dists
    top = f"flash_dmattn-{__version__}"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    missing = [rel for rel in kernel_sources() if f"{top}/csrc/{rel}" not in names]
    assert not missing, f"sdist lacks kernel sources: {missing}"
    assert f"{top}/LICENSE" in names
    assert "License-Expression: BSD-3-Clause" in pkg_info
    assert f"Version: {__version__}" in pkg_info


def test_wheel_carries_the_kernel_sources_and_the_license(dists):
    _, _, wheel = dists
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"flash_dmattn-{__version__}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode()
        shipped = {rel: whl.read(f"flash_dmattn/csrc/{rel}") for rel in kernel_sources()
                   if f"flash_dmattn/csrc/{rel}" in names}
    missing = [rel for rel in kernel_sources() if rel not in shipped]
    assert not missing, f"wheel lacks kernel sources: {missing}"
    for rel, data in shipped.items():
        assert data == (ROOT / "csrc" / rel).read_bytes(), rel
    assert f"{info}/licenses/LICENSE" in names
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "License-File: LICENSE" in metadata
    assert f"Version: {__version__}" in metadata
    assert "Requires-Dist: torch>=2.5" in metadata


def test_wheel_installs_into_a_fresh_venv_and_info_runs(dists):
    """``pip install dist/*.whl`` into a new virtual environment, then the README's ``info``.

    The environment sees this machine's packages (``--system-site-packages``: torch is not
    downloaded again) but none of this checkout: the import must resolve to the installed wheel,
    whose kernel sources are the first place the cuda backend looks."""
    work, _, wheel = dists
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    res = subprocess.run([str(python), "-m", "pip", "install", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    where = subprocess.run(
        [str(python), "-c", "import flash_dmattn; from flash_dmattn.backends.cuda import jit; "
         "print(flash_dmattn.__file__); print(jit.find_csrc_dir())"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-2000:]
    module_file, csrc = (Path(line) for line in where.stdout.split())
    site = venv / "lib"
    assert site in module_file.parents, f"imported {module_file}, not the installed wheel"
    assert site in csrc.parents and (csrc / "flash_fwd.cu").is_file()
    info = subprocess.run([str(python), "-m", "flash_dmattn", "info"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr[-2000:]
    assert f"flash_dmattn {__version__}" in info.stdout
    assert any(line.split()[:2] == ["torch-reference", "yes"] for line in info.stdout.splitlines())
