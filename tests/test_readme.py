"""The README's Python example runs as written and prints what the README says it prints.

The example is the README's first ```python block. It is written to a file and run in a fresh
interpreter with the checkout's ``src`` on ``PYTHONPATH`` and Triton under its CPU interpreter: it
spawns two CPU ranks, and spawned ranks re-import the main module, so it cannot run inside pytest's
process.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The first ```python block of README.md (ValueError if there is none)."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    if found is None:
        raise ValueError("README.md has no ```python block")
    return found.group(1)


def test_readme_example_runs_and_matches_the_reference(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(readme_example())
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = done.stdout.split("\n")
    error = re.fullmatch(r"max relative error (\S+)", lines[0])
    assert error is not None, done.stdout
    assert 0.0 < float(error.group(1)) < 1e-2, done.stdout  # BF16 rounding, never exact, well within 1e-2
    assert lines[1] == "ok", done.stdout
