"""A Trainer job with W&B, MLflow and the metrics file, for tests/test_trainer_trackers.py.

Run under ``dptrain run`` (restarts, in-place recovery) or as a plain single process.

Environment:
  OUT     where the runs go: W&B's folder (WANDB_DIR), the metrics file, the checkpoints, markers
  MLFLOW  MLflow's tracking URI
  FAIL    "raise:S": every rank of the job's first attempt raises after optimizer step S;
          "kill:S": rank 0's first process SIGKILLs itself in the forward of step S;
          "term:S": the process (one, no launcher) sends itself SIGTERM after step S
  EPOCHS  epochs (default 2)
"""

import json
import os
import signal

import torch
from torch import nn

import dptrain
from dptrain import Trainer, TrainerConfig, prepare_dataloader
from dptrain.train import Callback

OUT = os.environ["OUT"]


class Fail(Callback):
    def __init__(self, how: str, at: int) -> None:
        self.how, self.at = how, at

    def on_step_end(self, trainer, info) -> None:
        if info.step != self.at:
            return
        if self.how == "raise":
            raise RuntimeError(f"a planned failure after step {info.step}")
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    world = dptrain.init()
    generation = int(os.environ.get("DPTRAIN_GENERATION") or 0)
    first = world.restart_count == 0 and generation == 0
    with open(os.path.join(OUT, f"start-rank{world.rank}-attempt{world.restart_count}-gen{generation}"), "w"):
        pass
    how, _, at = (os.environ.get("FAIL") or "none:0").partition(":")
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    config = TrainerConfig(
        checkpoint_dir=os.path.join(OUT, "ck"), save_every_steps=4, log_every_steps=1, verbose=False, progress=False,
        loggers=["wandb", "mlflow"], metrics_path=os.path.join(OUT, "metrics.csv"), project="trackers-test",
        run_name="job", tracking_uri=os.environ["MLFLOW"],
    )
    callbacks = [Fail(how, int(at))] if first and how in ("raise", "term") else []
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), prepare_dataloader(data, 4, seed=3),
                      nn.CrossEntropyLoss(), config, dev_data=prepare_dataloader(data, 16, mode="eval"),
                      callbacks=callbacks, hparams={"script": "train_trackers"})
    if how == "kill" and first and world.rank == 0:
        def pre(module, args):
            if module.training and trainer.global_step + 1 == int(at):
                os.kill(os.getpid(), signal.SIGKILL)
        trainer.model.module.register_forward_pre_hook(pre)
    summary = trainer.fit(int(os.environ.get("EPOCHS", "2")))
    with open(os.path.join(OUT, f"done-rank{world.rank}.json"), "w") as fh:
        json.dump({"step": summary["global_step"], "generation": generation}, fh)
    dptrain.shutdown()


if __name__ == "__main__":
    main()
