"""The example programs, end to end on 2 ranks with tiny settings, and their data readers."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from dptrain import checkpoint
from dptrain.models import ResNet18

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
import _data  # noqa: E402  (examples/_data.py)


def _launch(script: str, *args: str, nproc: int = 2, cwd: str, timeout: float = 150) -> list[str]:
    """Run ``python -m dptrain run --nproc-per-node N examples/<script> args``; return stdout lines."""
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", str(nproc), os.path.join(EXAMPLES, script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return [line for line in proc.stdout.splitlines() if line.strip()]


# ------------------------------------------------------------------ image classification --


def test_image_classification_on_digits(tmp_path):
    lines = _launch(
        "image_classification.py", "--num_epochs", "2", "--width", "4", "--batch_size", "32",
        "--model_dir", str(tmp_path / "m"), "--model_filename", "r.pth", "--log_dir", str(tmp_path / "tb"),
        cwd=str(tmp_path),
    )
    m = re.fullmatch(r"\[rank0\] test accuracy: (\d\.\d{4})", lines[-1])
    assert m, lines[-5:]
    assert 0.5 < float(m.group(1)) <= 1.0  # chance is 0.1; two short epochs reach about 0.85
    assert any(re.match(r"\[rank0\] epoch 2/2 \| train loss [\d.]+ \| dev loss [\d.]+ accuracy [\d.]+ \|", l) for l in lines)
    assert not any(l.startswith("[rank1]") for l in lines)  # only rank 0 prints
    # the saved model loads into a plain ResNet18; the safetensors export matches it
    plain = ResNet18(num_classes=10, in_channels=1, width=4)
    weights = checkpoint.load(tmp_path / "m" / "r.pth")
    checkpoint.load_model_state(plain, weights)
    exported = checkpoint.load_safetensors(tmp_path / "m" / "r.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in plain.state_dict().items())
    assert checkpoint.latest_checkpoint(tmp_path / "m" / "checkpoints").endswith("ckpt-e0002-s000000042.pt")


def test_image_classification_with_every_strategy_it_offers_fsdp(tmp_path):
    # --strategy fsdp once failed at once: the example built its optimizer before the Trainer
    # wrapped the model, and FSDP trains parameters that exist only after wrapping.
    lines = _launch(
        "image_classification.py", "--strategy", "fsdp", "--num_epochs", "2", "--width", "4",
        "--batch_size", "32", "--model_dir", str(tmp_path / "m"), cwd=str(tmp_path),
    )
    m = re.fullmatch(r"\[rank0\] test accuracy: (\d\.\d{4})", lines[-1])
    assert m, lines[-5:]
    assert 0.5 < float(m.group(1)) <= 1.0  # chance is 0.1; as with DDP, two short epochs reach about 0.85


def _fake_cifar(directory, seed=0, n_train=(24, 20), n_test=18):
    rng = np.random.RandomState(seed)
    os.makedirs(directory, exist_ok=True)
    made = {}
    for i, n in enumerate(n_train, start=1):
        labels = rng.randint(0, 10, n)
        # class-dependent brightness, so that the content is checkable after loading
        imgs = (labels[:, None, None, None] * 20 + rng.randint(0, 20, (n, 3, 32, 32))).astype(np.uint8)
        _data.write_cifar_batch(os.path.join(directory, f"data_batch_{i}"), imgs, labels)
        made[f"data_batch_{i}"] = (imgs, labels)
    labels = rng.randint(0, 10, n_test)
    imgs = (labels[:, None, None, None] * 20 + rng.randint(0, 20, (n_test, 3, 32, 32))).astype(np.uint8)
    _data.write_cifar_batch(os.path.join(directory, "test_batch"), imgs, labels)
    made["test_batch"] = (imgs, labels)
    return made


def test_cifar_reader_reads_the_python_batch_format(tmp_path):
    made = _fake_cifar(tmp_path / "cifar-10-batches-py")
    train, dev, test = _data.load_cifar10(str(tmp_path), seed=0, dev_fraction=0.25)  # the parent folder works too
    assert len(train) + len(dev) == 44 and len(dev) == 11 and len(test) == 18
    x, y = test.tensors
    assert x.shape == (18, 3, 32, 32) and x.dtype == torch.float32
    imgs, labels = made["test_batch"]
    assert y.tolist() == labels.tolist()
    mean, std = torch.tensor(_data.CIFAR_MEAN).view(3, 1, 1), torch.tensor(_data.CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x[5] * std + mean, torch.from_numpy(imgs[5]).float() / 255)
    all_train = torch.cat([train.tensors[1], dev.tensors[1]]).sort().values
    expect = np.concatenate([made["data_batch_1"][1], made["data_batch_2"][1]])
    assert all_train.tolist() == sorted(expect.tolist())
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 python batches"):
        _data.load_cifar10(str(tmp_path / "nothing"), seed=0)
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as fh:
        pickle.dump({b"data": os.system, b"labels": []}, fh)  # a pickle that would call code
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        _data.load_cifar10(str(tmp_path), seed=0)


def test_image_classification_on_cifar_files(tmp_path):
    _fake_cifar(tmp_path / "cifar")
    lines = _launch(
        "image_classification.py", "--data-dir", str(tmp_path / "cifar"), "--num_epochs", "1", "--width", "4",
        "--batch_size", "8", "--model_dir", str(tmp_path / "m"), "--compression", "bf16", cwd=str(tmp_path),
    )  # --compression: the Trainer's setting reaches DDP under the launcher
    assert re.fullmatch(r"\[rank0\] test accuracy: \d\.\d{4}", lines[-1]), lines[-5:]
    weights = checkpoint.load(tmp_path / "m" / "resnet_distributed.pth")
    assert weights["conv1.weight"].shape == (4, 3, 3, 3)  # 3 input channels: CIFAR, not digits


# --------------------------------------------------------------------------- SMILES -----


def test_the_digits_split_and_roc_auc_match_scikit_learn_without_importing_it_in_the_ranks():
    # The examples read scikit-learn's digits file and split and score on their own: importing
    # scikit-learn cost each rank 1-2 s of CPU, more than a short run's training.
    from sklearn.datasets import load_digits
    from sklearn.metrics import roc_auc_score

    x, y = _data.load_digits()
    digits = load_digits()
    assert np.array_equal(x, digits.images.astype(np.float32)) and np.array_equal(y, digits.target)
    rng = np.random.RandomState(0)
    for trial in range(200):
        n = int(rng.randint(2, 50))
        labels = rng.randint(0, 2, n)
        scores = rng.randint(0, 4, n).astype(float) if trial % 2 else rng.randn(n)  # ties, and none
        auc = _data.roc_auc(labels, scores)
        if 0 < labels.sum() < n:
            assert auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
        else:
            assert auc != auc  # NaN: one class only
    labels = [i % 3 == 0 for i in range(200)]
    rest, test = _data.stratified_split(range(200), labels, 0.1, seed=5)
    assert sorted(rest + test) == list(range(200)) and len(test) == 20  # ceil(0.1 * 200), as sklearn sizes it
    assert sum(labels[i] for i in test) == 7  # 67 of 200 positive: 6.7 rounded up
    assert (rest, test) == _data.stratified_split(range(200), labels, 0.1, seed=5)
    assert test != _data.stratified_split(range(200), labels, 0.1, seed=6)[1]
    with pytest.raises(ValueError, match="leaves no sample"):
        _data.stratified_split(range(3), [0, 1, 0], 0.0, seed=0)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import _data; _data.load_digits_split(0); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, EXAMPLES], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]


def test_synthetic_smiles_follow_the_stated_rule():
    smiles, labels = _data.synthetic_smiles(300, seed=3)
    assert smiles == _data.synthetic_smiles(300, seed=3)[0]
    assert 0.2 < sum(labels) / len(labels) < 0.8  # both classes well represented
    for s, y in zip(smiles, labels):
        assert y == int(sum(c in "NOno" for c in s) <= 3)
    assert _data.count_n_o("CC(=O)Nc1ccc(O)cc1") == 3 and _data.count_n_o("[Na+].[Cl-]") == 0


def test_bbbp_csv_reader(tmp_path):
    path = tmp_path / "BBBP.csv"
    path.write_text("num,name,p_np,smiles\n1,Propanolol,1,[Cl].CC(C)NCC(O)COc1cccc2ccccc12\n2,x,0,CCN\n3,empty,1,\n")
    assert _data.read_bbbp_csv(str(path)) == (["[Cl].CC(C)NCC(O)COc1cccc2ccccc12", "CCN"], [1, 0])
    (tmp_path / "bad.csv").write_text("name,label,smiles\nx,1,C\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['p_np'\]"):
        _data.read_bbbp_csv(str(tmp_path / "bad.csv"))
    (tmp_path / "bad2.csv").write_text("name,p_np,smiles\nx,yes,C\n")
    with pytest.raises(ValueError, match="line 2: p_np='yes'"):
        _data.read_bbbp_csv(str(tmp_path / "bad2.csv"))


def _auc_line(lines):
    m = [re.fullmatch(r"\[rank0\] held-out ROC AUC: (\d\.\d{4}) over (\d+) molecules \(world size 2\)", l) for l in lines]
    m = [x for x in m if x]
    assert len(m) == 1, lines[-6:]
    return float(m[0].group(1)), int(m[0].group(2))


def _heldout_auc_of_the_saved_model(argv):
    """The held-out ROC AUC recomputed in this process: the example's split, its saved best
    weights, one forward over every held-out molecule, sklearn's roc_auc_score."""
    from sklearn.metrics import roc_auc_score

    import smiles_classifier as sc

    args = sc.parse_args(argv)
    smiles, labels = _data.synthetic_smiles(args.num_molecules, seed=args.random_seed)
    idx = list(range(len(smiles)))
    visible, heldout = _data.stratified_split(idx, labels, 0.1, args.random_seed)
    train_ix, _ = _data.stratified_split(visible, [labels[i] for i in visible], 0.2, args.random_seed)
    tokenizer = sc.CharTokenizer([smiles[i] for i in train_ix])
    ids, lengths = tokenizer.encode(smiles, min(max(len(s) for s in smiles), 200))
    model = sc.RNNPredictor(len(tokenizer), args.embedding_dim, args.hidden_dim, args.num_layers, args.dropout)
    model.load_state_dict(checkpoint.load(os.path.join(args.model_dir, args.model_filename)))
    model.eval()
    ix = torch.tensor(heldout)
    with torch.no_grad():
        scores = model(ids[ix], lengths[ix]).reshape(-1)
    return float(roc_auc_score([labels[i] for i in heldout], scores.numpy())), len(heldout)


