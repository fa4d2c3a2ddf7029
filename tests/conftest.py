import os

import torch

# Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter, which
# triton.jit selects when a kernel is defined: set it before anything imports them. With a GPU
# the kernels are compiled and the interpreter-only test module skips itself.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _memoise_language_patches():
    """Triton's interpreter patches the modules of ``triton.language`` that a kernel's globals
    name for the kernel's run (its grid executor restores them after), and patches again on
    every call of a ``@triton.jit`` function inside the run: a walk over every builtin of the
    language per call, a third of the suite's interpreter time (kernels call their helpers,
    and ``tl.sum`` and the like are such functions, in loops). Within one run nothing undoes
    a patch, so a call whose modules the run has already patched skips its walk here; the
    first call naming another module (``tl.core`` from the standard library's helpers) still
    patches it, as before. Applied only to the Triton this was written against (its sources
    checked); another keeps its own path."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    try:
        grid_source = inspect.getsource(interpreter.GridExecutor.__call__)
        call_source = inspect.getsource(interpreter.InterpretedFunction.__call__)
        patch = interpreter._patch_lang
        run_kernel = interpreter.GridExecutor.__call__
    except (AttributeError, OSError, TypeError):
        return
    if ("patch_scope = _patch_lang(self.fn)" not in grid_source
            or "patch_scope.restore()" not in grid_source
            or "_patch_lang(self.fn)" not in call_source):
        return
    languages = (tl, tl.core)
    state = {"patched": None}  # ids of the modules the current run has patched

    class _Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        patched = state["patched"]
        if patched is None:
            return patch(fn)
        names = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages}
        if names and names <= patched:
            return _Nothing()
        scope = patch(fn)
        patched.update(names)
        return scope

    def run(self, *args, **kwargs):
        outer = state["patched"]
        state["patched"] = set()
        try:
            return run_kernel(self, *args, **kwargs)
        finally:
            state["patched"] = outer

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run


_memoise_language_patches()

from flash_dmattn import registry  # noqa: E402

import tiers  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--record-cuda-specs", metavar="FILE", default=None,
        help="do not build or run cuda kernels: append every kernel module a test asks for "
             "to FILE as SPEC:OP (what python -m flash_dmattn build takes) and skip the test "
             "there (a device run builds the list side by side, then runs the tests; "
             "tools/gpu_cuda_suite.sh)")


@pytest.fixture(autouse=True)
def _record_cuda_specs(request, monkeypatch):
    path = request.config.getoption("--record-cuda-specs")
    if path:
        from flash_dmattn.backends.cuda import jit

        def record(spec, op, *args, **kwargs):
            # The test stops at its first module; a forward's backward is listed with it (a
            # test that takes gradients asks for it next, and would otherwise build it itself).
            ops = [op, "bwd"] if op == "fwd" else [op]
            with open(path, "a") as f:
                f.writelines(f"{spec.name}:{o}\n" for o in ops)
            pytest.skip(f"recorded {spec.name}:{op}")

        monkeypatch.setattr(jit, "load_kernel", record)
    yield


def pytest_collection_modifyitems(config, items):
    tiers.mark_slow(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    # Keeps the quick tier quick: a test outside tiers.SLOW that takes long is named here.
    slow = []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if report.when == "call" and report.duration > tiers.QUICK_LIMIT_S and "slow" not in report.keywords:
            slow.append(report)
    if slow:
        terminalreporter.write_sep("-", f"tests outside the slow tier that took over {tiers.QUICK_LIMIT_S:g} s")
        for report in sorted(slow, key=lambda r: -r.duration):
            terminalreporter.write_line(f"{report.duration:6.1f} s  {report.nodeid}  (see tests/tiers.py)")


@pytest.fixture(autouse=True)
def _clean_dispatch_state(request, monkeypatch):
    # Dispatch reads the environment per call and logs/warns once; isolate every test.
    monkeypatch.delenv("FLASH_DMATTN_BACKEND", raising=False)
    monkeypatch.delenv("FLASH_DMATTN_DISABLE", raising=False)
    if request.config.getoption("--record-cuda-specs"):
        # Recording cuda modules: triton's and flex's tests skip instead of running (and
        # compiling) in full, and auto-dispatch asks cuda for what it runs.
        monkeypatch.setenv("FLASH_DMATTN_DISABLE", "triton,flex")
    registry.reset_dispatch_notes()
    # The planner's lagged gather decisions start from nothing in every test.
    from flash_dmattn.planning.gather_verdicts import _LAGGED_TOTALS

    _LAGGED_TOTALS.clear()
    yield


@pytest.fixture
def poison(monkeypatch):
    """Triton kernel outputs (decode partials included) start as NaN: anything a kernel
    leaves unwritten shows."""
    from flash_dmattn.backends.triton import common

    monkeypatch.setattr(common, "DEBUG_POISON", True)
