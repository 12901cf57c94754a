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

import warnings
from typing import Any

import torch

from dptrain.env import _warn_once_main

__all__ = ["restore_scheduler"]

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