def test_smiles_classifier_synthetic_with_tensorboard(tmp_path):
    argv = ["--num_molecules", "200", "--num_epochs", "2", "--embedding_dim", "8", "--hidden_dim", "8",
            "--model_dir", str(tmp_path / "m"), "--log_dir", str(tmp_path / "tb")]
    lines = _launch("smiles_classifier.py", *argv, cwd=str(tmp_path))
    auc, count = _auc_line(lines)
    assert count == 20  # 10 % held out, each molecule counted once across the 2 ranks
    # Two tiny epochs do not learn the rule (the value is near chance), so the check is that the
    # number is right: the AUC gathered over both ranks is the one of all held-out molecules.
    assert (auc, count) == (pytest.approx(_heldout_auc_of_the_saved_model(argv)[0], abs=5e-5), 20)
    assert any("synthetic" in l for l in lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert len(acc.Scalars("dev/roc_auc")) == 2 and len(acc.Scalars("test/roc_auc")) == 1


def test_smiles_classifier_on_a_bbbp_csv(tmp_path):
    smiles, labels = _data.synthetic_smiles(150, seed=11)
    rows = ["num,name,p_np,smiles"] + [f"{i},mol{i},{y},{s}" for i, (s, y) in enumerate(zip(smiles, labels))]
    (tmp_path / "BBBP.csv").write_text("\n".join(rows) + "\n")
    lines = _launch(
        "smiles_classifier.py", "--data-path", str(tmp_path / "BBBP.csv"), "--num_epochs", "1", "--embedding_dim", "8",
        "--hidden_dim", "8", "--model_dir", str(tmp_path / "m"), "--log_dir", "", cwd=str(tmp_path),
    )
    _, count = _auc_line(lines)
    assert count == 15
    assert any(l.startswith("[rank0] data: 150 molecules") and "BBBP.csv" in l for l in lines)


# ---------------------------------------------------------------- toy model, six steps --


def test_toy_model_spawns_its_own_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "toy_model.py"), "--nprocs", "2", "--num_epochs", "1", "--steps_per_epoch", "3",
         "--model_dir", str(tmp_path / "m")],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas identical: True" in proc.stdout
    sums = re.search(r"spawned 2 ranks; checksums \[(\S+), (\S+)\]", proc.stdout)
    assert sums and sums.group(1) == sums.group(2)
    assert "Running basic DDP example on rank 1 of 2." in proc.stdout
    from dptrain.models import ToyModel

    checkpoint.load_model_state(ToyModel(), checkpoint.load(tmp_path / "m" / "toy_model.pt"))


