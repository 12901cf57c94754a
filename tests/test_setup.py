"""The set-up (``make venv``, run by ``make demo`` and ``make test``) on a GPU user's machine:
``python3`` lives in a virtual environment that already holds torch, and there is no network.

The user's environment is simulated: a virtual environment (no pip, no packages of its own)
whose site-packages points at this checkout's ``.venv``, so that its Python imports torch,
numpy, pytest and the rest from there -- as a GPU machine's venv imports its CUDA torch.
The Makefile must reuse that torch, not install another, and fetch nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from tests._venv import OFFLINE_PIP, fresh_clone, purelib, python_holding_torch


def _offline_prefix() -> list[str]:
    """``unshare -n`` (a network namespace with nothing in it) where this user may make one."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.mark.skipif(sys.platform != "linux", reason="builds virtual environments with POSIX paths")
def test_make_venv_reuses_the_torch_of_a_venv_python_without_network(tmp_path):
    # The user's environment: python3 of a venv whose packages (torch among them) are ours.
    user_python = python_holding_torch(str(tmp_path / "user-env"))
    ours = sysconfig.get_paths()["purelib"]  # where this test's torch lives
    # A clone of the project, so that the editable install is the clone's.
    project = tmp_path / "checkout"
    fresh_clone(str(project))

    # No network: no index, none of this machine's local wheel folders, and (where possible) no
    # network interface at all. Only what the user's environment holds can be used.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(OFFLINE_PIP)
    out = subprocess.run([*_offline_prefix(), "make", "-C", str(project), "venv", f"PYTHON={user_python}"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    import importlib.metadata

    import torch

    # make_venv reads the version from the package metadata: a PyPI CUDA wheel's says 2.11.0 where
    # torch.__version__ says 2.11.0+cu130.
    assert f"reusing torch {importlib.metadata.version('torch')} " in out.stdout, out.stdout

    venv_python = str(project / ".venv" / "bin" / "python")
    probe = textwrap.dedent("""
        import json, torch, dptrain
        print(json.dumps([torch.__version__, torch.__file__, dptrain.__file__]))
    """)
    seen = subprocess.run([venv_python, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)  # (not the checkout: "-c" puts the working folder first on sys.path)
    assert seen.returncode == 0, seen.stderr
    version, torch_file, dptrain_file = json.loads(seen.stdout.strip().splitlines()[-1])
    assert version == torch.__version__
    assert torch_file.startswith(ours), f"the new .venv imports torch from {torch_file}, not the user's {ours}"
    assert dptrain_file.startswith(str(project)), dptrain_file  # the editable install is the project's
    # Nothing was installed in place of the user's torch.
    assert not os.path.exists(os.path.join(purelib(venv_python), "torch")), "torch was installed again into .venv"
    cli = subprocess.run([str(project / ".venv" / "bin" / "dptrain"), "run", "--help"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert cli.returncode == 0 and "--nproc-per-node" in cli.stdout, cli.stderr
    # torchrun from .venv starts ranks with .venv's python, which imports dptrain.
    script = tmp_path / "rank.py"
    script.write_text("import os, dptrain; print('rank', os.environ['RANK'], dptrain.__file__)\n")
    ran = subprocess.run([str(project / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "1",
                          str(script)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert ran.returncode == 0 and f"rank 0 {project}" in ran.stdout, ran.stdout + ran.stderr[-2000:]
