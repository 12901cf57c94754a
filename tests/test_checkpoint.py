"""dptrain.checkpoint: atomic save, safe load, prefix-agnostic weights, safetensors, rotation."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from dptrain import checkpoint
from dptrain.checkpoint import CheckpointError
from dptrain.seeding import get_rng_state, seed_everything, set_rng_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_save_load_roundtrip_weights_only(tmp_path):
    m = _model()
    obj = {"model": m.state_dict(), "epoch": 3, "lr": 0.1, "name": "x", "nested": [1, (2.5, None), {"a": torch.ones(2)}]}
    path = checkpoint.save(obj, tmp_path / "c.pt")
    back = checkpoint.load(path, map_location="cpu")
    assert back["epoch"] == 3 and back["lr"] == 0.1 and back["name"] == "x"
    assert back["nested"][1] == (2.5, None) and torch.equal(back["nested"][2]["a"], torch.ones(2))
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)
    assert os.listdir(tmp_path) == ["c.pt"]  # no temporary left behind


def test_save_refuses_objects_weights_only_cannot_load(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint\['opt'\]\['fn'\] holds a builtins.function"):
        checkpoint.save({"opt": {"fn": lambda: 0}}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="numpy.ndarray"):
        checkpoint.save({"a": np.zeros(3)}, tmp_path / "c.pt")
    assert not os.listdir(tmp_path)


def test_load_missing_truncated_and_corrupt_files_name_the_file(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        checkpoint.load(missing)
    good = checkpoint.save({"w": torch.randn(1000)}, tmp_path / "good.pt")
    data = open(good, "rb").read()
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"trunc\.pt.*is truncated: its end is missing"):
        checkpoint.load(trunc)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(CheckpointError, match="garbage.pt"):
        checkpoint.load(garbage)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.pt"):
        checkpoint.load(empty)


class _Evil:
    """Any class: unpickling it would import and run code of the writer's choosing."""


def test_load_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": _Evil()}, path)  # a plain torch.save, bypassing our check
    with pytest.raises(CheckpointError, match="evil.pt.*weights_only"):
        checkpoint.load(path)


def test_crash_between_write_and_rename_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    checkpoint.save({"v": 1, "t": torch.full((100,), 1.0)}, path)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save({"v": 2, "t": torch.full((100,), 2.0)}, path)
    monkeypatch.undo()
    back = checkpoint.load(path)
    assert back["v"] == 1 and torch.equal(back["t"], torch.full((100,), 1.0))
    assert os.listdir(tmp_path) == ["c.pt"]


_WRITER = textwrap.dedent(
    """
    import io, os, sys, torch
    from dptrain import checkpoint
    path, where = sys.argv[1], sys.argv[2]

    def block(event):  # say where we are, then wait to be killed
        print(event, flush=True)
        sys.stdin.read()

    for i in (1, 2):
        checkpoint.save({"v": i, "t": torch.full((250_000,), float(i))}, path)  # 1 MB
    real_save, real_replace = torch.save, os.replace

    def half_save(obj, f):  # half of the bytes reach the temporary file (the file object save opened)
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        block(f"mid-write {f.name}")

    def no_rename(src, dst):  # the temporary is whole and fsynced, not yet renamed
        block(f"before-rename {src}")

    if where == "mid-write":
        torch.save = half_save
    else:
        os.replace = no_rename
    checkpoint.save({"v": 3, "t": torch.full((250_000,), 3.0)}, path)
    """
)


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_kill_during_save_leaves_the_previous_checkpoint_whole(tmp_path, where):
    """kill -9 a process while it writes a checkpoint over an older one: the older one stays whole,
    the torn temporary is what the next run's clean-up removes."""
    path = str(tmp_path / "c.pt")
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), path, where], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        event = proc.stdout.readline().split()  # blocks until the writer is there (or died: "")
        assert event and event[0] == where, f"the writer never reached {where}"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    tmp = os.path.basename(event[1])
    # The kill landed inside the save of version 3: its temporary is there, c.pt is not touched.
    named = checkpoint._TEMP_RE.match(tmp)  # .c.pt.tmp-<pid>-<start>-<machine>: whose it is, exactly
    assert named and named.group(1, 2, 4) == ("c.pt", str(proc.pid), checkpoint._machine()), tmp
    assert sorted(os.listdir(tmp_path)) == sorted([tmp, "c.pt", "writer.py"])
    back = checkpoint.load(path)
    assert back["v"] == 2 and torch.equal(back["t"], torch.full((250_000,), 2.0))
    assert checkpoint.list_checkpoints(tmp_path) == []  # only ckpt-* names are listed
    assert checkpoint.remove_stale_temporaries(tmp_path) == [tmp]  # its writer is gone
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "writer.py"]


