"""Callbacks: add behaviour to the Trainer's loop without forking it.

A callback is an object with any of the methods of :class:`Callback`; the Trainer calls
them on every rank, in the order the callbacks were given, at fixed points of ``fit``.
A callback that keeps state across a resume implements ``state_dict``/``load_state_dict``
(it is saved in every checkpoint under its class name). Stopping the run is asked with
``trainer.request_stop(reason)``: the loop ends after the current step, writes its
checkpoint as usual, and ``fit`` returns with ``summary["stopped"] = reason``.

Two behaviours of the Trainer are themselves callbacks, built from the config:
:class:`NonFiniteGuard` (``TrainerConfig(nan_policy=...)``) and :class:`EarlyStopping`
(``TrainerConfig(early_stopping_patience=...)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["Callback", "StepInfo", "NonFiniteGuard", "NonFiniteError", "EarlyStopping"]


@dataclasses.dataclass
class StepInfo:
    """One optimizer step, as the callbacks see it.

    Attributes:
        step: the optimizer step this is (``global_step + 1`` before it is taken).
        epoch: the epoch, counted from 1 (as in the printed lines). ``batch``: batches of the epoch done, ``num_batches``: of how many (None for a stream without a length).
        losses: every rank's loss of this step (sum over its micro-batches), in rank order.
        grad_norms: every rank's global gradient norm (equal on every rank under DDP/FSDP),
            or None when not computed (``nan_policy="off"`` without clipping).
        skip: set it to True in ``on_before_optimizer_step`` to drop this step on every rank
            (set it identically on every rank: decide from the values above, which every
            rank sees alike).
    """

    step: int
    epoch: int
    batch: int
    num_batches: int | None
    losses: list[float]
    grad_norms: list[float] | None
    skip: bool = False

    @property
    def finite(self) -> bool:
        values = self.losses + (self.grad_norms or [])
        return all(math.isfinite(v) for v in values)

    def bad_ranks(self) -> list[int]:
        """Ranks where a non-finite value first appeared: a non-finite loss, else a non-finite norm.

        (Under DDP one rank's NaN loss makes every rank's averaged gradient NaN: the loss
        names the origin.)
        """
        bad_loss = [r for r, v in enumerate(self.losses) if not math.isfinite(v)]
        if bad_loss:
            return bad_loss
        return [r for r, v in enumerate(self.grad_norms or []) if not math.isfinite(v)]

    def describe(self) -> str:
        """E.g. ``non-finite loss at step 21 (epoch 2, batch 5 of 16) on rank(s) [1] (rank 1: loss nan)``."""
        bad_loss = [r for r, v in enumerate(self.losses) if not math.isfinite(v)]
        bad_norm = [r for r, v in enumerate(self.grad_norms or []) if not math.isfinite(v)]
        of = f" of {self.num_batches}" if self.num_batches is not None else ""  # a stream has no length
        where = f"at step {self.step} (epoch {self.epoch}, batch {self.batch}{of})"
        if bad_loss:
            values = ", ".join(f"rank {r}: loss {self.losses[r]:.4g}" for r in bad_loss)
            text = f"non-finite loss {where} on rank(s) {bad_loss} ({values})"
            if bad_norm:
                norms = sorted({f"{self.grad_norms[r]:.4g}" for r in bad_norm})
                text += f"; gradient norm {'/'.join(norms)} on rank(s) {bad_norm}"
            return text
        values = ", ".join(f"rank {r}: {self.grad_norms[r]:.4g}" for r in bad_norm)
        return f"non-finite gradient norm {where} on rank(s) {bad_norm} ({values}; the losses were finite)"


class Callback:
    """Base class; override what you need. Every method is called on every rank.

    Example:
        >>> class PrintLR(dptrain.train.Callback):
        ...     def on_epoch_end(self, trainer, record):
        ...         if trainer.rank == 0:
        ...             print("lr", record["lr"])
        >>> Trainer(..., callbacks=[PrintLR()])
    """

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first epoch of ``fit`` (after a resume was loaded)."""

    def on_before_optimizer_step(self, trainer: Any, step: StepInfo) -> None:
        """Gradients are reduced (and clipped); set ``step.skip`` to drop the step."""

    def on_step_end(self, trainer: Any, step: StepInfo) -> None:
        """After the optimizer step (or after a skipped one: ``step.skip`` is True)."""

    def on_evaluate(self, trainer: Any, split: str, metrics: dict[str, float]) -> None:
        """After ``evaluate`` on ``split`` (``"dev"`` or ``"test"``)."""

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        """After an epoch's evaluation and scheduler step, before its checkpoint."""

    def on_checkpoint(self, trainer: Any, path: str) -> None:
        """After a checkpoint was written (on every rank)."""

    def on_exception(self, trainer: Any, exc: BaseException) -> None:
        """``fit`` is about to re-raise ``exc``."""

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        """``fit`` finished; ``summary`` is what it returns."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class NonFiniteError(RuntimeError):
    """A loss or gradient norm was NaN or infinite; raised identically on every rank."""

    _dptrain_every_rank = True  # rank 0 alone prints it (dptrain.train.report)


class NonFiniteGuard(Callback):
    """``TrainerConfig(nan_policy=...)``: stop, or skip, a step whose loss or gradient norm is not finite.

    Every rank sees every rank's values (one small gather per step), so all ranks take the
    same decision in the same step. The check runs before the optimizer step: the weights,
    and every checkpoint, stay finite.

    Args:
        policy: ``"stop"`` (raise :class:`NonFiniteError`) or ``"skip"`` (drop the step).
        max_consecutive_skips: with ``"skip"``, raise after this many skipped steps in a row.
    """

    def __init__(self, policy: str = "stop", max_consecutive_skips: int = 20) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"NonFiniteGuard(policy={policy!r}) must be 'stop' or 'skip'")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0

    def on_before_optimizer_step(self, trainer: Any, step: StepInfo) -> None:
        if step.finite:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.policy == "skip" and self.consecutive <= self.max_consecutive_skips:
            step.skip = True
            if trainer.rank == 0:
                trainer.log.line(f"skipping step {step.step}: {step.describe()}")
            return
        newest = trainer.checkpointer.newest()
        why = f" ({self.consecutive} steps in a row)" if self.policy == "skip" else ""
        if getattr(trainer.strategy, "steps_in_backward", False):
            # overlap_optimizer stepped each bucket during backward: the weights in memory took
            # this update already; what is on disk was written before and is finite.
            kept = (f"the newest checkpoint {newest!r} is finite (written before this step)" if newest else
                    "no checkpoint was written")
            stopping = f"stopping; overlap_optimizer applied this step's update during backward, {kept}"
        else:
            kept = f"the weights and the newest checkpoint {newest!r} are" if newest else "the weights are"
            stopping = f"stopping before the optimizer step, so {kept} still finite"
        raise NonFiniteError(
            f"rank {trainer.rank}: {step.describe()}{why}; {stopping}. Lower the learning rate, clip gradients "
            f"(TrainerConfig(max_grad_norm=...)), check the data of those ranks, or pass "
            f"TrainerConfig(nan_policy='skip') to drop such steps"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))


class EarlyStopping(Callback):
    """Stop when a dev metric has not improved for ``patience`` evaluations.

    Args:
        metric: the dev metric (``"loss"`` or a key of ``metric_fn``'s dict). Default ``"loss"``.
        patience: evaluations without improvement before stopping. Default 3.
        min_delta: an improvement must exceed this. Default 0.0.
        mode: ``"min"`` or ``"max"``. Default ``"min"``.

    A non-finite value never counts as an improvement.

    Example:
        >>> Trainer(..., callbacks=[EarlyStopping("accuracy", patience=5, mode="max")])
    """

    def __init__(self, metric: str = "loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}) must be 'min' or 'max'")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}) must be an integer >= 1")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}) must be >= 0")
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, float(min_delta), mode
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0

    def on_evaluate(self, trainer: Any, split: str, metrics: dict[str, float]) -> None:
        if split != "dev":
            return
        if self.metric not in metrics:
            raise ValueError(
                f"EarlyStopping(metric={self.metric!r}) is not among the dev metrics {sorted(metrics)}; "
                f"return it from metric_fn or choose one of those"
            )
        value = float(metrics[self.metric])
        sign = 1.0 if self.mode == "max" else -1.0
        improved = math.isfinite(value) and (self.best is None or sign * (value - self.best) > self.min_delta)
        if improved:
            self.best, self.best_epoch, self.wait = value, trainer.epoch + 1, 0  # epochs count from 1
            return
        self.wait += 1
        if self.wait >= self.patience:
            best = "none finite" if self.best is None else f"best {self.best:.4g} at epoch {self.best_epoch}"
            trainer.request_stop(
                f"early stopping: dev {self.metric} has not improved by more than {self.min_delta:g} for "
                f"{self.wait} evaluation(s) ({best})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.wait = state.get("best"), state.get("best_epoch"), int(state.get("wait", 0))


def gather_step_values(loss: torch.Tensor, grad_norm: torch.Tensor | None, device: torch.device,
                       flag: float = 0.0) -> tuple[list[float], list[float] | None, list[float]]:
    """Every rank's (loss, grad norm, flag) of this step, on every rank: one all-gather of three numbers.

    ``flag`` carries what a rank must tell the others at a step boundary (a preemption
    signal it received), so every rank acts on it in the same step.
    """
    from dptrain import comm

    norm = grad_norm.detach().to(device, torch.float64).reshape(()) if grad_norm is not None else None
    mine = torch.stack([
        loss.detach().to(device, torch.float64).reshape(()),
        norm if norm is not None else torch.zeros((), dtype=torch.float64, device=device),
        torch.tensor(float(flag), dtype=torch.float64, device=device),
    ])  # fmt: skip
    if comm.is_distributed():
        import torch.distributed as dist

        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        comm.all_gather(parts, mine)
    else:
        parts = [mine]
    values = torch.stack(parts).cpu().tolist()
    losses = [v[0] for v in values]
    norms = [v[1] for v in values] if grad_norm is not None else None
    return losses, norms, [v[2] for v in values]
