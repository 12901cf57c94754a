"""Create the project's virtual environment (what ``make venv`` runs), over the torch you have.

    python3 tools/make_venv.py [--venv .venv] [--torch torch==2.13.0]

Two cases, decided by the Python that runs this script:

* **It already has torch** (a GPU machine: torch in a virtual environment, a conda env or a
  container). The new environment is layered over it: a ``.pth`` file makes every
  site-packages folder of that Python visible inside the new one, so its torch (CUDA build
  and all) and every other package it holds are used as they are -- never replaced, never
  downloaded again. ``python -m venv --system-site-packages`` is not enough for this: from a
  venv or conda Python it shows only the *base* interpreter's packages.
* **It has no torch** (a fresh CPU machine, CI): a plain environment, and the ``--torch``
  requirement is installed in it with dptrain, in the same pip command: letting pip resolve
  ``torch>=2.4`` by itself would pull a CUDA build of several GB.

Then dptrain is installed in editable mode with its ``examples`` and ``test`` extras. When
the environment can already build it (setuptools 70.1 or newer, or setuptools with
``wheel``), pip builds it without an isolated build environment, so that nothing is fetched
for the build either: with everything present, the set-up works offline.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import site
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH_NAME = "_dptrain_base_env.pth"

# Run inside the new environment: can its setuptools build an editable wheel offline?
_CAN_BUILD = """
import importlib.util, sys
try:
    import setuptools
except ImportError:
    sys.exit(1)
v = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
sys.exit(0 if v >= (70, 1) or (v >= (61, 0) and importlib.util.find_spec("wheel")) else 1)
"""


def base_site_dirs() -> list[str]:
    """Every site-packages folder of the Python running this, in its own order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    seen: list[str] = []
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def venv_python(path: str) -> str:
    return os.path.join(path, "Scripts" if os.name == "nt" else "bin", "python")


def venv_purelib(python: str) -> str:
    return subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def layer_over_this_python(path: str) -> None:
    """A new environment at ``path`` that sees this Python's packages (see the module docstring)."""
    has_pip = importlib.util.find_spec("pip") is not None
    # Without a pip of its own when this Python has one: the new environment's bundled pip and
    # (on Python < 3.12) setuptools 65 would shadow the newer ones it can see.
    venv.EnvBuilder(with_pip=not has_pip, symlinks=os.name != "nt").create(path)
    python = venv_python(path)
    dirs = base_site_dirs()
    # addsitedir, not a bare path: the .pth files of those folders (editable installs, conda's)
    # are processed too. The new environment's own folder stays first on sys.path.
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    with open(os.path.join(venv_purelib(python), PTH_NAME), "w") as f:
        f.write(line + "\n")
    # torchrun's own script lives beside that Python and starts ranks with it, which cannot
    # import dptrain; this one lives in the new environment (on PATH once it is activated).
    if os.name != "nt":
        torchrun = os.path.join(path, "bin", "torchrun")
        with open(torchrun, "w") as f:
            f.write(f'#!/bin/sh\nexec "{python}" -m torch.distributed.run "$@"\n')
        os.chmod(torchrun, 0o755)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv", help="where to create the environment (default .venv)")
    parser.add_argument("--torch", default="torch==2.13.0",
                        help="what to install when this Python has no torch (default torch==2.13.0, a CPU build here)")
    args = parser.parse_args(argv)
    path = os.path.abspath(args.venv)
    python = venv_python(path)

    if importlib.util.find_spec("torch") is not None:
        version = importlib.metadata.version("torch")
        print(f"dptrain: reusing torch {version} of {sys.executable} (nothing is reinstalled)", flush=True)
        layer_over_this_python(path)
        requirements = []
    else:
        print(f"dptrain: {sys.executable} has no torch; installing {args.torch} into {args.venv}", flush=True)
        venv.EnvBuilder(with_pip=True, symlinks=os.name != "nt").create(path)
        # The pin goes in the same pip command as dptrain: pip then never picks a torch of its
        # own for dptrain's `torch>=...` (a CUDA build of several GB), and resolves and
        # installs everything in one pass.
        requirements = [args.torch]

    flags = ["--no-build-isolation"] if subprocess.call([python, "-c", _CAN_BUILD]) == 0 else []
    # --no-compile: pip would write the bytecode of all 16,500 files it installs here, one after
    # another (about a minute), most of them never imported. The Makefile's targets let the first
    # process that imports a module write its bytecode instead (see BYTECODE there).
    cmd = [python, "-m", "pip", "install", "-q", "--no-compile", *flags, *requirements, "-e", f"{ROOT}[examples,test]"]
    if subprocess.call(cmd) != 0:
        print(f"dptrain: installing into {args.venv} failed (see pip's message above). Offline, every dependency "
              "in pyproject.toml must already be installed, and setuptools>=70.1 (or setuptools and wheel) to "
              "build without network; or install into your own environment with: pip install -e .",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
