"""The real (compiled, not interpreted) Triton kernels build for sm_90 on this GPU-less machine.

The interpreter runs the kernels' Python, not Triton's compiler: constexpr handling, layouts
and the software pipeliner are only exercised by a real compile. ``tools/compile_check.py``
captures one forward + backward's launches and compiles each for an H100/H200 target.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tool_env import tool_env

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_backend_available() -> bool:
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


# Each workload's kernels, by the labels compile_check prints for them.
KERNELS = {
    "t2": ("fwd", "dkdv", "dq"),
    "dense": ("fwd", "dkdv", "dq"),
    "varlen": ("fwd", "dkdv", "dq"),
    "intervals": ("ifwd", "idq", "idkv"),
    "selection": ("sscore", "sprep", "spart", "squery"),
    "decode-selected": ("ssplit", "dcomb"),
    "planner": ("lranges", "lscan", "lcoarse", "lfill", "litems", "lblocks"),
}


# Workloads compiled again with attention dropout on (the kernels' DROPOUT code), and one
# whose keep threshold round(256 p) is 1, an int argument the JIT turns into a constant.
DROPOUT_WORKLOADS = ("dense", "varlen", "intervals")
THRESHOLD_ONE = 1 / 256


@pytest.mark.skipif(not _nvidia_backend_available(), reason="triton without its nvidia backend")
@pytest.mark.parametrize("workload, dropout",
                         [(w, 0.0) for w in KERNELS] + [(w, 0.1) for w in DROPOUT_WORKLOADS]
                         + [("dense", THRESHOLD_ONE)])
def test_kernels_compile_for_sm90(workload, dropout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_check.py"), "--workload", workload,
         "--first-config", "--dropout", str(dropout)],
        capture_output=True, text=True, env=tool_env(env), cwd=ROOT, timeout=600,
    )
    report = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, report
    for kernel in KERNELS[workload]:
        assert f"{kernel} " in res.stdout, report  # every kernel was captured and compiled
