"""Every name the README and the guides in docs/ write as ``dptrain.<sub>.<Name>`` works right
after ``import dptrain``."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The subpackages a user reaches as attributes, whether or not the README shows one today.
SUBPACKAGES = ["train", "models", "parallel", "data", "checkpoint", "comm", "environments"]


def _readme_dotted_names() -> list[str]:
    paths = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    text = "\n".join(open(p).read() for p in paths)
    # `from dptrain.x import y` is an import path, not an attribute use: leave those out.
    text = re.sub(r"from dptrain[\w.]* import", "", text)
    return sorted(set(re.findall(r"\bdptrain(?:\.[A-Za-z_]\w*){2,}", text)))


def test_the_readme_names_are_attributes_after_a_bare_import():
    names = _readme_dotted_names() + [f"dptrain.{s}" for s in SUBPACKAGES]
    assert "dptrain.train.EarlyStopping" in names, "the README and docs/ no longer name dptrain.train.*; update this test"
    # A fresh interpreter: nothing but `import dptrain` ran before the lookups.
    probe = (
        "import functools, sys\n"
        "import dptrain\n"
        "before = set(sys.modules)\n"
        f"for dotted in {names!r}:\n"
        "    functools.reduce(getattr, dotted.split('.')[1:], dptrain)\n"
        "launcher = [m for m in before if m.split('.')[:2][-1] in ('launch', 'launcher', 'cli')]\n"
        "print('launcher modules after import dptrain:', launcher)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launcher modules after import dptrain: []" in done.stdout
