"""The Trainer for models trained the way they are now: a loss the model computes, batches of any shape,
a training/evaluation step of one's own, step budgets (``fit(max_steps=...)``), evaluation every k steps,
and warmup + cosine decay over the steps -- each resuming bit for bit."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import nn

import dptrain
from dptrain.data import prepare_dataloader
from dptrain.train import Trainer, TrainerConfig
from dptrain.train.schedule import WarmupDecay
from tests._dist import run_ranks


# ------------------------------------------------------------------------- helpers -----


@dataclasses.dataclass
class Output:
    """What a Hugging Face model returns: the loss as an attribute, beside the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TokenModel(nn.Module):
    """A model that takes a mapping batch ``{"input_ids", "labels"}`` and computes its own loss."""

    def __init__(self, vocab: int = 11, width: int = 8, as_dict: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(0.2)  # resumes must restore the RNG streams
        self.head = nn.Linear(width, vocab)
        self.as_dict = as_dict

    def forward(self, input_ids, labels=None):
        logits = self.head(self.drop(self.emb(input_ids)))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return {"loss": loss, "logits": logits} if self.as_dict else Output(loss, logits)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, length: int = 5, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 11, (n, length + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def _token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _token_trainer(cdir=None, resume=False, dev=True, as_dict=False, **kw) -> Trainer:
    dptrain.seed_everything(0)
    model = TokenModel(as_dict=as_dict)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    cfg = dict(checkpoint_dir=cdir, keep_last=0, verbose=False)
    cfg.update(kw.pop("cfg", {}))
    return Trainer(
        model, opt, prepare_dataloader(TokenData(), 4, seed=1), config=TrainerConfig(**cfg),
        dev_data=prepare_dataloader(TokenData(20, seed=5), 6, mode="eval") if dev else None, resume=resume, **kw,
    )


# ----------------------------------------------------------- a loss the model computes ---


@pytest.mark.parametrize("as_dict", [False, True], ids=["attribute", "mapping"])
def test_the_models_own_loss_trains_as_a_loss_fn_over_the_same_batches_would(as_dict):
    own = _token_trainer(as_dict=as_dict)
    own.fit(max_epochs=2)

    def split(batch):  # the same step through a loss_fn: (inputs, targets)
        return {"input_ids": batch["input_ids"]}, batch["labels"]

    dptrain.seed_everything(0)
    model = TokenModel(as_dict=as_dict)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids):
            out = self.m(input_ids)
            return out["logits"] if as_dict else out.logits

    wrapped = Logits()
    data = [split(b) for b in TokenData()]
    pairs = [(d[0], d[1]) for d in data]

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(pairs)

        def __getitem__(self, i):
            return pairs[i]

    ref = Trainer(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.05), prepare_dataloader(Pairs(), 4, seed=1),
                  _token_loss, TrainerConfig(verbose=False))
    ref.fit(max_epochs=2)
    assert _same({f"m.{k}": v for k, v in _weights(own).items()}, _weights(ref))


def test_a_training_step_passed_or_overridden_replaces_the_default_and_sees_the_wrapped_model():
    seen = []

    def step(model, batch):
        seen.append(type(model).__name__)
        return model(**batch).loss

    passed = _token_trainer(training_step=step, dev=False)
    passed.fit(max_epochs=1)

    class Mine(Trainer):
        def training_step(self, model, batch):
            return model(batch["input_ids"], labels=batch["labels"])  # an output with .loss

    dptrain.seed_everything(0)
    model = TokenModel()
    sub = Mine(model, torch.optim.AdamW(model.parameters(), lr=0.05), prepare_dataloader(TokenData(), 4, seed=1),
               config=TrainerConfig(verbose=False))
    sub.fit(max_epochs=1)
    default = _token_trainer(dev=False)
    default.fit(max_epochs=1)
    assert len(seen) == 12 and _same(_weights(passed), _weights(default)) and _same(_weights(sub), _weights(default))


def test_a_model_that_returns_no_loss_is_refused_with_the_ways_to_give_one():
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), prepare_dataloader(data, 4),
                      config=TrainerConfig(verbose=False))
    with pytest.raises(ValueError, match=r"passes each batch to the model whole \(model\(\*batch\).*loss_fn=nn"):
        trainer.fit(max_epochs=1)
    only_x = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     prepare_dataloader(torch.utils.data.TensorDataset(torch.randn(8, 4)), 4),
                     config=TrainerConfig(verbose=False))
    with pytest.raises(ValueError, match=r"training_step returned Tensor of shape \(4, 2\), which holds no loss.*loss_fn"):
        only_x.fit(max_epochs=1)
    with pytest.raises(ValueError, match="metric_fn.*needs the Trainer.s own evaluation.*evaluation_step"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), prepare_dataloader(data, 4),
                metric_fn=lambda o, t: 0.0)


def test_evaluation_of_a_model_computed_loss_averages_over_every_sample_and_takes_an_evaluation_step():
    trainer = _token_trainer()
    metrics = trainer.evaluate()
    model = trainer.strategy.eval_module(trainer.model).eval()
    dev = TokenData(20, seed=5)
    with torch.no_grad():
        whole = model(dev.ids[:, :-1], labels=dev.ids[:, 1:]).loss
    assert metrics["loss"] == pytest.approx(float(whole), rel=1e-5)

    def step(model, batch):
        out = model(**batch)
        return {"loss": out.loss, "token_acc": (out.logits.argmax(-1) == batch["labels"]).float().mean()}

    trainer = _token_trainer(evaluation_step=step, cfg=dict(best_metric="token_acc", best_mode="max"))
    summary = trainer.fit(max_epochs=1)
    assert set(summary["history"][0]) >= {"dev_loss", "dev_token_acc"} and summary["best"]["metric"] == "token_acc"


