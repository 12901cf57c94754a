"""dptrain.Trainer: config validation, exact evaluation, best model, accumulation, logging,
and checkpoints that resume bit for bit (also across world sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from dptrain.data import prepare_dataloader
from dptrain.parallel.fsdp import ParamCountPolicy
from dptrain.train import Trainer, TrainerConfig
from tests._dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------- helpers -----


def _dataset(n: int = 96, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def _model() -> nn.Module:
    # Dropout and BatchNorm: resume must restore RNG streams and buffers too.
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))


def _accuracy(out, tgt):
    return {"accuracy": (out.argmax(1) == tgt).float().mean().item()}


def _trainer(cdir=None, resume=False, strategy=None, accum=1, steps=0, bs=6, n=96, log_dir=None, dev=True, dev_n=37, **cfg):
    dptrain.seed_everything(0)
    model = _model()
    if strategy == "fsdp":  # the optimizer must be built on the sharded parameters, after wrapping
        opt = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
        sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
        cfg.setdefault("fsdp_kwargs", {"auto_wrap_policy": ParamCountPolicy(50)})
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    config = TrainerConfig(
        strategy=strategy, checkpoint_dir=cdir, save_every_steps=steps, keep_last=0, gradient_accumulation_steps=accum,
        best_metric="accuracy", best_mode="max", verbose=False, log_dir=log_dir, **cfg,
    )
    data = _dataset(n)
    return Trainer(
        model, opt, prepare_dataloader(data, bs, seed=3), nn.CrossEntropyLoss(), config,
        dev_data=prepare_dataloader(_dataset(dev_n, seed=2), 8, mode="eval") if dev else None,
        scheduler=sched, metric_fn=_accuracy, resume=resume,
    )


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_state_dict().items()}


def _weights(state: dict) -> dict:
    # Parameters only: DDP syncs buffers (BatchNorm statistics) from rank 0 at the start of
    # each forward, so after the last forward every rank holds its own statistics.
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- config --------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "dp"}, r"strategy='dp'.*'ddp', 'fsdp', 'torch-ddp', 'none'"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0"),
        ({"best_mode": "maximum"}, r"best_mode='maximum'"),
        ({"save_every_steps": 10}, r"save_every_steps=10.*checkpoint_dir"),
        ({"batch_size": -2}, r"batch_size=-2"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm=0.0"),
        ({"scheduler_interval": "batch"}, r"scheduler_interval='batch'"),
        ({"amp_dtype": "int8"}, r"amp_dtype='int8'"),
    ],
)
def test_config_rejects_bad_values_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


def test_config_to_dict_is_plain():
    d = TrainerConfig(checkpoint_dir="c", ddp_kwargs={"bucket_cap_mb": 1}).to_dict()
    assert d["checkpoint_dir"] == "c" and d["strategy"] is None and isinstance(d["ddp_kwargs"], str)


def test_single_process_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="strategy='torch-ddp'.*needs a process group"):
        _trainer(strategy="torch-ddp")
    with pytest.raises(ValueError, match="batch_size=None"):
        Trainer(_model(), lambda p: torch.optim.SGD(p, lr=0.1), _dataset(), nn.CrossEntropyLoss())
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        _trainer(resume=str(tmp_path / "missing.pt"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"junk")
    with pytest.raises(checkpoint.CheckpointError, match="bad.pt"):
        _trainer(resume=str(bad))
    checkpoint.save({"model": {}}, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="not a dptrain Trainer checkpoint"):
        _trainer(resume=str(tmp_path / "bare.pt"))


def test_amp_on_cpu_warns_once_and_trains_in_fp32():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = _trainer(amp=True)
    assert any("amp=True) is ignored" in str(w.message) for w in caught)
    assert t.amp is False and t.scaler is None
    t.fit(1)
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


# ----------------------------------------------------------- single process training ---


def test_fit_single_process_history_best_and_export(tmp_path):
    t = _trainer(cdir=str(tmp_path / "ck"), log_dir=str(tmp_path / "tb"), export_safetensors=str(tmp_path / "w.safetensors"))
    assert t.strategy == "none" and t.model is not None
    summary = t.fit(3)
    hist = summary["history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3]  # from 1, as printed
    assert all(h["time_s"] > 0 and 0 <= h["dev_accuracy"] <= 1 for h in hist)
    # the LR schedule ran once per epoch: StepLR(step_size=2, gamma=0.5)
    assert [h["lr"] for h in hist] == [0.05, 0.05, 0.025]
    best = max(range(3), key=lambda e: (hist[e]["dev_accuracy"], -e))
    assert summary["best"] == {"epoch": best + 1, "metric": "accuracy", "value": hist[best]["dev_accuracy"]}
    on_disk = checkpoint.load(tmp_path / "ck" / "best.pt")
    assert on_disk["epoch"] == best + 1 and _same(on_disk["model"], t.best_state)
    exported = checkpoint.load_safetensors(tmp_path / "w.safetensors")
    assert _same(exported, {k: v for k, v in t.best_state.items()})
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["best.pt", "ckpt-e0001-s000000016.pt", "ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"]
    # TensorBoard: per-epoch scalars and the hparams table
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert len(acc.Scalars("train/loss")) == 3 and len(acc.Scalars("dev/accuracy")) == 3
    assert any(name.startswith("events") for name in os.listdir(tmp_path / "tb"))


def test_fresh_runs_move_each_earlier_run_aside_in_one_line_and_delete_nothing(tmp_path, capsys):
    cdir = str(tmp_path / "ck")
    _trainer(cdir).fit(3)  # an old, longer run: steps 16, 32, 48
    capsys.readouterr()
    for run in range(2):  # `make demo` twice more: one line each time
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said as a dptrain line, not a Python warning with file and line
            t = _trainer(cdir)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dptrain: checkpoint_dir {cdir!r} held checkpoints of an "), err
        assert "previous-run-" in err and "nothing is deleted" in err and "resume='auto'" in err
        t.fit(1 if run == 0 else 2)
    # the newest run's checkpoints are the newest; a resume can no longer pick an old run's step 48
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(cdir)] == [
        "ckpt-e0001-s000000016.pt", "ckpt-e0002-s000000032.pt"]
    # both earlier runs are kept, each in a folder named for when it ran, oldest first
    folders = sorted(d for d in os.listdir(cdir) if os.path.isdir(os.path.join(cdir, d)))
    assert len(folders) == 2 and all(d.startswith("previous-run-2") for d in folders), folders
    assert [sorted(os.listdir(os.path.join(cdir, d))) for d in folders] == [
        ["best.pt", "ckpt-e0001-s000000016.pt", "ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"],
        ["best.pt", "ckpt-e0001-s000000016.pt"]]
    assert "2 earlier runs are kept" in err and f"resume={os.path.join(cdir, folders[1], 'ckpt-e0001-s000000016.pt')!r}" in err


def test_evaluate_matches_a_plain_loop_and_test_uses_best_model(tmp_path):
    t = _trainer()
    t.fit(2)
    metrics = t.evaluate()
    net = checkpoint.unwrap_model(t.model).eval()
    ds = _dataset(37, seed=2)
    with torch.no_grad():
        out = net(ds.tensors[0])
    assert metrics["loss"] == pytest.approx(float(nn.CrossEntropyLoss()(out, ds.tensors[1])), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(_accuracy(out, ds.tensors[1])["accuracy"])
    # test() loads the best weights first
    t.model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    res = t.test(prepare_dataloader(_dataset(37, seed=2), 8, mode="eval"))
    assert res["accuracy"] == pytest.approx(t.best_metric)


def test_gradient_accumulation_matches_the_larger_batch():
    def run(accum, bs):
        dptrain.seed_everything(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = prepare_dataloader(_dataset(48), bs, shuffle=False)
        t = Trainer(model, opt, loader, nn.CrossEntropyLoss(), TrainerConfig(gradient_accumulation_steps=accum, verbose=False))
        t.fit(2)
        return _params(t), t.global_step

    big, steps_big = run(1, 12)
    small, steps_small = run(3, 4)
    assert steps_big == steps_small == 8
    for k in big:
        torch.testing.assert_close(small[k], big[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- multi-rank -----------


def _resume_ranks(rank, cdir, strategy, accum, **kw):
    """Train 3 epochs with step checkpoints; resume from an epoch-end and a mid-epoch one."""
    full = _trainer(cdir, strategy=strategy, accum=accum, steps=3, **kw)
    summary = full.fit(3)
    expect = _params(full)
    names = sorted(os.listdir(cdir))
    per_epoch = (96 // 2 + 5) // 6  # 8 batches per rank per epoch
    steps_per_epoch = -(-per_epoch // accum)
    epoch_end = checkpoint.checkpoint_path(cdir, 1, steps_per_epoch)
    mid = [n for n in names if n.startswith("ckpt-e0001") and n != os.path.basename(epoch_end)][0]
    out = {"names": names, "summary_loss": [h["train_loss"] for h in summary["history"]]}
    for label, path in (("epoch_end", epoch_end), ("mid_epoch", os.path.join(cdir, mid))):
        resumed = _trainer(cdir, resume=path, strategy=strategy, accum=accum, steps=3, **kw)
        assert resumed.resumed_from == path
        s = resumed.fit(3)
        out[label] = _same(_params(resumed), expect)
        out[label + "_loss"] = [h["train_loss"] for h in s["history"]]
        out[label + "_best"] = s["best"] == summary["best"]
    out["params"] = expect
    return out


def _check_resumed(results):
    for r in results:
        assert r["epoch_end"], "resume from an epoch-end checkpoint diverged"
        assert r["mid_epoch"], "resume from a mid-epoch checkpoint diverged"
        assert r["epoch_end_loss"] == r["summary_loss"] and r["mid_epoch_loss"] == r["summary_loss"]
        assert r["epoch_end_best"] and r["mid_epoch_best"]
    assert _same(_weights(results[0]["params"]), _weights(results[1]["params"]))  # the replicas agree
    # a mid-epoch checkpoint exists (steps 3, 6, ... are not all on epoch ends)
    assert any(n.startswith("ckpt-e0001") for n in results[0]["names"])


def test_resume_is_bitwise_equal_and_our_ddp_equals_torch_ddp(tmp_path):
    ours = run_ranks(_resume_ranks, 2, str(tmp_path / "ours"), "ddp", 1)
    _check_resumed(ours)
    theirs = run_ranks(_resume_ranks, 2, str(tmp_path / "torch"), "torch-ddp", 1)
    _check_resumed(theirs)
    # the contract: dptrain's DDP and PyTorch's give the same parameters, bit for bit, on 2 ranks
    assert _same(ours[0]["params"], theirs[0]["params"])


def test_resume_is_bitwise_equal_with_gradient_accumulation(tmp_path):
    # checkpoints only fall between optimizer steps: steps 3, 6, ... of 4 per epoch
    _check_resumed(run_ranks(_resume_ranks, 2, str(tmp_path), "ddp", 2))


def _train_ranks(rank, cdir, strategy, epochs):
    t = _trainer(cdir, strategy=strategy)
    s = t.fit(epochs)
    return {"params": _params(t), "latest": checkpoint.latest_checkpoint(cdir), "history": s["history"], "dev": t.evaluate()}


def _load_ranks(rank, path, cdir):
    t = _trainer(cdir, resume=path)
    loaded = _params(t)
    s = t.fit(3)  # one more epoch on this world size
    return {"loaded": loaded, "after": _params(t), "epoch": t.epoch, "history": s["history"], "world": dptrain.world_size()}


def test_two_rank_checkpoint_loads_into_plain_model_one_rank_and_three_ranks(tmp_path):
    r = run_ranks(_train_ranks, 2, str(tmp_path / "two"), "ddp", 2)
    path = r[0]["latest"]
    trained = r[0]["params"]
    # 1) a plain model, no Trainer
    plain = _model()
    checkpoint.load_model_state(plain, checkpoint.load(path)["model"])
    assert _same({k: v for k, v in plain.state_dict().items()}, trained)
    # the dev metrics were gathered exactly: every one of the 37 samples, equal on both ranks
    assert r[0]["dev"] == r[1]["dev"]
    # 2) a single process
    with pytest.warns(UserWarning, match="written by 2 ranks and is resumed on 1"):
        one = _trainer(str(tmp_path / "one"), resume=path)
    assert _same(_params(one), trained) and one.epoch == 2
    one.fit(3)
    assert one.epoch == 3 and len(one.history) == 3
    # 3) three ranks
    three = run_ranks(_load_ranks, 3, path, str(tmp_path / "three"))
    for res in three:
        assert res["world"] == 3 and res["epoch"] == 3
        assert _same(res["loaded"], trained)
        assert _same(_weights(res["after"]), _weights(three[0]["after"]))  # DDP keeps the replicas equal
        assert [h["epoch"] for h in res["history"]] == [1, 2, 3]


def _fsdp_ranks(rank, cdir):
    out = _resume_ranks(rank, cdir, "fsdp", 1, dev_n=33)  # 17 and 16 dev samples: 3 and 2 batches
    ddp = _trainer(None, strategy="ddp", dev_n=33)
    ddp.fit(3)
    out["ddp_params"] = _params(ddp)
    return out


def test_fsdp_strategy_resumes_bitwise_and_matches_ddp(tmp_path):
    results = run_ranks(_fsdp_ranks, 2, str(tmp_path))
    _check_resumed(results)
    # FSDP matches DDP up to fp32 rounding (the contract)
    for k, v in _weights(results[0]["ddp_params"]).items():
        torch.testing.assert_close(results[0]["params"][k], v, rtol=1e-5, atol=1e-6)
    # its checkpoints hold full weights with plain keys: they load into a plain model
    plain = _model()
    checkpoint.load_model_state(plain, checkpoint.load(checkpoint.latest_checkpoint(tmp_path))["model"])
    assert _same(_weights(plain.state_dict()), _weights(results[0]["params"]))


def _auto_resume_ranks(rank, cdir):
    t = _trainer(cdir, resume=None, steps=5)  # resume=None: automatic when the launcher restarted us
    s = t.fit(2)
    return {"from": t.resumed_from, "params": _params(t), "restart": dptrain.get_world().restart_count, "step": s["global_step"]}


def test_restarted_job_resumes_automatically(tmp_path):
    cdir = str(tmp_path)
    first = run_ranks(_auto_resume_ranks, 2, cdir)
    assert first[0]["from"] is None and first[0]["restart"] == 0
    # keep only a mid-run checkpoint, as if the job had died after it
    keep = checkpoint.checkpoint_path(cdir, 0, 5)
    for p in checkpoint.list_checkpoints(cdir):
        if p != keep:
            os.remove(p)
    again = run_ranks(_auto_resume_ranks, 2, cdir, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    for before, r in zip(first, again):
        assert r["restart"] == 1 and r["from"] == keep
        assert _same(r["params"], before["params"]) and r["step"] == before["step"]


# A training script killed by SIGKILL on rank 1 at a chosen step of its first attempt;
# `dptrain run --max-restarts 1` restarts both ranks and the Trainer resumes automatically.
_CRASHING_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    sys.path.insert(0, {root!r})
    import dptrain
    from tests.test_trainer import _trainer, _params

    cdir, kill_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    world = dptrain.init()
    t = _trainer(cdir, resume=None, steps=2)
    inner = t.loss_fn

    def loss_fn(o, y):
        if world.restart_count == 0 and world.rank == 1 and t.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(o, y)

    t.loss_fn = loss_fn
    t.fit(3)
    if world.rank == 0:
        torch.save({{"params": _params(t), "resumed_from": t.resumed_from, "restart": world.restart_count}}, out)
    dptrain.shutdown()
    """
)


def _uninterrupted_ranks(rank, cdir):
    t = _trainer(cdir, resume=None, steps=2)
    t.fit(3)
    return _params(t)


def test_kill_9_and_launcher_restart_gives_the_uninterrupted_model(tmp_path):
    clean = run_ranks(_uninterrupted_ranks, 2, str(tmp_path / "clean"))[0]
    script = tmp_path / "crashy.py"
    script.write_text(_CRASHING_SCRIPT.format(root=ROOT))
    out = tmp_path / "killed.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--max-restarts", "1", str(script),
         str(tmp_path / "killed"), "13", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGKILL" in proc.stderr and "restart 1 of 1" in proc.stderr
    killed = torch.load(out, weights_only=True)
    # rank 1 died after step 13; the newest complete checkpoint was the one of step 12
    assert killed["restart"] == 1 and killed["resumed_from"].endswith("ckpt-e0001-s000000012.pt")
    assert _same(killed["params"], clean)
