"""What a user reads when a Trainer job ends on a user error: one clear line for the job,
the traceback only under --debug; a skipped checkpoint said whole, in our words."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import sys, torch, dptrain
    from torch import nn
    dptrain.init()
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    config = dptrain.TrainerConfig(checkpoint_dir=sys.argv[1], batch_size=4, progress=False)
    trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.CrossEntropyLoss(), config,
                              resume="auto")
    trainer.fit(1)
''')


def _launch(tmp_path, *launcher_flags):
    (tmp_path / "train.py").write_text(SCRIPT)
    os.makedirs(tmp_path / "ck", exist_ok=True)
    (tmp_path / "ck" / "ckpt-e0001-s000000004.pt").write_bytes(b"not a checkpoint at all" * 50)
    cmd = [sys.executable, "-m", "dptrain", "run", *launcher_flags, "--nproc-per-node", "2", "train.py", "ck"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("DPTRAIN_DEBUG", None)
    return subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=120, env=env)


def test_a_user_error_is_one_line_for_the_job_and_the_traceback_needs_debug(tmp_path):
    done = _launch(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    said = [line for line in out.splitlines() if line.startswith("[rank") and "CheckpointError" in line]
    assert len(said) == 1 and said[0].startswith("[rank0] dptrain.checkpoint.CheckpointError: "), out
    assert "does not begin as a PyTorch checkpoint" in said[0]
    assert "Traceback" not in out and not any(line.startswith("[rank1]") for line in out.splitlines()), out
    assert "--debug" in out  # how to see the traceback
    debug = _launch(tmp_path, "--debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stdout + debug.stderr


TORCH_WORDS = ("PytorchStreamReader", "miniz", "Errno", "hasRecord", "codec")


def _damaged_copies(tmp_path):
    import torch
    from dptrain import checkpoint

    good = checkpoint.save({"model": {f"w{i}": torch.randn(40, 40) for i in range(3)}}, tmp_path / "good.pt")
    data = open(good, "rb").read()
    mid = len(data) // 2
    copies = {
        "cut short": data[:mid],
        "does not begin": b"\x00" * 8 + data[8:],
        "damaged inside": data[:10] + bytes(b ^ 0xFF for b in data[10:200]) + data[200:],
    }
    paths = {}
    for what, content in copies.items():
        paths[what] = tmp_path / (what.replace(" ", "-") + ".pt")
        paths[what].write_bytes(content)
    return paths


def test_a_damaged_checkpoint_is_said_whole_in_our_words(tmp_path):
    import pytest

    from dptrain import checkpoint

    expected = {"cut short": "is truncated: its end is missing", "does not begin": "does not begin as a PyTorch checkpoint",
                "damaged inside": "is corrupt"}
    for what, path in _damaged_copies(tmp_path).items():
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.load(path)
        text = str(err.value)
        assert expected[what] in text, (what, text)
        assert not any(w in text for w in TORCH_WORDS), (what, text)  # torch's text, cut at 200 characters, is gone
        assert text.endswith("(see dptrain.checkpoint.list_checkpoints)"), text