def test_toy_model_under_the_launcher(tmp_path):
    lines = _launch("toy_model.py", "--num_epochs", "1", "--model_dir", str(tmp_path / "m"), cwd=str(tmp_path))
    # (rank 1's greeting may be relayed after rank 0's last line: look at rank 0's lines)
    rank0 = [l for l in lines if l.startswith("[rank0] ")]
    assert rank0[-1].startswith("[rank0] final loss on rank 0:") and rank0[-1].endswith("replicas identical: True"), lines
    assert "[rank1] Running basic DDP example on rank 1 of 2." in lines


def test_six_steps(tmp_path):
    lines = _launch("six_steps.py", "--num_epochs", "1", "--model_dir", str(tmp_path / "m"), cwd=str(tmp_path))
    m = re.fullmatch(r"\[rank0\] test accuracy over 501 samples on 2 ranks: (\d\.\d{4})", lines[-1])
    assert m, lines[-3:]
    assert float(m.group(1)) > 0.7
    # --resume continues from the saved epoch (here as a single process: same code, no group)
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "six_steps.py"), "--num_epochs", "2", "--resume", "--model_dir", str(tmp_path / "m")],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.splitlines()
    assert out[0].startswith("epoch 2:") and not any(l.startswith("epoch 1:") for l in out)
    assert checkpoint.load(tmp_path / "m" / "model.pt")["epoch"] == 1


