"""tools/doge_generate_probe.py runs (--tiny: CPU, a tiny Doge and Llama, a profiled prefill and step)."""
import pytest

from tool_env import load_tool

pytest.importorskip("transformers")


def test_tiny_probe_runs_and_reports(capsys):
    probe = load_tool("doge_generate_probe")
    assert probe.main(["--tiny", "--runs", "1", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "device: CPU" in out
    assert out.count("tok/s") >= 2
    # Doge's decoding steps took the top-W path; the Llama's the dense one
    assert "top-W decode (key_index) 10, dense 2" in out
    assert "top-W decode (key_index) 0, dense 12" in out
    assert "one decoding step, dmattn" in out and "attention function" in out
    assert "the prefill (24 tokens), dmattn" in out
