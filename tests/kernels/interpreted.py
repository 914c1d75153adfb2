"""Run a Python snippet under Triton's CPU interpreter, for tests of single kernels in CI (no GPU there)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout: float = 300):
    """`script` in a fresh Python with TRITON_INTERPRET=1 (it must be set before Triton is first imported),
    from the repository root; the JSON value on the last line it prints."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])
