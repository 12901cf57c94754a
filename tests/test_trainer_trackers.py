"""Experiment trackers (issue 45): one W&B and one MLflow run per job, written by rank 0 only,
with the resolved config once and the metrics by global step, continued through a failure, a
resume, a restart and an in-place recovery, each step logged once, and marked failed or killed
when the job fails or is stopped.

The real packages, offline: W&B with ``WANDB_MODE=offline`` (each run read back from the
transaction log of its ``offline-run-*`` folder), MLflow on its local folder store. A test that
needs them is skipped where they are not installed (the ``test`` extra installs them).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import dptrain
from dptrain import Trainer, TrainerConfig, prepare_dataloader
from dptrain.train import Callback
from dptrain.train.trackers import CSVTracker, Tracker, TrackerGroup, make_trackers
from tests._dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_trackers.py")
STEPS = list(range(1, 17))  # 64 samples, batch 4 on each of 2 ranks: 8 steps an epoch, 2 epochs


@pytest.fixture
def packages(monkeypatch):
    """W&B and MLflow installed; this process reads MLflow's folder store (and sends MLflow no telemetry)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _env(out, **more) -> dict[str, str]:
    """W&B offline, every folder of its own under ``out``; MLflow allowed its folder store, no telemetry."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(out),
            "WANDB_CONFIG_DIR": os.path.join(out, ".wandb-config"),
            "WANDB_CACHE_DIR": os.path.join(out, ".wandb-cache"),
            "WANDB_DATA_DIR": os.path.join(out, ".wandb-data"), "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_DISABLE_TELEMETRY": "true", **more}


# ------------------------------------------------------------- reading the runs back --

_BLOCK = 32 * 1024


def _wandb_records(path):
    """The records of a W&B transaction log: a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each with a 7-byte header (crc, length, type: 1 full, 2 first,
    3 middle, 4 last); a block's last bytes are padding when no chunk header fits."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the rest of the block is empty
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_runs(root) -> list[dict]:
    """Every offline W&B run folder under ``root``, oldest first: id, config, steps per metric, exit code."""
    runs = []
    for folder in sorted(glob.glob(os.path.join(root, "**", "offline-run-*"), recursive=True)):
        (log,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        # The id from the file's name: a process killed before W&B wrote its first block leaves only the header.
        run = {"id": os.path.basename(log)[len("run-"):-len(".wandb")], "config": {}, "steps": {}, "exit_code": None}
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run["id"]
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                row = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.history.item}
                for key in row:
                    if not key.startswith("_"):
                        run["steps"].setdefault(key, []).append(int(row["_step"]))
            elif kind == "exit":
                run["exit_code"] = record.exit.exit_code
        runs.append(run)
    return runs


