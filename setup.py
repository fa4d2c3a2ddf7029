"""Setuptools shim: the metadata lives in pyproject.toml.

The CUDA backend compiles its kernels on first use (see flash_dmattn/backends/cuda), so an
install never runs nvcc and works on machines without a GPU.
"""
from setuptools import setup

setup()