def test_strip_prefix_and_load_model_state_accept_both_forms():
    src = _model()
    wrapped = torch.nn.DataParallel(src)  # CPU: a plain wrapper whose keys carry "module."
    sd = wrapped.state_dict()
    assert all(k.startswith("module.") for k in sd)
    plain = checkpoint.strip_prefix(sd)
    assert list(plain) == list(src.state_dict())
    dst = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    checkpoint.load_model_state(dst, sd)  # prefixed -> plain model
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)
    dst2 = torch.nn.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    checkpoint.load_model_state(dst2, plain)  # plain -> wrapped model
    for k, v in src.state_dict().items():
        assert torch.equal(dst2.module.state_dict()[k], v)
    assert checkpoint.unwrap_model(dst2) is dst2.module
    with pytest.raises(RuntimeError, match="Missing key"):
        checkpoint.load_model_state(nn.Sequential(nn.Linear(4, 8)), {"module.x": torch.zeros(1)})


def test_safetensors_export_roundtrip_with_tied_weights(tmp_path):
    m = _model()
    m[3].weight = nn.Parameter(torch.randn(3, 8))
    tied = nn.ModuleDict({"a": m, "b": nn.Linear(8, 3)})
    tied["b"].weight = m[3].weight  # shared storage: safetensors would refuse it as is
    path = checkpoint.save_safetensors(torch.nn.DataParallel(tied), tmp_path / "w.safetensors", metadata={"epoch": 3})
    back = checkpoint.load_safetensors(path)
    for k, v in tied.state_dict().items():
        assert torch.equal(back[k], v), k
    (tmp_path / "bad.safetensors").write_bytes(open(path, "rb").read()[:50])
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        checkpoint.load_safetensors(tmp_path / "bad.safetensors")


def test_list_latest_and_prune(tmp_path):
    for epoch, step in [(0, 5), (1, 10), (1, 7), (2, 10)]:
        checkpoint.save({"s": step}, checkpoint.checkpoint_path(tmp_path, epoch, step))
    (tmp_path / ".ckpt-e0003-s000000012.pt.tmp-123").write_bytes(b"partial")
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path)]
    # ordered by step, then epoch (an end-of-epoch checkpoint follows a mid-epoch one)
    assert names == ["ckpt-e0000-s000000005.pt", "ckpt-e0001-s000000007.pt", "ckpt-e0001-s000000010.pt", "ckpt-e0002-s000000010.pt"]
    assert os.path.basename(checkpoint.latest_checkpoint(tmp_path)) == "ckpt-e0002-s000000010.pt"
    removed = checkpoint.prune_checkpoints(tmp_path, keep_last=2)
    assert [os.path.basename(p) for p in removed] == names[:2]
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path)] == names[2:]
    assert checkpoint.latest_checkpoint(tmp_path / "absent") is None


def test_rng_state_survives_weights_only_roundtrip(tmp_path):
    seed_everything(123)
    random.random(), np.random.rand(), torch.rand(1)
    state = get_rng_state()
    expect = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4))
    checkpoint.save({"rng": state}, tmp_path / "rng.pt")
    seed_everything(999)
    set_rng_state(checkpoint.load(tmp_path / "rng.pt")["rng"])
    got = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4))
    assert got[:3] == expect[:3] and torch.equal(got[3], expect[3])


def test_seed_everything_reproduces_and_validates():
    seed_everything(7)
    a = (random.random(), np.random.rand(), torch.rand(2))
    seed_everything(7)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])
    with pytest.raises(ValueError, match="integer seed"):
        seed_everything(1.5)
