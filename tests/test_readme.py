"""The README's first code block runs as written, alone and on two ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_first_code_block_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## A data-parallel script\n\n```python\n(.*?)```", text, re.S)
    assert block, "the README lost its first code block"
    script = tmp_path / "first.py"
    script.write_text(block.group(1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for cmd in ([sys.executable, str(script)],
                [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", str(script)]):
        done = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
