"""Resuming an LR schedule into a run of a different length.

[Note: the rule for resuming with a different number of epochs]
``fit(max_epochs)`` always counts epochs from the start of the run, so resuming a
checkpoint of epoch 1 with ``fit(2)`` trains one more epoch, and with ``fit(1)`` trains
none. Most schedules do not care how long the run is (StepLR, ExponentialLR,
ReduceLROnPlateau, ...): their saved state is restored as it is, and the resumed run
continues bit for bit. Some are planned for a fixed length -- OneCycleLR's
``total_steps``, CosineAnnealingLR's ``T_max``, LinearLR/PolynomialLR/ConstantLR's
``total_iters``, MultiStepLR's ``milestones`` -- and a script that resumes into a longer
run builds them for the new length. Loading the old state over such a scheduler would bring
back the old plan (and OneCycleLR then fails one step past its old end). So when the plan
of the freshly built scheduler differs from the saved one, the new plan is kept and the
scheduler is fast-forwarded instead: the learning rates go back to what the fresh scheduler
set, and ``step()`` is called as many times as the saved scheduler had been stepped. The
learning rate then follows the new schedule from the point the old run had reached.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from dptrain.runtime.env import _warn_once_main

__all__ = ["restore_scheduler", "WarmupDecay"]

# State-dict entries of torch's schedulers that fix the length of the plan.
_PLAN_KEYS = ("total_steps", "T_max", "total_iters", "milestones", "epochs", "steps_per_epoch")


def _plan(state: Any) -> Any:
    if not isinstance(state, dict):
        return None
    plan = {k: state[k] for k in _PLAN_KEYS if k in state}
    nested = state.get("_schedulers")
    if isinstance(nested, (list, tuple)):  # SequentialLR, ChainedScheduler
        plan["_schedulers"] = [_plan(s) for s in nested]
    return plan


def restore_scheduler(scheduler: Any, saved: dict, optimizer: torch.optim.Optimizer, lrs_before_load: list[float],
                      steps: int | None = None) -> str | None:
    """Bring ``scheduler`` to the saved position; returns a note when it was fast-forwarded.

    Call it after the optimizer's state was loaded. ``lrs_before_load`` are the
    learning rates the freshly built scheduler had set, read before the optimizer's state
    (which carries the old run's rates) was loaded. ``steps``: how many times to step a
    re-planned scheduler; default the saved count. (On another number of ranks an epoch
    has another number of steps, so the Trainer passes the position of this run instead.)
    """
    fresh_plan = _plan(scheduler.state_dict())
    saved_plan = _plan(saved)
    if fresh_plan == saved_plan or not hasattr(scheduler, "step"):
        scheduler.load_state_dict(saved)
        return None
    steps = int(saved.get("last_epoch", 0)) if steps is None else steps
    for group, lr in zip(optimizer.param_groups, lrs_before_load):
        group["lr"] = lr
    try:
        with warnings.catch_warnings():
            # "lr_scheduler.step() before optimizer.step()": expected while replaying.
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                scheduler.step()
    except ValueError as exc:
        # The new plan is shorter than the part already run (e.g. OneCycleLR past its end):
        # continue on the old plan rather than fail.
        scheduler.load_state_dict(saved)
        _warn_once_main(
            f"the LR scheduler was built for a shorter run ({fresh_plan}) than the checkpoint had already gone "
            f"({steps} scheduler steps, plan {saved_plan}): {exc}; keeping the checkpoint's schedule"
        )
        return None
    changed = ", ".join(f"{k} {saved_plan.get(k)} -> {v}" for k, v in fresh_plan.items() if saved_plan.get(k) != v)
    return (
        f"{type(scheduler).__name__} re-planned for this run ({changed}) and fast-forwarded {steps} steps "
        f"to where the checkpoint left it"
    )


class WarmupDecay(torch.optim.lr_scheduler.LRScheduler):
    """Linear warmup, then a decay over the optimizer steps: what language models are trained with.

    The learning rate of each group at step ``s`` (``s`` = optimizer steps taken) is its initial
    rate times::

        s / warmup_steps                                  while s < warmup_steps
        min_lr_ratio + (1 - min_lr_ratio) * f(p)          after, p = (s - warmup) / (total - warmup)

    with ``f(p) = (1 + cos(pi * p)) / 2`` for ``"cosine"``, ``1 - p`` for ``"linear"`` and ``1`` for
    ``"constant"``; past ``total_steps`` the rate stays at its final value. Step it after every
    optimizer step (``TrainerConfig(scheduler_interval="step")``, which ``lr_schedule=...`` sets).

    Resuming into a longer (or shorter) run: ``total_steps`` is part of the scheduler's plan, so a
    run resumed with another ``max_steps`` keeps the new plan and continues it from the step the
    checkpoint reached (see [Note: the rule for resuming with a different number of epochs]
    above): the warmup is not repeated, and the decay from there on follows the new length.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is scheduled (their current ``lr`` is the peak).
        total_steps: the step at which the decay ends (the run's ``max_steps``), >= 1.
        warmup_steps: steps of linear warmup from 0. Default 0.
        kind: ``"cosine"`` (default), ``"linear"`` or ``"constant"``.
        min_lr_ratio: the final rate as a fraction of the peak, in [0, 1]. Default 0.

    Raises:
        ValueError: a setting out of range, with the value.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> sched = WarmupDecay(opt, total_steps=2000, warmup_steps=100, min_lr_ratio=0.1)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, kind: str = "cosine",
                 min_lr_ratio: float = 0.0) -> None:
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"WarmupDecay(total_steps={total_steps!r}) must be an integer >= 1")
        if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"WarmupDecay(warmup_steps={warmup_steps!r}) must be an integer in [0, total_steps={total_steps}]")
        if kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"WarmupDecay(kind={kind!r}) must be 'cosine', 'linear' or 'constant'")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"WarmupDecay(min_lr_ratio={min_lr_ratio!r}) must be between 0 and 1")
        self.total_steps, self.warmup_steps, self.kind, self.min_lr_ratio = total_steps, warmup_steps, kind, min_lr_ratio
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        """The multiplier of the peak learning rate after ``step`` optimizer steps."""
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.kind == "constant" or self.total_steps == self.warmup_steps:
            return 1.0 if self.kind == "constant" else self.min_lr_ratio
        p = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = (1.0 + math.cos(math.pi * p)) / 2.0 if self.kind == "cosine" else 1.0 - p
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]
