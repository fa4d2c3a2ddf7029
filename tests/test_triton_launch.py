"""How the Triton kernels are launched: autotuned, fixed under the interpreter, or with
autotuning switched off (FLASH_DMATTN_TRITON_AUTOTUNE=0, for quick GPU test runs)."""
import pytest

pytest.importorskip("triton")

from flash_dmattn import envs  # noqa: E402
from flash_dmattn.backends.triton import common as launch_mod  # noqa: E402


class _Config:
    def __init__(self, w, s):
        self.num_warps, self.num_stages = w, s


class _Kernel:
    arg_names = ["X", "n"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((grid, a, kw))


class _Tuned(_Kernel):
    def __init__(self):
        super().__init__()
        self.configs = [_Config(4, 2), _Config(8, 3), _Config(8, 2)]
        self.seen = None

    def early_config_prune(self, configs, named, **meta):
        self.seen = (named, meta)
        return [c for c in configs if c.num_warps == 8]


@pytest.mark.parametrize("mode", ["interpret", "autotune", "fixed"])
def test_launch_tuned_modes(monkeypatch, mode):
    monkeypatch.setattr(launch_mod, "interpret_mode", lambda: mode == "interpret")
    if mode == "fixed":
        monkeypatch.setenv(envs.TRITON_AUTOTUNE, "0")
    else:
        monkeypatch.delenv(envs.TRITON_AUTOTUNE, raising=False)
    kernel, tuned = _Kernel(), _Tuned()
    launch_mod.launch_tuned(kernel, tuned, (3,), ("x", 5), {"BLOCK": 16})
    if mode == "autotune":
        assert tuned.calls == [((3,), ("x", 5), {"BLOCK": 16})] and not kernel.calls
        return
    assert not tuned.calls and len(kernel.calls) == 1
    _, args, kw = kernel.calls[0]
    assert args == ("x", 5) and kw["BLOCK"] == 16
    if mode == "interpret":
        assert (kw["num_warps"], kw["num_stages"]) == (4, 1)
    else:  # the first config that survives pruning, which saw the named arguments
        assert (kw["num_warps"], kw["num_stages"]) == (8, 3)
        assert tuned.seen == ({"X": "x", "n": 5}, {"BLOCK": 16})


def test_fixed_launch_skips_configs_that_do_not_fit(monkeypatch):
    import triton

    monkeypatch.setattr(launch_mod, "interpret_mode", lambda: False)
    monkeypatch.setenv(envs.TRITON_AUTOTUNE, "0")

    class _Picky(_Kernel):
        def __getitem__(self, grid):
            def launch(*a, **kw):
                if kw["num_stages"] == 3:
                    raise triton.runtime.errors.OutOfResources(234496, 232448, "shared memory")
                self.calls.append((grid, a, kw))
            return launch

    kernel, tuned = _Picky(), _Tuned()
    launch_mod.launch_tuned(kernel, tuned, (1,), ("x", 5), {})
    assert [(c[2]["num_warps"], c[2]["num_stages"]) for c in kernel.calls] == [(8, 2)]
    # nothing fits: the last error propagates
    tuned.configs = [_Config(8, 3)]
    with pytest.raises(triton.runtime.errors.OutOfResources):
        launch_mod.launch_tuned(kernel, tuned, (1,), ("x", 5), {})


def test_capture_launches_untimed_specialisations_without_autotuning(monkeypatch):
    # Under CUDA-graph capture the autotuner must not time configs (that synchronises the
    # device): an untimed specialisation takes the first pruned config, a timed one the
    # autotuner's choice.
    import torch

    monkeypatch.setattr(launch_mod, "interpret_mode", lambda: False)
    monkeypatch.delenv(envs.TRITON_AUTOTUNE, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    class _Timed(_Tuned):
        keys = ["n"]

        def __init__(self):
            super().__init__()
            self.cache = {}

    kernel, tuned = _Kernel(), _Timed()
    x = torch.zeros(2)
    launch_mod.launch_tuned(kernel, tuned, (1,), (x, 5), {"BLOCK": 16})
    assert not tuned.calls and len(kernel.calls) == 1
    assert (kernel.calls[0][2]["num_warps"], kernel.calls[0][2]["num_stages"]) == (8, 3)
    tuned.cache[(5, "torch.float32")] = tuned.configs[0]
    launch_mod.launch_tuned(kernel, tuned, (1,), (x, 5), {"BLOCK": 16})
    assert len(tuned.calls) == 1 and len(kernel.calls) == 1


def test_autotuned_reads_tritons_cache_key():
    # The key is built as triton.runtime.autotuner.Autotuner.run builds it: the key arguments
    # in `key` order, then the dtype of every tensor argument.
    import torch
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)],
                     key=["n", "BLOCK"])
    @triton.jit
    def _k(X, Y, n, BLOCK: tl.constexpr):
        pass

    x, y = torch.zeros(2), torch.zeros(2, dtype=torch.int32)
    assert not launch_mod._autotuned(_k, (x, y, 7), {"BLOCK": 32})
    _k.cache[(7, 32, "torch.float32", "torch.int32")] = _k.configs[1]
    assert launch_mod._autotuned(_k, (x, y, 7), {"BLOCK": 32})
    assert not launch_mod._autotuned(_k, (x, y, 8), {"BLOCK": 32})