def _mlflow_runs(uri: str) -> list[dict]:
    """Every run of every experiment in MLflow's store ``uri``: status, params, steps per metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            run_id = run.info.run_id
            steps = {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}
            out.append({"id": run_id, "status": run.info.status, "name": run.info.run_name, "params": run.data.params,
                        "experiment": experiment.name, "steps": steps})
    return out


def _csv_steps(path, metric="step_loss") -> list[int]:
    import csv

    with open(path) as fh:
        return [int(row["step"]) for row in csv.DictReader(fh) if row["metric"] == metric]


# ------------------------------------------------------------------- the ranks' side --


class _Recorder(Tracker):
    """A tracker of the test's own: writes each call it gets to a file named by the caller's rank."""

    name = "recorder"

    def __init__(self, out: str) -> None:
        self.out = out

    def _note(self, *what) -> None:
        with open(os.path.join(self.out, f"recorder-rank{dptrain.rank()}.jsonl"), "a") as fh:
            fh.write(json.dumps(what) + "\n")

    def start(self, run_id, resume_step):
        self._note("start", run_id, resume_step)
        return "recorded"

    def log_hyperparams(self, params):
        self._note("hparams", params["world_size"], params["note"], params["batch_size"])

    def log_metrics(self, metrics, step, epoch=None):
        self._note("metrics", step)

    def finalize(self, status):
        self._note("finalize", status)


class _StopAt(Callback):
    """Ends the run after optimizer step ``step``: an exception on every rank, or a SIGTERM to this process."""

    def __init__(self, step: int, how: str = "raise") -> None:
        self.step, self.how = step, how

    def on_step_end(self, trainer, info) -> None:
        if info.step == self.step and self.how == "raise":
            raise RuntimeError(f"a planned failure after step {info.step}")
        if info.step == self.step and trainer.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # what dptrain run sends when it stops a job


def _trainer(out: str, resume=False, callbacks=(), recorder=True) -> Trainer:
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    config = TrainerConfig(
        checkpoint_dir=os.path.join(out, "ck"), save_every_steps=4, log_every_steps=1, verbose=False, progress=False,
        loggers=["wandb", "mlflow"] + ([_Recorder(out)] if recorder else []), metrics_path=os.path.join(out, "m.csv"),
        project="trackers-test", run_name="job", tracking_uri=f"file:{out}/mlruns",
    )
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), prepare_dataloader(data, 4, seed=3),
                   nn.CrossEntropyLoss(), config, dev_data=prepare_dataloader(data, 16, mode="eval"), resume=resume,
                   callbacks=list(callbacks), hparams={"note": "tracked"})


def _fail_then_resume(rank: int, out: str):
    failing = _trainer(out, callbacks=[_StopAt(6)])
    with pytest.raises(RuntimeError, match="planned failure"):
        failing.fit(2)
    status = [r["status"] for r in _mlflow_runs(f"file:{out}/mlruns")] if rank == 0 else None
    resumed = _trainer(out, resume="auto")  # a second Trainer over the same checkpoints: a resume
    summary = resumed.fit(2)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "mlflow", "tensorboard"))
    return status, resumed.resumed_from, summary["global_step"], loaded


def _attempt(rank: int, out: str, stop_at: int | None):
    trainer = _trainer(out, resume=None, callbacks=[_StopAt(stop_at, "term")] if stop_at else [], recorder=False)
    return trainer.resumed_from, trainer.fit(2)["global_step"]


# ------------------------------------------------------------------------- the tests --


def test_two_ranks_one_run_each_through_a_failure_and_a_resume_every_step_once(tmp_path, packages):
    out = str(tmp_path)
    (first, second) = run_ranks(_fail_then_resume, 2, out, env=_env(out), timeout=120)
    assert first[0] == ["FAILED"], first  # the failed fit marked its run failed, not running
    assert first[1].endswith("ckpt-e0000-s000000004.pt") and first[2] == second[2] == 16
    assert second[3] == [] and "wandb" in first[3]  # rank 1 never even imports the trackers' packages

    (run,) = _mlflow_runs(f"file:{out}/mlruns")  # one run for the job, not one per rank or per fit
    assert run["status"] == "FINISHED" and run["experiment"] == "trackers-test" and run["name"] == "job"
    assert run["steps"]["train/step_loss"] == STEPS and run["steps"]["train/lr"] == STEPS
    assert run["steps"]["dev/loss"] == [8, 16]
    assert run["params"]["world_size"] == "2" and run["params"]["note"] == "tracked"
    assert run["params"]["batch_size"] == "None" and run["params"]["save_every_steps"] == "4"

    runs = _wandb_runs(tmp_path / "wandb")
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]  # one run: continued by its id
    assert [r["exit_code"] for r in runs] == [1, 0]
    assert runs[0]["config"]["world_size"] == 2 and runs[0]["config"]["note"] == "tracked"
    steps = runs[0]["steps"]["train/step_loss"] + runs[1]["steps"]["train/step_loss"]
    assert steps == STEPS, steps  # 1-5 by the failed fit, 6-16 by the resumed one
    assert _csv_steps(tmp_path / "m.csv") == STEPS

    assert not os.path.exists(tmp_path / "recorder-rank1.jsonl")  # rank 0 only, by construction
    with open(tmp_path / "recorder-rank0.jsonl") as fh:
        calls = [json.loads(line) for line in fh]
    assert [c for c in calls if c[0] != "metrics"] == [
        ["start", None, None], ["hparams", 2, "tracked", None], ["finalize", "failed"],
        ["start", "recorded", 4], ["finalize", "success"],
    ]


def test_a_restarted_job_continues_its_runs_and_a_sigterm_marks_them_killed(tmp_path, packages):
    out = str(tmp_path)
    job = {"TORCHELASTIC_RUN_ID": "trackers-job"}
    with pytest.raises(Exception):  # rank 0 dies of its SIGTERM after step 6; rank 1 fails in the next step
        run_ranks(_attempt, 2, out, 6, env=_env(out, TORCHELASTIC_RESTART_COUNT="0", **job), timeout=120)
    assert [r["status"] for r in _mlflow_runs(f"file:{out}/mlruns")] == ["KILLED"]

    # The launcher's restart of the same job: the newest checkpoint (step 4) names this job, so it is resumed.
    results = run_ranks(_attempt, 2, out, None, env=_env(out, TORCHELASTIC_RESTART_COUNT="1", **job), timeout=120)
    assert results[0][0].endswith("ckpt-e0000-s000000004.pt") and results[0][1] == 16
    (run,) = _mlflow_runs(f"file:{out}/mlruns")
    assert run["status"] == "FINISHED" and run["steps"]["train/step_loss"] == STEPS
    runs = _wandb_runs(tmp_path / "wandb")
    assert len({r["id"] for r in runs}) == 1 and [r["exit_code"] for r in runs] == [143, 0]
    # W&B offline cannot be read back, and this restart had no launcher's store (see the test below):
    # the steps the killed attempt logged after the checkpoint (step 5, and 4 if it was logged after
    # the save) come again in the second folder; W&B keeps the first values when the two are synced.
    assert runs[0]["steps"]["train/step_loss"] == STEPS[:5]
    again = runs[1]["steps"]["train/step_loss"]
    assert again[0] in (4, 5) and again == STEPS[again[0] - 1:]


def _run_job(out, *launcher_args, timeout=150, **env_vars) -> str:
    env = dict(os.environ, OUT=str(out), CUDA_VISIBLE_DEVICES="", **_env(str(out)), **env_vars)
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", *launcher_args, SCRIPT]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(out), env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job did not end in {timeout} s:\n{(exc.stderr or b'')[-6000:]!r}")
    assert done.returncode == 0, done.stderr[-6000:] + done.stdout[-2000:]
    return done.stdout + done.stderr


def test_in_place_recovery_of_a_killed_rank_0_continues_the_same_runs(tmp_path, packages):
    log = _run_job(tmp_path, "--recovery", "in-place", "--max-restarts", "1", FAIL="kill:7",
                   MLFLOW=f"file:{tmp_path}/mlruns")
    assert "recovered in place" in log, log[-4000:]
    assert os.path.exists(tmp_path / "start-rank0-attempt0-gen1")  # the replacement ran the script from the top
    (run,) = _mlflow_runs(f"file:{tmp_path}/mlruns")  # the replacement re-opened the run, not a second one
    assert run["status"] == "FINISHED"
    assert run["steps"]["train/step_loss"] == STEPS and run["steps"]["dev/loss"] == [8, 16]
    runs = _wandb_runs(tmp_path / "wandb")
    assert len(runs) == 2 and len({r["id"] for r in runs}) == 1 and runs[-1]["exit_code"] == 0
    # What the killed process had not written yet is lost (W&B flushes every 15 s); nothing comes twice.
    steps = [s for r in runs for s in r["steps"].get("train/step_loss", [])]
    assert steps == sorted(set(steps)) and steps[-1] == 16 and 7 in steps
    assert runs[-1]["config"]["world_size"] == 2  # sent again by the replacement
    assert _csv_steps(tmp_path / "metrics.csv") == STEPS


def test_a_restart_under_dptrain_run_continues_the_same_runs_through_the_launchers_store(tmp_path, packages):
    # Every rank of the first attempt raises after step 6; the checkpoint is at step 4, so step 5 is
    # logged by both attempts: the launcher's store, which outlives attempts, says it is held already.
    log = _run_job(tmp_path, "--max-restarts", "1", FAIL="raise:6", EPOCHS="1", MLFLOW=f"file:{tmp_path}/mlruns")
    assert "restarting all ranks" in log, log[-4000:]
    (run,) = _mlflow_runs(f"file:{tmp_path}/mlruns")
    assert run["status"] == "FINISHED" and run["steps"]["train/step_loss"] == STEPS[:8]
    runs = _wandb_runs(tmp_path / "wandb")
    assert len({r["id"] for r in runs}) == 1 and [r["exit_code"] for r in runs] == [1, 0]
    assert runs[0]["steps"]["train/step_loss"] == [1, 2, 3, 4, 5]
    assert runs[1]["steps"]["train/step_loss"] == [6, 7, 8]


# ------------------------------------------------------------ settings and imports --


def test_config_names_trackers_and_refuses_what_cannot_work(tmp_path):
    cfg = TrainerConfig(loggers="csv", log_dir=str(tmp_path / "tb"), run_name="r", project="p")
    assert cfg.to_dict()["loggers"] == "csv"
    chosen = make_trackers(cfg.loggers, log_dir=cfg.log_dir)
    assert [t.name for t in chosen] == ["csv", "tensorboard"]
    assert chosen[0].path == os.path.join(str(tmp_path / "tb"), "metrics.csv")
    with pytest.raises(ValueError, match=r"'neptune'.*not one of \['tensorboard', 'csv', 'wandb', 'mlflow'\]"):
        TrainerConfig(loggers=["neptune"])
    with pytest.raises(ValueError, match=r"needs a directory.*log_dir="):
        TrainerConfig(loggers=["tensorboard"])
    with pytest.raises(ValueError, match=r"names \['csv'\] twice"):
        TrainerConfig(loggers=["csv", CSVTracker(str(tmp_path / "x.csv"))])
    with pytest.raises(ValueError, match=r"project=3"):
        TrainerConfig(project=3)
    with pytest.raises(ValueError, match="must be a name, a list"):
        TrainerConfig(loggers=42)


def test_other_ranks_hold_no_tracker_and_a_custom_tracker_gets_values_by_step(tmp_path):
    seen = []

    class Seen(Tracker):
        name = "seen"

        def log_metrics(self, metrics, step, epoch=None):
            seen.append((step, dict(metrics)))

    assert TrackerGroup([Seen()], active=False).trackers == []
    group = TrackerGroup([Seen()], active=True)
    group.start(resume_step=None)
    group.log_metrics({"train/loss": 0.5, "flag": True, "text": "x"}, step=3)
    group.log_metrics({"train/loss": 0.4}, step=3)  # the same step again: already held
    group.finalize("success")
    assert seen == [(3, {"train/loss": 0.5})]
    assert group.state_dict() == {"seen": {"run_id": None, "steps": {"train/loss": 3}}}


def test_file_trackers_drop_what_came_after_the_step_a_run_continues_from(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dptrain.train.trackers import TensorBoardTracker

    def attempt(resume_step, steps):
        group = TrackerGroup([CSVTracker(str(tmp_path / "m.csv")), TensorBoardTracker(str(tmp_path / "tb"))])
        group.start(resume_step)
        for step in steps:
            group.log_metrics({"train/loss": 1.0 / step}, step, epoch=1)
        group.log_metrics({"train/loss": 0.0}, steps[-1], epoch=1)  # a step done again in the same process
        group.finalize("success")

    attempt(None, [1, 2, 3, 4])  # a crashed attempt logged steps 3 and 4 after its checkpoint of step 2
    attempt(2, [3, 4, 5])
    assert _csv_steps(tmp_path / "m.csv", "loss") == [1, 2, 3, 4, 5]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]  # step 2 itself stays


def test_a_metrics_file_that_is_a_fifo_is_refused_at_once_instead_of_holding_rank_0(tmp_path):
    from dptrain.runtime.settings import NotRegularFile

    path = tmp_path / "metrics.csv"
    os.mkfifo(path)
    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dptrain.prepare_dataloader(data, 4),
                              torch.nn.MSELoss(), dptrain.TrainerConfig(metrics_path=str(path), verbose=False))
    done = []
    worker = threading.Thread(target=lambda: done.append(pytest.raises(NotRegularFile, trainer.fit, max_epochs=1)),
                              daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # today's failure: open() waits for a reader; let it go, then fail
        with open(path):
            pass
        pytest.fail("rank 0 waited in open() on the FIFO")
    assert done and "is a FIFO (named pipe), not a regular file" in str(done[0].value)
