"""The guard at the top of the test modules that run the Triton kernels on the interpreter."""
import os

import pytest


def require_triton_interpreter() -> None:
    """Skip the calling module unless the Triton kernels run on CPU tensors here.

    conftest.py turns the interpreter on for CPU-only machines; on a GPU machine the same
    kernels are compiled and covered by tests/test_gpu.py at realistic sizes. A triton that is
    installed but broken (e.g. numpy missing) fails loudly instead of skipping.
    """
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("interpreter tests: run on a CPU-only machine (GPU: tests/test_gpu.py)",
                    allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        pytest.skip("the Triton kernels need the triton package", allow_module_level=True)