def _ranks_model_loss(rank: int):
    trainer = _token_trainer()
    trainer.fit(max_epochs=1)
    return trainer.evaluate()["loss"], _weights(trainer)


def test_two_ranks_evaluate_the_model_computed_loss_over_the_whole_dev_set():
    (l0, w0), (l1, w1) = run_ranks(_ranks_model_loss, 2, timeout=60)
    assert l0 == l1 and _same(w0, w1)
    one = _token_trainer()
    # The dev loss of the trained 2-rank model, computed on one process over the whole set.
    one.strategy.load_model_state_dict(one.model, w0, source="test")
    assert one.evaluate()["loss"] == pytest.approx(l0, rel=1e-5)


# ------------------------------------------------------------------ the step budget ---


def test_fit_max_steps_stops_inside_an_epoch_and_a_larger_budget_resumes_bit_for_bit(tmp_path):
    whole = _token_trainer(cfg=dict(eval_every_steps=5))
    summary = whole.fit(max_steps=20)  # 12 batches an epoch: stops in the second epoch
    assert summary["global_step"] == 20 and whole.epoch == 1 and whole.batch_in_epoch == 8

    first = _token_trainer(str(tmp_path), cfg=dict(eval_every_steps=5))
    assert first.fit(max_steps=7)["global_step"] == 7
    names = sorted(os.listdir(tmp_path))
    assert names == ["best.pt", "ckpt-e0000-s000000007.pt"]  # written where the budget ended, inside epoch 1
    second = _token_trainer(str(tmp_path), resume="auto", cfg=dict(eval_every_steps=5))
    assert second.global_step == 7
    assert second.fit(max_steps=20)["global_step"] == 20
    assert _same(_weights(second), _weights(whole))


def test_evaluations_every_k_steps_leave_the_training_bit_for_bit_as_it_was():
    plain = _token_trainer(dev=False)
    plain.fit(max_steps=15)
    seen = []

    class Record(dptrain.train.Callback):
        def on_evaluate(self, trainer, split, metrics):
            seen.append((trainer.global_step, split))

    evaluated = _token_trainer(cfg=dict(eval_every_steps=4), callbacks=[Record()])
    summary = evaluated.fit(max_steps=15)
    assert seen == [(4, "dev"), (8, "dev"), (12, "dev"), (15, "dev")]
    assert summary["best"] is not None and _same(_weights(plain), _weights(evaluated))


def test_fit_needs_a_budget_and_takes_it_from_the_config():
    trainer = _token_trainer(dev=False)
    with pytest.raises(ValueError, match=r"fit\(\) needs a budget"):
        trainer.fit()
    with pytest.raises(ValueError, match=r"fit\(max_steps=0\) needs an integer >= 1"):
        trainer.fit(max_steps=0)
    assert _token_trainer(dev=False, cfg=dict(max_steps=3)).fit()["global_step"] == 3
    both = _token_trainer(dev=False, cfg=dict(max_steps=100, max_epochs=1))
    assert both.fit()["global_step"] == 12  # whichever ends first


# ------------------------------------------------------------ warmup + cosine decay ---


def test_warmup_cosine_over_max_steps_and_a_resume_into_a_longer_run_continues_the_new_plan(tmp_path, capsys):
    cfg = dict(max_steps=10, lr_schedule="cosine", warmup_steps=3, min_lr_ratio=0.1, log_every_steps=1)
    lrs = []

    class Lr(dptrain.train.Callback):
        def on_step_end(self, trainer, info):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])

    trainer = _token_trainer(str(tmp_path), dev=False, cfg=cfg, callbacks=[Lr()])
    assert trainer.config.scheduler_interval == "step"
    trainer.fit()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    ref = WarmupDecay(opt, total_steps=10, warmup_steps=3, min_lr_ratio=0.1)
    expected = []
    for _ in range(10):
        opt.step()
        ref.step()
        expected.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected) and lrs[-1] == pytest.approx(0.005)

    longer = _token_trainer(str(tmp_path), resume="auto", dev=False, cfg=dict(cfg, max_steps=20), callbacks=[Lr()])
    assert "WarmupDecay re-planned" in capsys.readouterr().err
    lrs.clear()
    longer.fit()
    fresh = WarmupDecay(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05), total_steps=20, warmup_steps=3,
                        min_lr_ratio=0.1)
    assert lrs[0] == pytest.approx(0.05 * fresh.factor(11)) and lrs[-1] == pytest.approx(0.005)


def test_lr_schedule_settings_are_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"lr_schedule='cosine'.*max_steps, which is None"):
        TrainerConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match=r"lr_schedule='cos'.*must be one of"):
        TrainerConfig(lr_schedule="cos", max_steps=5)
    with pytest.raises(ValueError, match=r"warmup_steps=9.*longer than max_steps=5"):
        TrainerConfig(lr_schedule="linear", max_steps=5, warmup_steps=9)
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="builds the learning-rate schedule, and a scheduler was passed"):
        Trainer(model, opt, prepare_dataloader(TokenData(), 4), config=TrainerConfig(lr_schedule="cosine", max_steps=4),
                scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def test_an_iterable_without_a_length_never_steps_on_an_unfinished_accumulation_group():
    class Batches:  # no __len__, no is_last: which batch ends the epoch is known only after it
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            return iter([(torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(10)])

    model = nn.Linear(3, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), Batches(), nn.CrossEntropyLoss(),
                      TrainerConfig(gradient_accumulation_steps=4, verbose=False))
    with pytest.warns(UserWarning, match=r"last 2 micro-batch\(es\) of epoch 1 did not fill an accumulation group of 4"):
        assert trainer.fit(max_epochs=1)["global_step"] == 2
    assert all(p.grad is None for p in model.parameters())  # nothing left over for the next epoch
