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
    parse_windows,
    query_positions,
    train_model,
)


def test_smoke_cli_writes_reports(tmp_path):
    # conftest turns on Triton's interpreter for the kernel tests; the demo must run without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.pop("FLASH_DMATTN_BACKEND", None)
    env.pop("FLASH_DMATTN_DISABLE", None)
    cmd = [sys.executable, "-m", "examples.mqar", "--smoke", "--device", "cpu", "--out", str(tmp_path)]
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
    md = (tmp_path / "mqar.md").read_text()
    assert "| window | attention | accuracy |" in md
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


@pytest.mark.parametrize("window", [8, "dense"])
def test_loss_decreases_on_a_tiny_problem(window):
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
