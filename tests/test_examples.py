"""The MQAR training demo (examples/mqar.py): CLI smoke run, data correctness, learning."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    # examples/ is not an installed package; the tests import it from the checkout.
    sys.path.insert(0, str(REPO))

from examples.mqar import (  # noqa: E402
    IGNORE_INDEX,
    MQARConfig,
    ModelConfig,
    TrainConfig,
    generate_batch,
    main,
    parse_windows,
    query_positions,
    train_model,
    window_coverage,
    window_schedule,
    window_warmup_steps,
)


def test_smoke_cli_writes_reports(tmp_path):
    # conftest turns on Triton's interpreter for the kernel tests; the demo must run without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.pop("FLASH_DMATTN_BACKEND", None)
    env.pop("FLASH_DMATTN_DISABLE", None)
    # --smoke trains 3 steps; a window warm-up of 0.34 (+ the same shrink) gives window 64 at
    # step 1 and the target 8 from step 2 on, so the CLI path of the schedule runs too.
    cmd = [sys.executable, "-m", "examples.mqar", "--smoke", "--device", "cpu", "--out", str(tmp_path),
           "--window-warmup", "0.34", "--eval-every", "1"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"

    doc = json.loads((tmp_path / "mqar.json").read_text())
    rows = doc["results"]
    assert [r["window"] for r in rows] == ["8", "full"]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["ms_per_step"] is not None and r["ms_per_step"] > 0
        assert r["params"] > 0
    assert doc["config"]["task"]["seq_len"] == 64 and doc["config"]["train"]["steps"] == 3
    assert doc["config"]["train"]["window_warmup"] == 0.34
    windowed, full = rows
    assert windowed["window_schedule"] == {"start": 64, "target": 8, "full_steps": 1, "decay_steps": 1,
                                           "shape": "geometric"}
    assert [(h["step"], h["window"], h["train_window"]) for h in windowed["history"]] == [(1, 8, 64), (2, 8, 8), (3, 8, 8)]
    assert full["window_schedule"] is None and {h["train_window"] for h in full["history"]} == {64}
    md = (tmp_path / "mqar.md").read_text()
    assert "| window | attention | window schedule | accuracy |" in md
    assert "| 8 | dma | full 1 → 8 (shrink over 1) |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped the plot" in res.stdout
    else:
        assert (tmp_path / "mqar.png").stat().st_size > 0


def _batch(cfg, seed, batch_size=8):
    return generate_batch(cfg, batch_size, torch.Generator().manual_seed(seed), "cpu")


def test_generator_targets_are_the_paired_values():
    cfg = MQARConfig(seq_len=96, num_pairs=10, num_queries=7, key_vocab=20, value_vocab=12, filler_vocab=5)
    tokens, targets = _batch(cfg, seed=123)
    tokens2, targets2 = _batch(cfg, seed=123)
    assert torch.equal(tokens, tokens2) and torch.equal(targets, targets2)  # seeded -> deterministic
    assert not torch.equal(tokens, _batch(cfg, seed=124)[0])
    assert tokens.shape == targets.shape == (8, 96) and tokens.dtype == torch.int64

    positions = query_positions(cfg)
    assert positions.tolist() == list(range(96 - 14, 96, 2))
    assert torch.equal((targets != IGNORE_INDEX).nonzero()[:, 1].view(8, -1), positions.expand(8, -1))
    for row_tokens, row_targets in zip(tokens.tolist(), targets.tolist()):
        keys, values = row_tokens[0:20:2], row_tokens[1:20:2]
        assert all(0 <= k < 20 for k in keys) and len(set(keys)) == 10  # distinct keys
        assert all(20 <= v < 32 for v in values)
        assert all(32 <= f < 37 for f in row_tokens[20:96 - 14])  # filler range only
        # the answers are labels only: after each query key comes filler, never its value
        assert all(32 <= row_tokens[p + 1] < 37 for p in positions.tolist())
        pairs = dict(zip(keys, values))
        queried = [row_tokens[p] for p in positions.tolist()]
        assert len(set(queried)) == 7 and set(queried) <= set(keys)
        for p in positions.tolist():
            assert row_targets[p] == pairs[row_tokens[p]]  # target = value paired with the key


def test_config_and_window_errors():
    with pytest.raises(ValueError, match="too short"):
        MQARConfig(seq_len=20, num_pairs=8)
    with pytest.raises(ValueError, match="distinct"):
        MQARConfig(seq_len=64, num_pairs=8, key_vocab=4)
    with pytest.raises(ValueError, match="num_queries"):
        MQARConfig(seq_len=64, num_pairs=4, num_queries=5)
    assert parse_windows("32, 64,full,dense") == [32, 64, "full", "dense"]
    with pytest.raises(ValueError):
        parse_windows("32,abc")
    with pytest.raises(ValueError):
        parse_windows("0")


@pytest.fixture
def plain_selection(monkeypatch):
    """The top-W selection of a CPU machine: the plain-PyTorch path, not the selection kernels
    on Triton's interpreter that conftest turns on for the kernel tests (a training run calls
    them every step: 30 interpreted steps took 20 s). tests/test_topk_intervals.py holds the
    kernels to the plain path bit for bit. (Not TRITON_INTERPRET=0: a kernel module first
    imported under it would keep compiled kernels that later tests cannot run on CPU.)"""
    from flash_dmattn.planning import selection_kernels

    monkeypatch.setattr(selection_kernels, "available", lambda device, rows=1, length=1: False)


@pytest.mark.parametrize("window", [8, "dense"])
def test_loss_decreases_on_a_tiny_problem(window, plain_selection):
    # Easy on purpose: 2 pairs, 4 keys and 4 values. Even before any recall is learned the
    # loss falls from ln(vocab) to about ln(value_vocab) as the model learns that the answer
    # is a value token, so the check is reliable in 30 steps.
    task = MQARConfig(seq_len=16, num_pairs=2, key_vocab=4, value_vocab=4, filler_vocab=2)
    model_cfg = ModelConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, d_model=32, num_heads=2,
        window=window, backend="torch-reference",
    )
    train_cfg = TrainConfig(steps=30, batch_size=16, lr=1e-2, eval_size=16, timing_warmup=0, warmup_frac=0.1)
    res = train_model(task, model_cfg, train_cfg, "cpu")
    losses = res["losses"]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert 0.0 <= res["accuracy"] <= 1.0 and res["ms_per_step"] > 0


def test_window_schedule_values():
    total, seq_len, target = 100, 64, 16
    ws = [window_schedule(s, total, target, seq_len, 0.2) for s in range(total)]
    assert window_warmup_steps(total, 0.2) == (20, 20)
    assert ws[:20] == [seq_len] * 20  # full window first
    assert all(target < w < seq_len for w in ws[20:39]) and ws[39] == target  # geometric shrink
    assert ws[40:] == [target] * 60
    assert all(a >= b for a, b in zip(ws, ws[1:]))  # never grows back
    # a separate shrink length; warm-up off; targets at or above seq_len are left alone
    assert window_warmup_steps(100, 0.1, 0.5) == (10, 50)
    assert [window_schedule(s, 10, 8, 64, 0.0) for s in range(10)] == [8] * 10
    assert [window_schedule(s, 10, 64, 64, 0.3) for s in range(10)] == [64] * 10
    assert window_schedule(9, 10, 8, 64, 0.49, 0.49) == 8  # the last step is always at the target
    for frac, decay, exc in ((-0.1, None, ValueError), (0.5, None, ValueError), (0.3, 0.7, ValueError),
                             (float("nan"), None, ValueError), (True, None, TypeError), ("0.2", None, TypeError)):
        with pytest.raises(exc):
            window_schedule(0, 10, 8, 64, frac, decay)
    with pytest.raises(ValueError):
        window_schedule(10, 10, 8, 64, 0.2)  # step out of range


def test_window_warmup_training_and_coverage(plain_selection):
    task = MQARConfig(seq_len=32, num_pairs=4, key_vocab=8, value_vocab=8, filler_vocab=4)
    model_cfg = ModelConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, d_model=32, num_heads=2,
                            window=8, backend="torch-reference")
    train_cfg = TrainConfig(steps=10, batch_size=4, eval_size=8, eval_every=2, timing_warmup=0,
                            window_warmup=0.3, window_decay=0.3)
    res = train_model(task, model_cfg, train_cfg, "cpu")
    assert res["window_schedule"] == {"start": 32, "target": 8, "full_steps": 3, "decay_steps": 3, "shape": "geometric"}
    hist = res["history"]
    assert [h["step"] for h in hist] == [2, 4, 6, 8, 10]
    assert all(h["window"] == 8 for h in hist)  # every recorded accuracy is at the target window
    trained = [h["train_window"] for h in hist]
    assert trained[0] == 32 and trained[-2:] == [8, 8] and all(a >= b for a, b in zip(trained, trained[1:]))
    assert "train_window_accuracy" in hist[0] and "train_window_accuracy" not in hist[-1]
    assert len(res["coverage"]) == 2 and all(0.0 <= c <= 1.0 for c in res["coverage"] + res["coverage_any"])

    # coverage counts exactly the queries whose paired value position the top-w selection keeps
    import examples.mqar as mqar

    torch.manual_seed(0)
    model = mqar.MQARModel(model_cfg)
    tokens, _ = _batch(task, seed=5, batch_size=3)
    mqar._set_window(model, 32)
    assert window_coverage(model, task, tokens) == {"coverage": [1.0, 1.0], "coverage_any": [1.0, 1.0]}
    mqar._set_window(model, 8)
    cov = window_coverage(model, task, tokens)
    # brute force for layer 1 (its input is attn_norm(embed(tokens))): rank the visible keys
    # by bias, ties to the lower index, and check the paired value's rank against the window
    attn = model.blocks[0].attn
    with torch.no_grad():
        v = attn.v_proj(model.blocks[0].attn_norm(model.embed(tokens)))
        bias = torch.exp(attn.A * torch.nn.functional.softplus(attn.dt_proj(v)))  # (B, L, Hkv)
    held = []
    for b in range(tokens.shape[0]):
        keys = tokens[b, 0:8:2].tolist()
        for p in query_positions(task).tolist():
            j = 2 * keys.index(tokens[b, p].item()) + 1
            for h in range(2):
                col = bias[b, : p + 1, h].tolist()
                rank = sum(1 for k, x in enumerate(col) if x > col[j] or (x == col[j] and k < j))
                held.append(rank < 8)
    assert cov["coverage"][0] == pytest.approx(sum(held) / len(held))


@pytest.mark.parametrize("args", [["--window-warmup", "0.6"], ["--window-warmup", "-1"],
                                  ["--window-warmup", "0.3", "--window-decay", "0.8"]])
def test_window_warmup_cli_errors(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--smoke", "--device", "cpu", *args])
    assert info.value.code == 2
    assert "window-warmup" in capsys.readouterr().err