# ------------------------------------------------- resuming into a longer run, any world --

_TINY = {
    "image_classification.py": ["--width", "4", "--batch_size", "64"],
    "smiles_classifier.py": ["--num_molecules", "160", "--embedding_dim", "8", "--hidden_dim", "8", "--log_dir", ""],
}


@pytest.mark.parametrize("script", sorted(_TINY))
def test_examples_resume_into_a_longer_run_on_the_same_and_another_world(tmp_path, script):
    """`--num_epochs 1`, then `--num_epochs 2 --resume` (2 ranks), then `--num_epochs 3 --resume` on 3 ranks."""
    common = [*_TINY[script], "--model_dir", str(tmp_path / "m")]
    _launch(script, "--num_epochs", "1", *common, cwd=str(tmp_path))
    lines = _launch(script, "--num_epochs", "2", "--resume", *common, cwd=str(tmp_path))
    assert any(re.match(r"\[rank0\] resumed from .*ckpt-e0001-s\d+\.pt \(epoch 2, batch 0", l) for l in lines), lines
    assert any(l.startswith("[rank0] epoch 2/2 |") for l in lines) and not any("epoch 1/2" in l for l in lines)
    lines = _launch(script, "--num_epochs", "3", "--resume", *common, nproc=3, cwd=str(tmp_path))
    assert any(re.match(r"\[rank0\] resumed from .*ckpt-e0002-s\d+\.pt \(epoch 3, batch 0", l) for l in lines), lines
    assert any(l.startswith("[rank0] epoch 3/3 |") for l in lines)


def test_toy_model_uses_the_launchers_world_even_of_one(tmp_path):
    lines = _launch("toy_model.py", "--num_epochs", "1", "--model_dir", str(tmp_path / "m"), nproc=1, cwd=str(tmp_path))
    assert "[rank0] Running basic DDP example on rank 0 of 1." in lines and not any("of 2" in l for l in lines), lines
    # and the saved model resumes on another number of ranks
    lines = _launch("toy_model.py", "--num_epochs", "1", "--resume", "--model_dir", str(tmp_path / "m"), cwd=str(tmp_path))
    assert any(l.endswith("replicas identical: True") for l in lines)


# -------------------------------------------------------------------------- char GPT --


def _char_gpt_args(tmp_path, steps: int = 12) -> list[str]:
    return ["--config", os.path.join(EXAMPLES, "char_gpt.yaml"), "--trainer.max_steps", str(steps),
            "--trainer.eval_every_steps", "6", "--trainer.save_every_steps", "6", "--trainer.warmup_steps", "3",
            "--trainer.checkpoint_dir", str(tmp_path / "ckpt"), "--trainer.metrics_path", str(tmp_path / "metrics.csv"),
            "--model.depth", "1", "--model.dim", "32", "--model.block_size", "32", "--data.num_stories", "300",
            "--data.batch_size", "8", "--run.sample_chars", "20"]


