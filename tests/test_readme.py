"""README.md and .ci/run say the same thing: CI runs the README's own install lines for a
CPU-only machine, then its info and test commands, word for word."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    """Every command line of the README's shell code blocks, without its trailing comment."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def ci_commands():
    lines = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "set ", "cd ", "export ")):
            lines.append(line)
    return lines


def test_ci_runs_the_readme_lines_word_for_word():
    readme, ci = readme_commands(), ci_commands()
    assert ci, ".ci/run runs nothing"
    missing = [line for line in ci if line not in readme]
    assert not missing, f".ci/run runs lines the README does not give: {missing}"


def test_ci_installs_cpu_torch_then_the_test_extra_then_runs_the_test_command():
    ci = ci_commands()
    torch_line, package_line = ci[0], ci[1]
    assert torch_line.startswith('pip install "torch==') and "/whl/cpu" in torch_line
    assert package_line == 'pip install -e ".[test]"'
    assert ci[-1] == "python -m pytest tests -q"
    readme = readme_commands()
    assert "python -m flash_dmattn demo" in readme and "python -m pytest tests -q" in readme


def test_readme_gives_the_gpu_and_other_installers_lines():
    text = (ROOT / "README.md").read_text()
    install = text[text.index("## Install"):text.index("## The two commands")]
    assert 'pip install "torch>=2.5"' in install  # PyPI's Linux build: the CUDA one
    commands = readme_commands()
    # uv installs into a virtual environment of its own, which has no pip: its package line
    # is uv's too.
    assert "uv venv && source .venv/bin/activate" in commands
    assert 'uv pip install "torch>=2.5" --torch-backend=auto' in commands
    assert 'uv pip install -e ".[test]"' in commands
    assert any(c.startswith("conda create") and '"pytorch>=2.5"' in c for c in commands)
