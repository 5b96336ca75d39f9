"""The README's Python examples run as written and print what the README says they print.

The examples are the README's ```python blocks (the forward against the reference, then a training
loop). Each is written to a file and run in a fresh interpreter with the checkout's ``src`` on
``PYTHONPATH`` and Triton under its CPU interpreter: they spawn two CPU ranks, and spawned ranks
re-import the main module, so they cannot run inside pytest's process.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_examples() -> list[str]:
    """The ```python blocks of README.md, in order (ValueError if there are none)."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    if not found:
        raise ValueError("README.md has no ```python block")
    return found


def _run(code: str, tmp_path) -> list[str]:
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout.split("\n")


def test_readme_training_example_runs_and_the_loss_falls(tmp_path):
    lines = _run(readme_examples()[1], tmp_path)
    for rank in (0, 1):
        found = re.fullmatch(rf"rank {rank} loss (\S+) (\S+) (\S+)", lines[rank])
        assert found is not None, lines
        losses = [float(v) for v in found.groups()]
        assert losses[2] < losses[1] < losses[0], lines


def test_readme_example_runs_and_matches_the_reference(tmp_path):
    done_lines = _run(readme_examples()[0], tmp_path)
    lines = done_lines
    error = re.fullmatch(r"max relative error (\S+)", lines[0])
    assert error is not None, lines
    assert 0.0 < float(error.group(1)) < 1e-2, lines  # BF16 rounding, never exact, well within 1e-2
    assert lines[1] == "ok", lines
