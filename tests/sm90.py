"""Run the offline sm_90 build check (`python -m megamoe.tools.sm90 GROUP`) in a subprocess: the interpreter
must be off to compile."""

import json
import os
import subprocess
import sys


def sm90_report(group: str, timeout: int = 900) -> dict:
    """{case: facts} of one group of the build check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-m", "megamoe.tools.sm90", group], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[group]
