"""The README's main command works on this machine."""
import os
import subprocess
import sys

import pytest
import torch


def run(*args):
    # As a user runs it: without the Triton interpreter that conftest enables for kernel tests.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "flash_dmattn", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_info():
    res = run("info")
    assert res.returncode == 0, res.stderr
    assert "torch-reference" in res.stdout and "available" in res.stdout


def test_demo_small():
    res = run("demo", "--seqlen", "128", "--repeats", "1")
    assert res.returncode == 0, res.stderr
    assert "torch-reference" in res.stdout and "flash_dmattn_func picks" in res.stdout



@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the demo runs the compiled kernels")
def test_demo_under_the_triton_interpreter_finishes_in_seconds():
    """With TRITON_INTERPRET=1 the triton kernels run in Python: the demo runs them on a small
    problem of their own, in a table of testing aids after the others, and still finishes."""
    pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "flash_dmattn", "demo", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    main, _, aids = res.stdout.partition("testing aids")
    assert "L=512" in main and "torch-reference" in main and "\ntriton" not in main
    rows = [line.split() for line in aids.splitlines() if line.startswith("triton")]
    assert "L=64" in aids and len(rows) == 1
    fwd, fwd_bwd, err = rows[0][1:4]
    assert float(fwd) > 0 and float(fwd_bwd) > 0 and float(err) < 1e-4


def test_info_says_what_the_interpreter_is_for():
    res = run("info")
    assert res.returncode == 0, res.stderr
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1 runs the Triton kernels in Python on CPU tensors, to test them" in res.stdout