def test_char_gpt_streams_trains_by_steps_from_a_yaml_config_and_resumes_into_a_longer_run(tmp_path):
    lines = _launch("char_gpt.py", *_char_gpt_args(tmp_path), cwd=str(tmp_path))
    assert any(re.fullmatch(r"\[rank0\] step 12/12 \| dev loss [\d.]+", l) for l in lines), lines[-6:]
    assert any(re.fullmatch(r"\[rank0\] [\d.]+M parameters, 12 steps, best validation loss [\d.]+ at step \d+", l)
               for l in lines), lines[-4:]
    assert lines[-1].startswith("[rank0] sample: 'Ada had a")
    assert os.path.exists(tmp_path / "ckpt" / "char_gpt.pt")  # the final weights
    with open(tmp_path / "ckpt" / "config.yaml") as fh:  # the resolved settings, beside the checkpoints
        saved = fh.read()
    assert "max_steps: 12" in saved and "depth: 1" in saved
    with open(tmp_path / "metrics.csv") as fh:  # the CSV tracker, chosen in the YAML file
        rows = fh.read().splitlines()
    assert rows[0].startswith("step,") and any(r.startswith("12,") for r in rows)
    longer = _launch("char_gpt.py", *_char_gpt_args(tmp_path, steps=18), cwd=str(tmp_path))
    assert any("resumed from" in l and "step 12" in l for l in longer), longer[:5]
    assert any(re.match(r"\[rank0\] [\d.]+M parameters, 18 steps", l) for l in longer), longer[-4:]


def test_char_gpt_runs_under_torchrun_with_workers(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", os.path.join(EXAMPLES, "char_gpt.py"),
           *_char_gpt_args(tmp_path, steps=6), "--data.num_workers", "2", "--trainer.amp", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(r"[\d.]+M parameters, 6 steps", proc.stdout), proc.stdout[-2000:]


def _rank_pids(script: str, marker: str, launcher: int) -> list[int]:
    """The processes but ``launcher`` running ``script`` with ``marker`` on their command line (a folder of
    the test's own) whose parent does not run it (ranks, not their loader workers). Not by their ancestry: a rank forked
    from a shared template (tests/conftest.py) is not a descendant of its launcher."""
    def cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def parent(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    found = []
    for entry in os.listdir("/proc"):
        line = cmdline(entry) if entry.isdigit() else ""
        if script not in line or marker not in line:
            continue
        pid = int(entry)
        if pid != launcher and script not in cmdline(parent(pid)):
            found.append(pid)
    return sorted(found)


def test_char_gpt_killed_rank_is_replaced_in_place_and_ends_with_the_uninterrupted_weights(tmp_path):
    # As a user would: `kill -9` one rank of a running job under --recovery in-place, by hand.
    import signal

    def args(where):
        return [*_char_gpt_args(where, steps=60), "--trainer.eval_every_steps", "20", "--data.num_workers", "1"]

    _launch("char_gpt.py", *args(tmp_path / "a"), cwd=str(tmp_path))
    reference = torch.load(tmp_path / "a" / "ckpt" / "char_gpt.pt", weights_only=True)
    cmd = [sys.executable, "-m", "dptrain", "run", "--recovery", "in-place", "--max-restarts", "2",
           "--nproc-per-node", "2", os.path.join(EXAMPLES, "char_gpt.py"), *args(tmp_path / "b")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    job = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, victim = [], None
    import threading

    watchdog = threading.Timer(200, job.kill)  # a hang fails the test (the read below ends with the job)
    watchdog.start()
    try:
        for line in job.stdout:  # the job's own output, live: kill when the first evaluation is printed
            lines.append(line)
            if victim is None and "step 20/60 | dev loss" in line:
                ranks = _rank_pids("char_gpt.py", str(tmp_path / "b"), job.pid)
                assert len(ranks) == 2, (ranks, lines[-5:])
                victim = ranks[-1]
                os.kill(victim, signal.SIGKILL)
        job.wait(timeout=150)
    finally:
        watchdog.cancel()
        if job.poll() is None:
            job.kill()
    log = "".join(lines)
    assert victim is not None and job.returncode == 0, log[-3000:]
    assert "recovered in place" in log and f"pid {victim}" in log and "out of memory" not in log, log[-3000:]
    final = torch.load(tmp_path / "b" / "ckpt" / "char_gpt.pt", weights_only=True)
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
