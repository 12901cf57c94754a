"""The README runs as written: its first code block (alone and on two ranks), and the Quick
start commands from a fresh clone; the Trainer guide shows FSDP's refusal as it prints. The
other Python blocks of the README and of docs/ run in tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests._venv import OFFLINE_PIP, fresh_clone, python_holding_torch

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


# ----------------------------------------------------------- the Quick start, from a clone --


def _quick_start_lines() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, re.S)
    assert block, "the README lost its Quick start block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _our_install_state() -> dict[str, float]:
    """The files by which this interpreter's environment finds dptrain (must not change)."""
    out = {}
    for site_dir in _site_dirs():
        for name in os.listdir(site_dir):
            if "dptrain" in name:
                path = os.path.join(site_dir, name)
                out[path] = os.stat(path).st_mtime_ns
    return out


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def test_the_quick_start_commands_run_as_written_from_a_fresh_clone(tmp_path):
    """`make demo`, then every Quick start line as written, in a fresh shell with a clean PATH.

    `make demo` does its own set-up (tools/make_venv.py), offline: `python3` here is a venv
    Python that holds this interpreter's packages (torch, numpy, pip, setuptools), as on a GPU
    machine, so the clone's .venv reuses them and dptrain is installed into it from the
    clone, editable. This environment's own install is never touched (checked at the end).
    The demo runs with a short DEMO_ARGS; `make test` is this suite.
    """
    lines = _quick_start_lines()
    assert lines[0].startswith("make demo"), lines
    clone = str(tmp_path / "clone")
    fresh_clone(clone)
    before = _our_install_state()
    python3 = python_holding_torch(str(tmp_path / "python3"))
    clean = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
             **OFFLINE_PIP}

    demo = subprocess.run(["make", "demo", f"PYTHON={python3}", "DEMO_ARGS=--num_epochs 1 --width 4 --batch_size 64"],
                          cwd=clone, env=clean,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert re.search(r"test accuracy: \d\.\d{4}", demo.stdout), demo.stdout[-2000:]
    assert "source .venv/bin/activate" in demo.stdout  # make demo says what to type next

    script = "set -e\n" + "\n".join(line for line in lines if not line.startswith("make "))
    assert "source .venv/bin/activate" in script and "dptrain run" in script
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"test accuracy over \d+ samples on 2 ranks", done.stdout), done.stdout[-2000:]
    assert _our_install_state() == before, "the test changed this environment's own dptrain install"


def _section(path: str, title: str) -> str:
    text = open(os.path.join(ROOT, path)).read()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_the_trainer_guide_says_fsdp_needs_a_function_for_the_optimizer():
    import torch
    from torch import nn

    import dptrain

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    try:
        dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.CrossEntropyLoss(),
                        dptrain.TrainerConfig(strategy="fsdp", batch_size=4, verbose=False))
    except ValueError as exc:
        refusal = f"ValueError: {exc}"
    else:
        raise AssertionError("the Trainer took an optimizer object for strategy='fsdp'")
    section = _section("docs/trainer.md", "FSDP in the Trainer")
    assert refusal in section, "the Trainer guide's FSDP section must show the refusal as it prints:\n" + refusal
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    assert 'strategy="fsdp"' in code and "lambda params:" in code, "show FSDP in the Trainer with an optimizer function"
