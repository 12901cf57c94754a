"""In-place recovery for DiLoCo's Trainer: every rank rolls back to the newest round all ranks saved.

[Note: DiLoCo, recovered in place]
With ``strategy="diloco"`` and ``replica="rank"`` every rank trains a replica of its own between
outer syncs: its weights and inner optimizer state differ from every other rank's, so no live
rank holds what a dead one held, and the step commits of [Note: in-place recovery] in
:mod:`dptrain.train.recovery` (a source broadcasting "the shared state") do not apply. What
DiLoCo recovers to instead is a *round snapshot*:

*Round points.* A commit is a round point when DiLoCo's inner step is ``tau`` past a multiple
of ``sync_every`` (``tau`` = ``fragment_sync_delay``: the last fragment's exchange, started at
the round's end, has just been applied; with one fragment and no delay, right after the outer
sync), and the commit at ``fit``'s start. At a round point each rank writes, into the
launcher's recovery directory (it outlives the rank), everything a resume from there needs:
its replica (weights, inner optimizer), DiLoCo's state (outer weights, outer momentum, the
averaged results of exchanges still in flight -- waited for here, once a round), the progress,
loader position, scheduler, callbacks, best weights, and its RNG streams and buffers. The
newest two are kept (``round<rank>-<commit>.pt``, each written to a temporary name and then
renamed). A checkpoint's worth per rank, once every ``sync_every`` steps: the cost is
amortised over the round (docs/diloco.md gives it measured).

*Why the newest two suffice.* Between two round points every rank takes part in a collective
(the round's outer exchange, the epoch's loss all-reduce) that needs every other rank to have
passed the earlier one, so when a rank dies, no member is more than one round point ahead of
another: the newest round point that every member holds is among each member's two.

*Recovering.* The members of the new generation exchange the round points they hold (a
replacement: the files the dead rank left). The target is the newest one all hold; every
member -- survivors and replacement alike -- drops the exchanges in flight (their group is
broken), loads its own round snapshot of the target, and the loop goes on from there like a
resume: the steps since are done again with the same data, the same RNG streams and the same
outer state, so the run ends bit for bit where an uninterrupted one ends. Nothing is sent
between ranks but the one exchange that picks the target. A member without a snapshot of any
common round point makes the job fall back to a restart from its newest checkpoint.

[Note: DiLoCo without a node]
A node lost for good under ``--nnodes MIN:MAX`` takes its replicas with it and nobody replaces
them (see [Note: going on without a node] in :mod:`dptrain.train.resize`): the survivors
re-form the group at the smaller size, some under new rank numbers. Each survivor reports the
round snapshots it holds under the number it wrote them with, the target is picked as above,
and each then moves to the new world (its rank, its samplers, the parts of a checkpoint),
rebuilds DiLoCo's exchange for it -- from now on the outer mean is over the replicas present --
and loads its *own* snapshot of the target, read under its old number. The train sampler
loads the target's position, saved on the old world size, and so shares the rest of the
epoch out among the survivors (each sample not yet trained on is trained on once); the LR
schedule is re-planned, as on a resume at another world size. The outer weights and outer
momentum were the same on every replica, so the survivors go on with one common outer state;
what the lost replicas trained since the target is lost with them, as their part of the
epoch's running loss is. Deterministic, but not bitwise equal to an uninterrupted run (it had
more replicas). A renumbered rank's snapshot of the target then takes its new number's name
(after a barrier: another process of its node may have had that number), so a replacement of
it before the next round point finds it.

[Note: DiLoCo's node replicas, recovered in place]
With ``replica="node"`` the ranks of a node train one replica with DDP over a group of the
node's ranks (``node_group()``), and DiLoCo exchanges between the nodes over one "rail" group
per local rank. Every one of those groups dies with the old world, and only the world's ranks
together can make new ones (``new_group`` is collective over the world). The state is no
harder than above: every rank writes its own round snapshot, which holds its node's replica,
inner optimizer and DiLoCo state (the same on every rank of the node) and also its DDP's
*layout* at that commit (the reducer's learnt buckets, see ``DistributedDataParallel.
_recovery_layout``); a replacement reads the dead rank's, on the same node. What a recovery
adds is the groups, in an order every rank keeps:

1. A replacement's Trainer builds its DDP over ``node_group()`` and DiLoCo over the rails
   (``topology_for``), two collectives over the world each, while the survivors, right after
   the re-form (and a replacement that re-forms again because a member died meanwhile), make
   the same two: ``node_group()``, then DiLoCo's topology for the new node group.
2. The target is picked as above and every rank loads its own round snapshot of it.
3. Every rank calls ``ddp._rejoin(layout, process_group=<the new node group>)`` with its
   snapshot's layout (the same on every rank of a node): inside each node, the ranks check the
   model, vote on shared memory and build a new reducer that takes over the buckets, so the
   steps done again reduce exactly as the first time.

The run then ends bit for bit where an uninterrupted one ends. A node lost for good under
``--nnodes MIN:MAX`` still restarts the job (``resize.obstacle`` says so).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import time
from typing import Any

import torch

__all__ = ["RoundSnapshots", "obstacle"]

KEEP = 2  # round snapshots kept per rank (see the Note: the newest common one is among them)


def obstacle(trainer: Any) -> str | None:
    """Why a DiLoCo Trainer cannot recover in place, or None when it can (or is not DiLoCo)."""
    strategy = trainer.strategy
    if strategy.name != "diloco":
        return None
    model = getattr(trainer, "model", None)
    if strategy.replica == "node" and hasattr(model, "_recovery_obstacle"):
        # The node's DDP follows the re-form onto a node group made again (see the Note); what else would
        # keep a DDP from rejoining (none of it is set by the strategy today) is still refused.
        return model._recovery_obstacle(group_rebuilt=True)
    return None


def _name(rank: int, seq: int) -> str:
    return f"round{rank}-{seq:09d}.pt"


def held(directory: str | None, rank: int) -> dict[int, str]:
    """The round snapshots a rank's processes left in ``directory``: path by commit number."""
    if not directory:
        return {}
    found = {}
    pattern = re.compile(rf"round{rank}-(\d+)\.pt$")
    for path in glob.glob(os.path.join(directory, f"round{rank}-*.pt")):
        match = pattern.search(os.path.basename(path))
        if match:
            found[int(match.group(1))] = path
    return found


