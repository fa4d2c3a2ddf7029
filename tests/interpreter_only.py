"""The guard at the top of the test modules that run the Triton kernels on the interpreter, and
the real reason when they cannot run here."""
import os
from typing import Optional

import pytest
import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        return False
    return True


NOT_INSTALLED = "triton is not installed (pip install -e \".[test]\" installs it)"

# For tests that import the triton backend's modules (launch rules, declines), not its kernels.
needs_triton = pytest.mark.skipif(not triton_installed(), reason=NOT_INSTALLED)


def triton_kernels_skip_reason() -> Optional[str]:
    """Why the Triton kernels cannot run in this test session (None: they can, compiled on a GPU
    or interpreted on CPU tensors). A triton that is installed but broken (e.g. numpy missing)
    fails loudly instead."""
    if not triton_installed():
        return NOT_INSTALLED
    if not torch.cuda.is_available() and not interpreting():
        return ("no CUDA device, and TRITON_INTERPRET is set to 0 (conftest.py turns the "
                "interpreter on without a GPU unless it is set)")
    return None


def interpreter_skip_reason() -> Optional[str]:
    """Why the interpreter-only tests do not run here (None: they do)."""
    reason = triton_kernels_skip_reason()
    if reason is None and torch.cuda.is_available() and not interpreting():
        reason = ("a CUDA device is present: the compiled kernels are tested by tests/test_gpu.py "
                  "at real sizes; these interpreter tests run on CPU-only machines")
    return reason


def planner_device() -> torch.device:
    """Where tests that plan on the host with the planner's Triton kernels put their tensors:
    the GPU where one is present (the kernels compiled), else the CPU (the interpreter)."""
    if torch.cuda.is_available() and not interpreting():
        return torch.device("cuda")
    return torch.device("cpu")


def require_triton_interpreter() -> None:
    """Skip the calling module unless the Triton kernels run on CPU tensors here.

    conftest.py turns the interpreter on for CPU-only machines; on a GPU machine the same
    kernels are compiled and covered by tests/test_gpu.py at realistic sizes.
    """
    reason = interpreter_skip_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def skip_unless_available(name: str) -> None:
    """Skip the calling test when backend ``name`` cannot run here, with the registry's own
    reason (for GPU tests run on machines without that backend's toolchain or GPU kind)."""
    from flash_dmattn import registry

    backend = registry._BACKENDS.get(name)
    reason = "not registered" if backend is None else registry.unavailable_reason(backend)
    if reason is not None:
        pytest.skip(f"{name} backend unavailable here: {reason}")
