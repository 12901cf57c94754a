"""How the Trainer replicates a model: one object per strategy, asked instead of the model.

Every question whose answer depends on "is this DDP, FSDP, PyTorch's DDP or a plain
model?" is a method here -- wrapping, building the optimizer, gradient accumulation without
communication, the global gradient norm, the model's and the optimizer's state for a
checkpoint, the module to evaluate with and whether evaluation must run in lock-step -- so
the training loop never tests the model's type.

[Note: what each strategy checkpoints]
The model's weights are always stored full, with plain keys (they load into the bare model
on any number of ranks). The optimizer's state is stored whole by the replicated strategies
(every rank holds the same state; rank 0's copy is written) and per rank by the sharded
ones (FSDP: each rank's optimizer only knows its shard of each flat parameter): each rank
writes its own part, nobody ever holds another rank's shard, and resuming such a state
needs the same world size (the weights still load anywhere).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from dptrain import checkpoint as ckpt
from dptrain import comm
from dptrain.runtime.env import _warn_once_main

__all__ = ["Strategy", "make_strategy"]


class Strategy:
    """The plain strategy (``"none"``): one model, no communication. Base of the others.

    A strategy compares equal to its name, so ``trainer.strategy == "ddp"`` reads naturally.
    """

    name = "none"
    #: The optimizer state differs between ranks and is checkpointed per rank.
    shards_optimizer = False
    #: Evaluation forwards communicate, so every rank must run the same number of them.
    lockstep_eval = False

    def __init__(self, device: torch.device, config_kwargs: dict | None = None, overlap_optimizer: bool = False) -> None:
        self.device = device
        self.kwargs = dict(config_kwargs or {})
        #: The optimizer steps each bucket during backward (DDP's ``overlap_optimizer``): by the
        #: time the Trainer looks at the loss, the update has been applied.
        self.steps_in_backward = overlap_optimizer

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, Strategy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<dptrain strategy {self.name!r}>"

    # -- building ---------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The wrapped model and its optimizer (``optimizer``: an instance or a factory)."""
        wrapped = self.wrap(model, world_size)
        return wrapped, self.build_optimizer(optimizer, wrapped)

    def wrap(self, model: nn.Module, world_size: int) -> nn.Module:
        if world_size > 1:
            _warn_once_main(
                f"TrainerConfig(strategy='none') on {world_size} ranks: gradients are not averaged and "
                f"the replicas drift apart; use strategy='ddp'"
            )
        return model

    def build_optimizer(self, optimizer: Any, wrapped: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            return optimizer(wrapped.parameters())
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or a callable params -> optimizer, got {type(optimizer).__name__}"
        )

    # -- training ---------------------------------------------------------------------
    def after_optimizer_step(self) -> None:
        """Called after every optimizer step that was taken (DiLoCo counts it, and syncs in turn)."""

    def no_sync(self, model: nn.Module):
        """Context for micro-batches whose gradients are only accumulated locally."""
        no_sync = getattr(model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` and return the global norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm (the same value on every rank), without changing anything."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))

    # -- evaluation -------------------------------------------------------------------
    def sync_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics), before evaluating.

        Collective for the replicating strategies; the plain one has nothing to agree on (on
        several ranks its replicas drift apart anyway, and it warned). See [Note: one model
        state on every rank].
        """

    def eval_module(self, model: nn.Module) -> nn.Module:
        """What evaluation runs: the bare model (no per-forward buffer broadcast, no hooks)."""
        return ckpt.unwrap_model(model)

    def evaluating(self, model: nn.Module):
        """Context around an evaluation: the weights it tests (DiLoCo: the replicas' common ones)."""
        return contextlib.nullcontext()

    def extra_parts(self) -> dict[str, Any]:
        """Stateful parts of the strategy's own for a checkpoint, restored after the optimizer."""
        return {}

    # -- state ------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full weights with plain keys (collective for sharded models)."""
        return ckpt.strip_prefix(ckpt.unwrap_model(model).state_dict())

    def load_model_state_dict(self, model: nn.Module, state: dict, source: str = "state dict") -> None:
        ckpt.load_model_state(model, state, source=source)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


class _Replicated(Strategy):
    """What the strategies that keep one model across ranks share.

    [Note: one model state on every rank]
    Each rank's forward passes update its own buffers (BatchNorm's running statistics) from
    its own batches; DDP overwrites them with rank 0's only at the next training forward, and
    FSDP never does. Evaluating then would test a different model on every rank (and not the
    one rank 0 saves as best.pt and exports). So every evaluation starts by giving every rank
    rank 0's buffers: the model that is tested, kept as the best, saved and exported is one
    state everywhere. Training is unaffected: buffers never enter the gradients, and DDP
    would have broadcast rank 0's at the next forward anyway.
    """

    def sync_buffers(self, model: nn.Module) -> None:
        if comm.is_distributed():
            comm.broadcast_coalesced(list(model.buffers()), 0, name="rank 0's buffers before an evaluation")


class _DDPStrategy(_Replicated):
    name = "ddp"

    def prepare(self, model: nn.Module, optimizer: Any, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not self.steps_in_backward:
            return super().prepare(model, optimizer, world_size)
        from dptrain.parallel.ddp import DistributedDataParallel

        # DDP steps the optimizer from its backward hooks, so it needs the optimizer first; the
        # wrapper holds the model's own parameters, so one built over the bare model is the same.
        built = self.build_optimizer(optimizer, model)
        return DistributedDataParallel(model, device_ids=self._device_ids(), overlap_optimizer=built, **self.kwargs), built

    def wrap(self, model: nn.Module, world_size: int) -> nn.Module:
        from dptrain.parallel.ddp import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=self._device_ids(), **self.kwargs)

    def _device_ids(self) -> list[int] | None:
        return [self.device.index] if self.device.type == "cuda" and self.device.index is not None else None


class _TorchDDPStrategy(_DDPStrategy):
    name = "torch-ddp"

    def wrap(self, model: nn.Module, world_size: int) -> nn.Module:
        if not comm.is_distributed():
            raise ValueError(
                f"TrainerConfig(strategy={self.name!r}) needs a process group, but this is a single process "
                f"(world size {world_size}); launch with `dptrain run --nproc-per-node N` or use strategy='none'"
            )
        from dptrain.parallel.ddp._signature import torch_ddp  # torch's class even where its name now means ours

        return torch_ddp()(model, device_ids=self._device_ids(), **self.kwargs)


class _ZeroStrategy(_DDPStrategy):
    """Our DDP with a ZeRO-1 optimizer: each rank keeps and steps 1/N of the optimizer state.

    Gradients are averaged whole (as with DDP), so clipping by the global norm is DDP's. The
    optimizer state is consolidated on rank 0 for a checkpoint, in the unsharded optimizer's
    format, and so resumes on any number of ranks.
    """

    name = "zero"

    def build_optimizer(self, optimizer: Any, wrapped: nn.Module) -> torch.optim.Optimizer:
        from dptrain.parallel.zero import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            # Same parameters, groups and settings, sharded; the given optimizer is never stepped.
            groups = [dict(g) for g in optimizer.param_groups]
            return ZeroRedundancyOptimizer(groups, type(optimizer), **optimizer.defaults)
        built = super().build_optimizer(optimizer, wrapped)
        if isinstance(built, ZeroRedundancyOptimizer):
            return built
        return ZeroRedundancyOptimizer([dict(g) for g in built.param_groups], type(built), **built.defaults)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        optimizer.consolidate_state_dict(to=0)  # collective
        return optimizer.state_dict() if comm_rank(optimizer) == 0 else {}


def comm_rank(optimizer: Any) -> int:
    return getattr(optimizer, "rank", 0)


class _FSDPStrategy(_Replicated):
    name = "fsdp"
    shards_optimizer = True
    lockstep_eval = True  # every forward all-gathers the shards

    def wrap(self, model: nn.Module, world_size: int) -> nn.Module:
        from dptrain.parallel.fsdp import FullyShardedDataParallel

        kwargs = dict(self.kwargs)
        if self.device.type == "cuda":
            kwargs.setdefault("device_id", self.device)
        return FullyShardedDataParallel(model, **kwargs)

    def build_optimizer(self, optimizer: Any, wrapped: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "strategy='fsdp' needs the optimizer built on the sharded parameters; pass a function instead of an "
                "optimizer, e.g. Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-3), ...)"
            )
        return super().build_optimizer(optimizer, wrapped)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)  # the norm spans every rank's shard

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        return model.clip_grad_norm_(math.inf)  # a coefficient of at most 1: nothing changes

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # the shards must be gathered for every forward

    def model_state_dict(self, model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        return dict(model.full_state_dict(rank0_only=rank0_only))


class _DiLoCoStrategy(_Replicated):
    """DiLoCo: every rank (or every node, DDP inside it) trains alone for ``sync_every`` steps,
    then the replicas take one outer step together (:class:`dptrain.DiLoCo`).

    Replicas differ between syncs, so each rank checkpoints its own weights, inner optimizer
    and DiLoCo state (a part of its own, like FSDP's optimizer shards: resume on the same
    world size), while the checkpoint's ``model`` is the replicas' common (outer) weights: what
    evaluation tests, ``best.pt`` keeps and an export writes.
    """

    name = "diloco"
    shards_optimizer = True  # each replica's inner optimizer has its own state

    def __init__(self, device: torch.device, config_kwargs: dict | None = None, overlap_optimizer: bool = False) -> None:
        super().__init__(device, config_kwargs, overlap_optimizer)
        from dptrain.parallel.diloco import check_trainer_settings

        settings = check_trainer_settings(self.kwargs)
        self.replica = settings.pop("replica")
        self.settings = settings
        self.diloco: Any = None  # made by prepare(), with the optimizer

    def prepare(self, model: nn.Module, optimizer: Any, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        from dptrain.parallel.diloco import DiLoCo

        wrapped, built = super().prepare(model, optimizer, world_size)
        self.diloco = DiLoCo(wrapped, built, **self.settings)
        return wrapped, built

    def wrap(self, model: nn.Module, world_size: int) -> nn.Module:
        if self.replica != "node" or not comm.is_distributed():
            return model
        from dptrain.parallel.ddp import DistributedDataParallel
        from dptrain.parallel.diloco import node_group

        ids = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else None
        return DistributedDataParallel(model, device_ids=ids, process_group=node_group())

    def after_optimizer_step(self) -> None:
        self.diloco.step()

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module):
        with self.diloco.outer_weights():
            yield

    def model_state_dict(self, model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        with self.diloco.outer_weights():
            return {k: v.detach().clone() for k, v in super().model_state_dict(model, rank0_only).items()}

    def extra_parts(self) -> dict[str, Any]:
        return {"diloco": _DiLoCoPart(self)}


class _DiLoCoPart:
    """This rank's replica in a checkpoint: its own weights and DiLoCo's state (outer weights,
    outer momentum, the round's position, exchanges not yet applied). One file per rank."""

    sharded = True

    def __init__(self, strategy: _DiLoCoStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict:
        diloco = self.strategy.diloco
        return {"diloco": diloco.state_dict(), "weights": [p.detach().cpu().clone() for p in diloco.parameters()]}

    def load_state_dict(self, state: dict) -> None:
        diloco = self.strategy.diloco
        diloco.load_state_dict(state["diloco"])
        with torch.no_grad():
            for p, saved in zip(diloco.parameters(), state["weights"]):
                p.copy_(saved)


_STRATEGY_TYPES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Strategy, _DDPStrategy, _TorchDDPStrategy, _ZeroStrategy, _FSDPStrategy, _DiLoCoStrategy)
}


def make_strategy(name: str | None, world_size: int, device: torch.device, config, optimizer: Any = None) -> Strategy:
    """The strategy for ``TrainerConfig(strategy=name)``.

    None picks DDP on several ranks (plain on one); ``zero_stage=1``, or a
    ``ZeroRedundancyOptimizer`` given as the optimizer, turns DDP into ``"zero"``.
    """
    from dptrain.parallel.zero import ZeroRedundancyOptimizer

    wants_zero = getattr(config, "zero_stage", 0) == 1 or isinstance(optimizer, ZeroRedundancyOptimizer)
    if name is None:
        name = ("zero" if wants_zero else "ddp") if world_size > 1 else "none"
    elif name == "ddp" and wants_zero:
        name = "zero"
    elif wants_zero and name not in ("zero", "none"):
        raise ValueError(
            f"TrainerConfig(strategy={name!r}) cannot shard the optimizer ZeRO-1 style; use strategy='zero' "
            f"(or 'ddp' with zero_stage=1){' -- FSDP shards it already' if name == 'fsdp' else ''}"
        )
    kwargs = (config.fsdp_kwargs if name == "fsdp" else config.ddp_kwargs if name in ("ddp", "torch-ddp", "zero")
              else getattr(config, "diloco_kwargs", {}) if name == "diloco" else {})
    # Compression and the optimizer overlap concern dptrain's DDP only (the config refuses the
    # other strategies); on one process ("none", picked automatically) there is nothing to do.
    compression = getattr(config, "compression", None)
    if compression is not None and name in ("ddp", "zero"):
        kwargs = {**kwargs, "compression": compression}
    overlap = bool(getattr(config, "overlap_optimizer", False)) and name == "ddp"
    return _STRATEGY_TYPES[name](device, kwargs, overlap)


def build_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, given: Any = None) -> Any:
    """A scheduler object, or a factory ``optimizer -> scheduler`` called on the built optimizer.

    ``given`` is the optimizer the user passed. A strategy may step another one built from it
    (``"zero"`` shards it into a ZeroRedundancyOptimizer with the same groups); a scheduler
    made on the given optimizer is then moved to the one that steps, or it would change the
    learning rate of an optimizer that is never stepped.
    """
    if scheduler is None:
        return None
    if hasattr(scheduler, "step"):
        bound = getattr(scheduler, "optimizer", None)
        if bound is not None and bound is not optimizer:
            if bound is not given or len(bound.param_groups) != len(optimizer.param_groups):
                raise ValueError(
                    f"the scheduler ({type(scheduler).__name__}) adjusts an optimizer the Trainer does not step; "
                    f"build it on the optimizer passed to the Trainer, or pass a function optimizer -> scheduler"
                )
            _move_scheduler(scheduler, optimizer)
        return scheduler
    if callable(scheduler):
        return scheduler(optimizer)
    raise ValueError(f"scheduler must be an LR scheduler or a callable optimizer -> scheduler, got {type(scheduler).__name__}")


def _move_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` at ``optimizer``, whose groups were copied from its old optimizer's.

    The copies already hold what the scheduler wrote into the groups when it was built
    (``initial_lr``, OneCycleLR's ``max_lr`` ...); its step tracking is installed on the new
    optimizer as the scheduler would have done.
    """
    from dptrain.parallel.ddp._overlap import scheduler_tracked_step

    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        inner.optimizer = optimizer
    if not getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer.step = scheduler_tracked_step(optimizer, type(optimizer).step)

