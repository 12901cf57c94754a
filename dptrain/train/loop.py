"""In-place recovery for a plain training loop: the few lines that make one recoverable.

[Note: a plain loop, recovered in place]
The Trainer recovers in place because it owns the loop (see [Note: in-place recovery] in
:mod:`dptrain.train.recovery`). A script with its own loop hands the same four things to
:class:`RecoverableLoop` -- which epoch, which batch, where a step starts and where it ends --
by iterating ``epochs()`` and ``batches()`` and wrapping each optimizer step in ``step()``:
the end of a ``step()`` block is a commit; a peer's failure inside one is recovered there (the
block's exception is swallowed) and ``batches()`` then yields again from the commit, so the
interrupted step is done again with the same batch. The per-rank snapshot of the coming
commit is written after each training forward of the DDP model (a forward hook), before its
backward sends anything. A replacement process runs the script from its start: its DDP is
built without collectives (it is a replacement, see ``dptrain.parallel.ddp._recovery``) and
constructing the ``RecoverableLoop`` receives the state from a live rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from dptrain.runtime import interrupt as _interrupt
from dptrain.runtime.env import get_world
from dptrain.train import _parts
from dptrain.train.checkpointer import Checkpointer
from dptrain.train.config import TrainerConfig
from dptrain.train.recovery import InPlaceRecovery, is_replacement
from dptrain.train.state import TrainState
from dptrain.train.strategy import make_strategy

__all__ = ["RecoverableLoop"]


class RecoverableLoop:
    """A plain training loop that ``dptrain run --recovery in-place`` can keep going when a rank dies.

    Iterate ``epochs()`` and ``batches()`` instead of ``range`` and the loader, and wrap each
    optimizer step (forward, backward, ``optimizer.step()``) in ``with loop.step():``. When a
    rank dies or stalls, the other ranks' ``step()`` blocks end without an exception, the
    process group is re-formed, a replacement joins with the model, optimizer, scheduler, loader
    position and its rank's RNG streams taken from a live rank, and ``batches()`` continues from
    the last completed step: the run ends bit for bit where an uninterrupted one ends (on CPU,
    with ``num_workers=0``). Without ``--recovery in-place`` (any launcher, or one process) it is
    a thin wrapper: ``epochs(n)`` counts, ``batches()`` sets the sampler's epoch and yields.

    Args:
        model: a :class:`dptrain.DistributedDataParallel` (in-place recovery needs dptrain's DDP;
            any module works without it).
        optimizer: the optimizer on ``model``'s parameters.
        loader: the training loader, ideally from :func:`dptrain.prepare_dataloader` (its position
            is what a replacement continues from).
        scheduler: an LR scheduler you step yourself, or None (default); its state travels too.

    Only failures inside ``step()`` are recovered; a collective of your own outside it (an
    evaluation) that fails ends the rank as usual, and the launcher then restarts the job.

    Example:
        >>> loop = dptrain.RecoverableLoop(model, optimizer, loader)
        >>> for epoch in loop.epochs(10):
        ...     for inputs, targets in loop.batches():
        ...         with loop.step():
        ...             loss = loss_fn(model(inputs), targets)
        ...             loss.backward()
        ...             optimizer.step()
        ...             optimizer.zero_grad()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                 scheduler: Any = None) -> None:
        # What InPlaceRecovery reads of its host (the Trainer's names, for the same parts).
        self.world = get_world()
        self.rank = self.world.rank
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        config = TrainerConfig(verbose=False)
        self.strategy = make_strategy("ddp" if self.world.world_size > 1 else "none", self.world.world_size,
                                      self.device, config)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, None
        self.loader = loader
        self.state = TrainState(self.device)
        self.best_state = None
        self.checkpointer = Checkpointer(None, 0, self.rank, self.world.world_size)
        self._parts = _parts.StatefulParts(
            strategy=self.strategy, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
            progress=self.state, train_loader=loader, callbacks=[], checkpointer=self.checkpointer, config=config,
            world=self.world,
        )  # fmt: skip
        self._recovery = InPlaceRecovery(self)
        self._rewind = False
        if self._recovery.active:
            # The snapshot of the coming commit, once the forward has drawn its random numbers.
            model.register_forward_hook(self._after_forward)
            # A peer's death may stop a step's forward or backward, never what follows the optimizer's
            # step inside the block (a forward there would find the step applied but not committed).
            optimizer.register_step_pre_hook(lambda *_: _interrupt.disarm())
            if is_replacement():
                self._recovery.join()

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._recovery.prepare_step([])

    @property
    def epoch(self) -> int:
        """The epoch in progress, counted from 0."""
        return self.state.epoch

    @property
    def global_step(self) -> int:
        """Steps completed so far (``step()`` blocks that ended without an exception)."""
        return self.state.global_step

    def epochs(self, max_epochs: int) -> Iterator[int]:
        """Yield the epochs still to run, up to ``max_epochs`` (a replacement starts where the job is)."""
        self._recovery.announce()
        while self.state.epoch < max_epochs:
            yield self.state.epoch
            self.state.finish_epoch({"epoch": self.state.epoch + 1})
            self._recovery.prepare_epoch_end()
            self._recovery.commit(0, prepared=True)

    def batches(self) -> Iterator[Any]:
        """Yield this epoch's batches from the last completed step on (again from there after a recovery)."""
        while True:
            it, _ = self.state.begin_epoch(self.loader)
            self._rewind = False
            for batch in it:
                yield batch
                if self._rewind:
                    break
            else:
                return

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step; a peer's failure inside is recovered and the step is done again."""
        _interrupt.arm()  # until the optimizer's step begins (see __init__): a peer's death stops the step at once
        try:
            yield
        except Exception as exc:
            _interrupt.disarm()
            if not self._recovery.can_recover(exc):
                raise
            self._recovery.recover(exc)
            self._rewind = True  # batches() yields again from the step the job is at
            return
        _interrupt.disarm()
        self.state.global_step += 1
        self._recovery.commit(self.state.batch_in_epoch + 1, prepared=True)
