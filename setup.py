"""Setuptools shim: the metadata lives in pyproject.toml.

The CUDA backend compiles its kernels on first use (see flash_dmattn/backends/cuda), so an
install never runs nvcc and works on machines without a GPU.

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


class build_py_with_prebuild(build_py):
    def run(self):
        super().run()
        if os.environ.get("CUDA_HOME") is None and shutil.which("nvcc") is None:
            print("FLASH_DMATTN_PREBUILD: nvcc not found, skipping the cuda prebuild")
            return
        specs = ["--all"] if PREBUILD == "all" else [s for s in PREBUILD.split(",") if s.strip()]
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        res = subprocess.run([sys.executable, "-m", "flash_dmattn", "build", *specs], cwd=here,
                             env=env)
        if res.returncode != 0:
            print(f"FLASH_DMATTN_PREBUILD: prebuild exited with {res.returncode}; kernels will "
                  "be built on first use instead")


setup(cmdclass={"build_py": build_py_with_prebuild} if PREBUILD else {})