class RoundSnapshots:
    """A DiLoCo Trainer's side of in-place recovery (see [Note: DiLoCo, recovered in place]).

    Held by :class:`dptrain.train.recovery.InPlaceRecovery` (``recovery``), which calls
    :meth:`at_commit` after each commit and :meth:`roll_back` in a recovery.
    """

    def __init__(self, recovery: Any) -> None:
        self.recovery = recovery
        self.trainer = recovery.trainer
        self.diloco = self.trainer.strategy.diloco
        self.directory = recovery.directory
        self.written = 0  # round snapshots this process wrote
        self.write_s = 0.0  # the time it took (what a round point costs; see docs/diloco.md)
        self.bytes = 0  # the size of the last one
        # replica='node' on several ranks: the model is a DDP over the node's group, rebuilt by a recovery.
        self.node_replica = hasattr(self.trainer.model, "_rejoin") and self.trainer.strategy.replica == "node"

    # -- round points ----------------------------------------------------------------------
    def due(self, boundary: bool) -> bool:
        """Whether the commit just made is a round point (``boundary`` False: ``fit``'s start, always one)."""
        d = self.diloco
        return not boundary or d.inner_step % d.sync_every == d.fragment_sync_delay % d.sync_every

    def at_commit(self, seq: int, own: dict, boundary: bool) -> None:
        """After commit ``seq`` (``own``: this rank's part of it): write the round snapshot when due."""
        if self.directory and self.due(boundary):
            self.write(seq, own)

    def _state(self, seq: int, own: dict) -> dict:
        t, rec = self.trainer, self.recovery
        state = {
            "seq": seq,
            "optimizer": t.strategy.optimizer_state_dict(t.optimizer),
            "diloco": t._parts.parts["diloco"].state_dict(),  # the replica's weights and DiLoCo's state
            "train_state": t.state.state_dict(),
            "loader": rec.loader_state,
            "callbacks": t._parts.parts["callbacks"].state_dict(),
            "best_state": t.best_state,
            "checkpoints": sorted(t.checkpointer._ours),
            "world_size": t.world.world_size,
            # The buffers as the commit left them: DiLoCo averaged them at the round's end, after the
            # forward that prepared ``own``.
            "own": {**own, "buffers": {k: v.detach().cpu().clone() for k, v in t.model.named_buffers()}},
        }
        if t.scheduler is not None:
            state["scheduler"] = t.scheduler.state_dict()
        if t.scaler is not None:
            state["scaler"] = t.scaler.state_dict()
        if self.node_replica:  # what the node's DDP learnt, for its rejoin (see [Note: DiLoCo's node replicas ...])
            state["ddp_layout"] = t.model._recovery_layout(group_rebuilt=True)
        return state

    def write(self, seq: int, own: dict) -> None:
        started = time.perf_counter()
        rank = self.trainer.rank
        tmp = os.path.join(self.directory, f"round{rank}.tmp")
        torch.save(self._state(seq, own), tmp)
        path = os.path.join(self.directory, _name(rank, seq))
        os.replace(tmp, path)
        self.bytes = os.path.getsize(path)
        for old in sorted(held(self.directory, rank))[:-KEEP]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(held(self.directory, rank)[old])
        self.written += 1
        self.write_s += time.perf_counter() - started

    # -- recovering -----------------------------------------------------------------------
    def recover(self, generation: int, failed_at: float | None, reformed: bool = True) -> None:
        """Every member of ``generation``'s (formed) group: agree on the target, roll back to it, go on.

        ``reformed``: this process re-formed the group (a survivor, or a replacement trying again);
        False for a replacement's first try, whose Trainer made DiLoCo's groups on the new world.
        """
        from dptrain import comm
        from dptrain.runtime import env
        from dptrain.train import resize

        rec, t = self.recovery, self.trainer
        # The files this process reads are those of the rank number it had when it wrote them: after a
        # node was lost (see [Note: DiLoCo without a node]) its number in the new group may differ.
        own = t.rank
        node = None
        if self.node_replica:  # step 1 of [Note: DiLoCo's node replicas, recovered in place]
            if reformed:
                from dptrain.parallel.diloco import node_group

                node = node_group()
                self.diloco._follow_world(node)
            else:
                node = t.model.process_group  # the replacement's DDP was built over the new node group
        status = rec._status(failed_at, {}, False)
        status.update(has=sorted(held(self.directory, own)), pending_save=rec.pending_save)
        statuses = comm.all_gather_object(status)
        target = self.pick(statuses)
        if target is None:
            rec._fall_back("the ranks hold no DiLoCo round snapshot of one and the same commit ("
                           + "; ".join(f"rank {s['rank']}: {s['has'] or 'none'}" for s in statuses)
                           + "), so the run could not go on bit for bit")
        # A checkpoint due at the target that a survivor was writing when the failure came is written again.
        pending_save = any(s["seq"] == target and s["pending_save"] for s in statuses if not s["replacement"])
        started = time.perf_counter()
        rec._drop_step()
        world = env.get_world()
        # A node lost: the same on every member (a resize always changes the world size).
        resized_from = t.world.world_size if world.world_size != t.world.world_size else None
        if (world.rank, world.world_size) != (t.rank, t.world.world_size):
            resize.move_to(t, world)
            self.diloco._follow_world()  # the outer mean is over the replicas present
        progress = self.roll_back(target, pending_save, own, node)
        load_s = time.perf_counter() - started
        steps = comm.all_gather_object(progress["global_step"])
        if len(set(steps)) != 1:  # the files of one commit hold one progress on every rank; a stray file does not
            rec._fall_back(f"the ranks' DiLoCo round snapshots of commit {target} are at different steps {steps}")
        if resized_from is not None:
            self._rename(own, target)
        rec.recoveries += 1
        if t.rank == 0:
            self._say(generation, statuses, progress, target, load_s, resized_from)
        env._STATE.store.set(f"recovery/done/{generation}", "1")

    def _rename(self, old: int, target: int) -> None:
        """After a resize (every member): a renumbered rank's round snapshot of ``target`` takes its new
        number's name, so that a replacement of it (which reads its number's files) finds it. Another
        process of this node may have had that number before and still hold files under it: every
        renumbered rank first moves its own out of the way, and only after a barrier takes its new name."""
        from dptrain import comm

        moving = old != self.trainer.rank
        aside = os.path.join(self.directory, f"round-moving-{os.getpid()}.pt")
        if moving:
            mine = held(self.directory, old)
            os.replace(mine.pop(target), aside)
            for path in mine.values():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        comm.barrier()
        if moving:
            os.replace(aside, os.path.join(self.directory, _name(self.trainer.rank, target)))

    def pick(self, statuses: list[dict]) -> int | None:
        """The newest round point every member holds (``statuses[i]["has"]``), or None."""
        common = set.intersection(*(set(s["has"]) for s in statuses)) if statuses else set()
        return max(common) if common else None

    def _say(self, generation: int, statuses: list[dict], progress: dict, target: int, load_s: float,
             resized_from: int | None = None) -> None:
        """The one line a recovery leaves in the log (rank 0)."""
        import sys

        from dptrain.runtime import regroup as _regroup, env

        said = _regroup.announcement(env._STATE.store, generation)
        who = f"rank {said.get('rank', '?')}" + (f" (pid {said['pid']})" if said.get("pid") else "")
        new = ", ".join(f"rank {s['rank']}" for s in statuses if s["replacement"]) or "no new rank"
        since = [s["failed_at"] for s in statuses if s["failed_at"] is not None]
        waited = f"{time.time() - min(since):.2f} s" if since else "?"
        reached = max(s["seq"] for s in statuses)
        if resized_from is not None:
            size = self.trainer.world.world_size
            print(
                f"dptrain: recovered in place (generation {generation}): {said.get('why', 'a node was lost')}; "
                f"DiLoCo: the {size} rank(s) left rolled back to their round snapshots at step "
                f"{progress['global_step']} (epoch {progress['epoch'] + 1}, batch {progress['batch_in_epoch']}; commit "
                f"{target}, {reached - target} commit(s) back, loaded in {load_s:.3f} s); the survivors waited "
                f"{waited}; the job goes on with {size} ranks instead of {resized_from}: the outer mean is over "
                f"the {size} replicas left and the rest of the epoch is shared out anew among them as on a resume "
                f"at another world size; no process was restarted and no checkpoint was read",
                file=sys.stderr, flush=True,
            )
            return
        print(
            f"dptrain: recovered in place (generation {generation}): {who} {said.get('why', 'failed')}; DiLoCo: every "
            f"rank rolled back to its round snapshot at step {progress['global_step']} (epoch {progress['epoch'] + 1}, "
            f"batch {progress['batch_in_epoch']}; commit {target}, {reached - target} commit(s) back) and goes on "
            f"from there; the survivors waited {waited}; {new} took the dead rank's replica, inner optimizer and "
            f"DiLoCo state from its round snapshot (loaded in {load_s:.3f} s); no checkpoint was read",
            file=sys.stderr, flush=True,
        )

    def roll_back(self, target: int, pending_save: bool, own: int | None = None, node: Any = None) -> dict:
        """Load this rank's round snapshot of commit ``target`` (its own files, written under rank number
        ``own``, default its current one; a replacement's are the dead rank's) and make it the Trainer's
        state; the snapshot's progress is returned. ``node``: the new node group of a replica='node'
        DDP, which rejoins it with the snapshot's layout (collective over the node's ranks)."""
        t = self.trainer
        own = t.rank if own is None else own
        path = held(self.directory, own)[target]
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.diloco._drop_in_flight()
        if node is not None:
            t.model._rejoin(state["ddp_layout"], process_group=node)  # step 3 of the Note
        t.strategy.load_optimizer_state_dict(t.optimizer, state["optimizer"])
        t._parts.parts["diloco"].load_state_dict(state["diloco"])
        if t.scaler is not None and "scaler" in state:
            t.scaler.load_state_dict(state["scaler"])
        t._parts.parts["callbacks"].load_state_dict(state["callbacks"])
        t.best_state = state["best_state"]
        t.state.load_state_dict(state["train_state"])
        t.state.set_loader_position(state["loader"])
        if t.scheduler is not None and "scheduler" in state:
            if state["world_size"] != t.world.world_size:
                # As a checkpoint resumed on another world size: re-planned from the progress just loaded.
                t._parts.scheduler.saved_world_size = state["world_size"]
                t._parts.scheduler.load_state_dict(state["scheduler"])
            else:
                t.scheduler.load_state_dict(state["scheduler"])
        t.checkpointer._ours = set(state["checkpoints"])
        part = state["own"]
        per_rank: list = [None] * t.world.world_size
        per_rank[t.rank] = part
        t._parts.parts["per_rank"].load_state_dict(per_rank)  # RNG streams, running sums, buffers
        # Round snapshots past the target were written by this rank before the failure; the steps
        # are done again and write them again (the same bits), so none must shadow the newer ones.
        for seq, newer in held(self.directory, own).items():
            if seq > target:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(newer)
        rec = self.recovery
        rec.seq, rec.snapshot, rec.prepared = target, part, None
        rec.loader_state, rec.layout = state["loader"], None
        rec.pending_save = pending_save
        if t.state.global_step > 0:
            t.optimizer._opt_called = True  # the run has stepped: an LR scheduler's step is in order
        return state["train_state"]
