"""Setuptools shim: the metadata lives in pyproject.toml.

The CUDA backend compiles its kernels on first use (see flash_dmattn/backends/cuda), so an
install never runs nvcc and works on machines without a GPU. The kernel sources (the top-level
``csrc``) are copied into the built package as ``flash_dmattn/csrc``, where the backend looks
first, so a wheel or a non-editable install can build them too.

Opt-in prebuild: ``FLASH_DMATTN_PREBUILD=all`` (or a comma-separated list of specs such as
``d128-bf16-mask-bias,d64-fp16``) runs ``python -m flash_dmattn build ...`` after the package is
built, into the same on-disk cache the first use would fill. It needs the target environment's
torch, so install with ``pip install --no-build-isolation``. Without nvcc, a GPU or torch it
prints why and skips; a failed prebuild never fails the install (first use builds instead).
Unset, nothing changes.
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

PREBUILD = os.environ.get("FLASH_DMATTN_PREBUILD", "").strip()


HERE = os.path.dirname(os.path.abspath(__file__))
CSRC_SUFFIXES = (".cu", ".cpp", ".cuh", ".h", ".hpp", ".inl")


def copy_kernel_sources(build_lib: str) -> None:
    """Copy csrc/**/{*.cu,*.cpp,*.cuh,*.h,...} into <build_lib>/flash_dmattn/csrc."""
    src_root = os.path.join(HERE, "csrc")
    if not os.path.isdir(src_root):
        return
    dst_root = os.path.join(build_lib, "flash_dmattn", "csrc")
    for dirpath, _, files in os.walk(src_root):
        for name in files:
            if name.endswith(CSRC_SUFFIXES):
                rel = os.path.relpath(os.path.join(dirpath, name), src_root)
                os.makedirs(os.path.dirname(os.path.join(dst_root, rel)), exist_ok=True)
                shutil.copy2(os.path.join(dirpath, name), os.path.join(dst_root, rel))


class build_py_with_kernel_sources(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            copy_kernel_sources(self.build_lib)
        if PREBUILD:
            self.prebuild()

    def prebuild(self):
        if os.environ.get("CUDA_HOME") is None and shutil.which("nvcc") is None:
            print("FLASH_DMATTN_PREBUILD: nvcc not found, skipping the cuda prebuild")
            return
        specs = ["--all"] if PREBUILD == "all" else [s for s in PREBUILD.split(",") if s.strip()]
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        res = subprocess.run([sys.executable, "-m", "flash_dmattn", "build", *specs], cwd=HERE,
                             env=env)
        if res.returncode != 0:
            print(f"FLASH_DMATTN_PREBUILD: prebuild exited with {res.returncode}; kernels will "
                  "be built on first use instead")


setup(cmdclass={"build_py": build_py_with_kernel_sources})
