"""The Trainer going on at another world size in place: a node lost for good, or one let in.

[Note: going on without a node]
When a whole node is lost and the job is elastic (``--nnodes MIN:MAX``), no replacement comes:
the launcher announces a *resize* generation instead (see [Note: a node lost for good] in
``dptrain.launcher.resize``) and the survivors re-form the group at the smaller size, some of
them under new rank numbers (``dptrain.runtime.regroup.world_at``). The recovery is the one of
[Note: in-place recovery] in ``dptrain.train.recovery`` -- the most advanced survivor's commit,
each rank's own snapshot -- plus a move to the new world: the Trainer's rank and world, its
checkpointer's, the parts of a checkpoint (which gather per rank), and every loader's sampler.
The train sampler then loads the commit's position, saved on the old world size, and so shares
the rest of the epoch out among the new ranks exactly as a checkpoint resumed on another world
size does: each sample not yet trained on is trained on once (see [Note: resuming, and the rule
for a different world size] in dptrain.data.sampler). The LR schedule is re-planned as on such
a resume, on every rank. Not bitwise equal to an uninterrupted run (the world size changed);
the dead ranks' part of the epoch's running loss is lost with them, so that epoch's mean train
loss covers the survivors' samples only.
A Trainer says it can (``recovery/resizable/<rank>``) only when every loader's share is its
sampler's business: dptrain's DistributedSampler (which knows how to re-split), or a loader
without any world-dependent sampler (every rank evaluates all of it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["obstacle", "move_to"]


def _loaders(trainer: Any) -> list[tuple[str, Any]]:
    return [(name, loader) for name in ("train", "dev", "test")
            if (loader := getattr(trainer, f"{name}_loader", None)) is not None]


def _sampler_of(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not hasattr(sampler, "num_replicas") and hasattr(getattr(batch_sampler, "sampler", None), "num_replicas"):
        sampler = batch_sampler.sampler
    return sampler


def obstacle(trainer: Any) -> str | None:
    """Why this Trainer cannot go on at another world size in place, or None."""
    from dptrain.data.sampler import DistributedSampler

    if not hasattr(trainer, "train_loader"):
        return "a plain loop (dptrain.RecoverableLoop) goes on in place at the same world size only"
    # DiLoCo (replica='rank') goes on without a node too: the survivors roll back to their round
    # snapshots and the outer mean is over the replicas left (see [Note: DiLoCo without a node] in
    # dptrain.train.rollback). replica='node' recovers a rank in place, but a lost node restarts.
    if getattr(trainer.strategy, "name", None) == "diloco" and getattr(trainer.strategy, "replica", None) == "node":
        return ("DiLoCo with replica='node' replaces a rank in place but does not go on without a lost node: its "
                "node groups and rails would need the world's new shape; use diloco_kwargs={'replica': 'rank'} to "
                "go on in place with fewer replicas")
    for name, loader in _loaders(trainer):
        sampler = _sampler_of(loader)
        if isinstance(sampler, DistributedSampler):
            continue
        if hasattr(sampler, "num_replicas") or name == "train":
            return f"the {name} loader's share is not given by dptrain's DistributedSampler"
    return None


def move_to(trainer: Any, world: Any) -> None:
    """The Trainer's side of a resize (see [Note: going on without a node]): everything that holds
    the rank or the world size now holds ``world``'s."""
    from dptrain.data.sampler import DistributedSampler
    from dptrain.train import _parts

    trainer.world, trainer.rank = world, world.rank
    for _, loader in _loaders(trainer):
        sampler = _sampler_of(loader)
        if isinstance(sampler, DistributedSampler):
            sampler._move(world.world_size, world.rank)
    trainer.checkpointer.rank, trainer.checkpointer.world_size = world.rank, world.world_size
    trainer._parts = _parts.StatefulParts(
        strategy=trainer.strategy, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
        scaler=trainer.scaler, progress=trainer.state, train_loader=trainer.train_loader,
        callbacks=trainer.callbacks, checkpointer=trainer.checkpointer, config=trainer.config, world=world,
    )  # fmt: skip
