"""What the set-up tests build: a fresh clone, and a Python that already holds torch.

``python_holding_torch`` plays a GPU machine's ``python3``: a virtual environment with no
pip and no packages of its own, whose site-packages points at this interpreter's (torch,
numpy, pytest, setuptools, ...), as a GPU machine's venv holds its CUDA torch. The Makefile
(tools/make_venv.py) must reuse those packages, offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: pip without any index or local wheel folder: only what the environment holds can be used.
OFFLINE_PIP = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
               "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def fresh_clone(dest: str) -> None:
    """What `git clone` of this checkout gives: its tracked files, as they are now."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        import pytest
        pytest.skip(f"not a git checkout, so there is no clone to make: {listed.stderr.decode()[-300:]}")
    for name in listed.stdout.decode().split("\0"):
        if name and os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))


def purelib(python: str) -> str:
    """The site-packages folder of the environment ``python`` belongs to."""
    return subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def python_holding_torch(dest: str) -> str:
    """A venv at ``dest`` whose Python imports this interpreter's packages; returns its path."""
    subprocess.check_call([sys.executable, "-m", "venv", "--without-pip", dest])
    python = os.path.join(dest, "bin", "python")
    ours = sysconfig.get_paths()["purelib"]
    with open(os.path.join(purelib(python), "gpu_box_packages.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({ours!r})\n")
    return python
