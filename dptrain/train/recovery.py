"""In-place recovery in the Trainer: a rank dies, the others keep their processes and go on.

[Note: in-place recovery]
Under ``dptrain run --recovery in-place`` the launcher does not stop the job when a rank
dies: it announces a new generation of the process group and starts a replacement for that
rank (see [Note: generations] in :mod:`dptrain.runtime.regroup`). Here is what the ranks do so that
the run ends bit for bit where an uninterrupted one would.

*Commits.* After every optimizer step (and at the end of every epoch, and when ``fit``
starts) the Trainer is at a *commit*: a point a resumed run could continue from, exactly
as from a checkpoint taken there (see [Note: bitwise resume] in :mod:`dptrain.train.state`).
Commits are numbered the same on every rank. What is the same on every rank at a commit --
weights, optimizer, scheduler, scaler, progress, callbacks, the loader's position -- changes
only in the optimizer step, and nothing collective happens between that step and the commit
after it: so a rank that notices a failure (always in a collective) still holds the shared
state of its last commit. What differs between ranks -- RNG streams, the epoch's running
loss, buffers -- is kept per commit as a small *snapshot*.

*Snapshots outlive the rank.* A replacement needs the dead rank's snapshot. Each rank writes
its snapshot of the coming commit into the launcher's recovery directory as soon as it is
determined -- after the forward of a step's last micro-batch, before the backward sends
anything -- so a rank whose gradients reached the others has always written the snapshot of
the commit they reach. Two files alternate (``rank<r>.0``/``.1``, each replaced atomically),
so the one before is there too. This is not a checkpoint: a few kB of RNG state, two sums
and the buffers, never the weights.

*Recovering.* The members of the new generation exchange their last commits. The target is
the newest one any survivor reached (a ring all-reduce may complete on one rank and fail on
another); the lowest such survivor is the source. It broadcasts the shared state; every
member takes its own snapshot of the target (a survivor one commit behind has it prepared,
a replacement reads its rank's file), rebuilds DDP's reducer with the source's bucket
layout, drops any gradient, and the loop continues from the target like a resume -- the
interrupted step is done again with the same data. A checkpoint that was due at the target
and not finished is written again. When a member has no snapshot of the target the run
cannot go on exactly: the ranks exit with :data:`FALLBACK_EXIT` after writing why, and the
launcher restarts the whole job from its newest checkpoint instead.

*DiLoCo* keeps no shared state between its outer syncs beyond the outer one, so it takes none
from a source: every rank rolls back to a round snapshot of its own (see [Note: DiLoCo,
recovered in place] in :mod:`dptrain.train.rollback`); the commits are numbered as here.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import (heartbeat as _heartbeat, interrupt as _interrupt, regroup as _regroup,
    settings as _settings)
from dptrain.runtime.errors import CollectiveError
from dptrain.train import _transfer, resize, rollback

__all__ = ["InPlaceRecovery", "in_place_requested", "is_replacement", "FALLBACK_EXIT"]

#: Exit code of a rank that cannot recover in place (the launcher then restarts the whole job).
FALLBACK_EXIT = _regroup.FALLBACK_EXIT
#: The value of ``recovery/resizable/<rank>`` of a rank that can go on without a node but cannot take a
#: new one in place (DiLoCo: a newcomer has no replica); the launcher then lets a node in at a restart.
SHRINK_ONLY = "shrink"
#: With nodes let into a running job (``DPTRAIN_RECOVERY_ADMIT``): the ranks ask whether one is
#: ready after every this many optimizer steps (one small all-reduce; see [Note: a node coming back]
#: in dptrain.launcher.resize).
ADMIT_EVERY_STEPS = 4


class _NodeArrived(Exception):
    """Raised at a step boundary when every rank agreed that a node let in is ready to join: the
    Trainer's loop unwinds to ``fit`` and re-forms the group there, as after a peer's failure."""


def in_place_requested() -> bool:
    """Whether the launcher runs this job with ``--recovery in-place``."""
    return _settings.get("DPTRAIN_RECOVERY") == "in-place"


def is_replacement() -> bool:
    """Whether this process replaces a rank that died (it joins a running job)."""
    return in_place_requested() and bool(_settings.get("DPTRAIN_GENERATION"))


def _unsupported(trainer: Any) -> str | None:
    """Why this Trainer cannot recover in place, or None when it can."""
    strategy = trainer.strategy
    if strategy.name == "diloco":  # rolls back to a round snapshot instead: see dptrain.train.rollback
        return rollback.obstacle(trainer)
    if strategy.name != "ddp":
        return (f"strategy {strategy.name!r} (in-place recovery works with dptrain's DDP, strategy='ddp', and with "
                f"DiLoCo, strategy='diloco'; FSDP, ZeRO and torch's DDP restart the whole job from its newest "
                f"checkpoint)")
    if getattr(strategy, "steps_in_backward", None):
        return "an optimizer stepped inside backward (overlap_optimizer) cannot be rolled back"
    if not hasattr(trainer.model, "_rejoin"):
        return f"the model is wrapped as {type(trainer.model).__name__}, not dptrain.DistributedDataParallel"
    from dptrain.parallel.ddp import _recovery

    return _recovery.obstacle(trainer.model)  # PowerSGD, a process group of its own, ... (None: it can)


def _layout(model: Any) -> dict | None:
    """DDP's reducer as it stands, or None while it cannot be carried over (compression="auto" still
    measuring): a recovery then falls back to a restart."""
    try:
        return model._recovery_layout()
    except NotImplementedError:
        return None


def _is_peer_failure(exc: BaseException) -> bool:
    """A failure in a collective -- a peer died or stalled -- rather than an error of this rank's own."""
    if _heartbeat.progress().get("failed"):
        return True
    seen = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, CollectiveError) or type(seen).__name__ in ("ShmPeerError", "DistBackendError",
                                                                         "DistNetworkError", "DistError"):
            return True
        text = str(seen)
        if isinstance(seen, RuntimeError) and any(s in text for s in ("Connection closed by peer", "Connection reset",
                                                                        "Broken pipe", "Timed out", "gloo")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _announcement_wait_s() -> float:
    """How long a survivor waits for the launcher to announce a recovery: the collective timeout, and
    at least ``_regroup.ARRIVAL_WAIT_S``. A stall is announced only after the stalled rank has stood
    still for the whole timeout and its launcher has seen that (a second or two more), and a lost
    node after several of its launcher's beats; a failure that no launcher recovers in place ends
    the job instead (the launcher stops every rank), so a longer wait never outlives the job."""
    from dptrain.runtime import env

    return max(env._STATE.timeout.total_seconds(), _regroup.ARRIVAL_WAIT_S)


def _forget(exc: BaseException) -> None:
    """Clear the frames of a failed step's traceback: their locals (works, groups) keep the broken
    process group alive, and with it its connections (see :meth:`InPlaceRecovery._let_go`)."""
    seen = exc
    for _ in range(16):
        if seen is None:
            break
        if seen.__traceback__ is not None:
            traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__


def _read_snapshots(directory: str, rank: int) -> dict[int, "_Snapshot"]:
    """The snapshots a rank's process left in ``directory`` (see [Note: in-place recovery]), by commit."""
    held = {}
    for path in glob.glob(os.path.join(directory, f"rank{rank}.[01]")):
        with contextlib.suppress(Exception):  # a file being replaced: the other one is the older commit
            snap = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(snap.get("seq"), int):
                held[snap["seq"]] = _Snapshot(snap)
    return held


# A replacement reads the snapshots of the rank it replaces while it waits in dptrain.init for the
# survivors to re-form the group (they notice the failure only at their next collective): that
# wait is usually the longer, so the reading is off the path to the next step. Only the process
# with a rank's number ever writes that rank's files, and the dead one no longer can: what was
# read then is what the Trainer would read later. Keyed by (folder, rank): a rank renumbered by a
# resize meanwhile reads its new number's files at the join, as before.
_READ_AHEAD: dict[tuple[str, int], dict] = {}
_READ_AHEAD_ONCE = [False]  # in the process's first wait only: later ones are a member's, not a newcomer's


def _read_ahead(world: Any) -> None:
    directory = _settings.get("DPTRAIN_RECOVERY_DIR")
    if is_replacement() and directory and not _READ_AHEAD_ONCE[0]:
        _READ_AHEAD_ONCE[0] = True
        _READ_AHEAD[(directory, world.rank)] = _read_snapshots(directory, world.rank)


_regroup.while_waiting(_read_ahead)


class _Snapshot(dict):
    """One rank's part of a commit: ``seq`` (the commit's number), ``rng``, ``loss_sum``, ``sample_count``,
    ``buffers`` (plain CPU tensors: small, and loadable with ``weights_only=True``): the entry a checkpoint keeps
    per rank (``_parts._PerRank``), plus its number."""


class InPlaceRecovery:
    """A Trainer's side of in-place recovery; every method is a no-op unless :attr:`active`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        world = trainer.world
        self.requested = in_place_requested() and world.world_size > 1 and dist.is_initialized()
        self.why_not = _unsupported(trainer) if self.requested else None
        self.active = self.requested and self.why_not is None
        self.directory = _settings.get("DPTRAIN_RECOVERY_DIR") if self.active else None
        self.seq = -1  # the last commit's number; -1 before the first
        self.snapshot: _Snapshot | None = None  # this rank's part of commit `seq`
        self.prepared: _Snapshot | None = None  # ... of commit `seq + 1`, once determined
        self.loader_state: Any = None  # the loader's position at commit `seq`
        self.layout: dict | None = None  # DDP's reducer at commit `seq` (see DistributedDataParallel._recovery_layout)
        self.pending_save = False  # a checkpoint due at commit `seq` is not written yet
        self.recoveries = 0
        self.joined_from: str | None = None  # a replacement: what it got its state from
        self.arrived = False  # every rank agreed, at the last boundary, that a node let in is ready
        # See [Note: going on without a node] in dptrain.train.resize.
        self.resizable = self.active and resize.obstacle(trainer) is None
        # Nodes may be let in while the job runs: every rank takes part in the check (see the Note).
        # (Not DiLoCo's: a node let in would bring replicas with nothing to start from; see SHRINK_ONLY.)
        self.admitting = (self.resizable and _settings.get("DPTRAIN_RECOVERY_ADMIT")
                          and trainer.strategy.name != "diloco")
        self._watching: list = []  # the model's hooks that stop a step at once (see dptrain.runtime.interrupt)
        # DiLoCo: replicas differ between syncs, so a failure rolls back to a round snapshot instead of
        # taking a live rank's state (see [Note: DiLoCo, recovered in place] in dptrain.train.rollback).
        self.rounds = rollback.RoundSnapshots(self) if self.active and trainer.strategy.name == "diloco" else None

    # -- commits -------------------------------------------------------------------------
    def _own_state(self, loss_sum: torch.Tensor, count: int) -> _Snapshot:
        model = self.trainer.model
        return _Snapshot(rng=self.trainer.state.rng_state(), loss_sum=loss_sum.detach().cpu().clone(),
                         sample_count=int(count),
                         buffers={k: v.detach().cpu().clone() for k, v in model.named_buffers()})

    def _write(self, snap: _Snapshot) -> None:
        """Make ``snap`` readable by a replacement of this rank (see [Note: in-place recovery])."""
        if not self.directory or self.rounds is not None:  # DiLoCo recovers from its round snapshots only
            return
        rank = self.trainer.rank
        tmp = os.path.join(self.directory, f"rank{rank}.tmp")
        torch.save(dict(snap), tmp)
        os.replace(tmp, os.path.join(self.directory, f"rank{rank}.{snap['seq'] % 2}"))

    def prepare_step(self, pending: list) -> None:
        """After the forward of a step's last micro-batch: this rank's part of the next commit.

        ``pending`` holds the step's ``(loss, num_samples)``; they are summed exactly as
        ``TrainState.record_batch`` will sum them after the step.
        """
        if not self.active:
            return
        state = self.trainer.state
        total = state.loss_sum.clone()
        count = state.sample_count
        for loss, n in pending:
            total += loss.detach().to(torch.float64) * n
            count += n
        self._prepare(total, count)

    def _prepare(self, loss_sum: torch.Tensor, count: int) -> None:
        snap = self._own_state(loss_sum, count)
        snap["seq"] = self.seq + 1
        self.prepared = snap
        self._write(snap)

    def prepare_epoch_end(self) -> None:
        """Once the epoch's end has made the buffers final (rank 0's, before the dev evaluation):
        this rank's part of the commit after the epoch (its running sums start again from 0)."""
        if self.active:
            self._prepare(torch.zeros((), dtype=torch.float64), 0)

    def commit(self, batch: int, prepared: bool, boundary: bool = True) -> None:
        """Right after an optimizer step or an epoch's end (``batch`` 0); ``prepared``: this rank's part
        was prepared ahead (False for a skipped step, whose losses are not added, and at ``fit``'s start);
        ``boundary``: a step boundary every rank of the job reaches (not ``fit``'s start, which a
        replacement skips), where the ranks may agree that a node let in is ready (:attr:`arrived`).
        """
        if not self.active:
            return
        trainer = self.trainer
        trainer.state.batch_in_epoch = batch
        if not prepared or self.prepared is None:
            self._prepare(trainer.state.loss_sum, trainer.state.sample_count)
        snap = self.prepared
        self.seq, self.snapshot, self.prepared = snap["seq"], snap, None
        self.layout = _layout(trainer.model) if self.rounds is None else None  # DDP's buckets at this commit
        pending = trainer.state._pending_loader_state  # a resumed position not yet given to the loader
        self.loader_state = pending if pending is not None else trainer._parts.parts["train_loader"].state_dict()
        self.pending_save = False
        if self.rounds is not None:
            self.rounds.at_commit(self.seq, snap, boundary)
        if boundary and self.admitting and (batch == 0 or trainer.state.global_step % ADMIT_EVERY_STEPS == 0):
            self._look_for_newcomers()

    def _look_for_newcomers(self) -> None:
        """Rank 0 asks the store whether a node let in is ready; one all-reduce tells every rank."""
        from dptrain.runtime import env

        ready = 0
        if self.trainer.rank == 0:
            ready = int(_regroup.newcomers_ready(env._STATE.store, env._STATE.generation))
        flag = torch.tensor([ready], dtype=torch.int32, device=self.trainer.device)
        comm.all_reduce(flag)
        self.arrived = bool(flag.item())

    def take_newcomers(self) -> None:
        """Before the next step (every rank at the same one): unwind to ``fit`` when a node is ready to join.

        The check itself ran at the commit; joining waits until here so that what follows a commit
        in the same step (a step checkpoint, callbacks) is done first.

        Raises:
            _NodeArrived: every rank agreed that a node let in is ready; ``fit`` recovers from it.
        """
        if self.arrived:
            raise _NodeArrived("a node let into the job is ready to join")

    def finish(self) -> None:
        """At the end of ``fit``: take a node that became ready at the last step boundary (it then
        joins the final evaluation), and tell one that is still starting, and the launchers, that
        the training is over (a rank that fails from now on is not replaced in place: the ranks it
        would join may have exited already)."""
        if not self.active:
            return
        for handle in self._watching:
            handle.remove()
        self._watching = []
        if self.admitting and self.arrived:
            self.recover(_NodeArrived("a node let into the job is ready to join"))
        if self.trainer.rank == 0:
            from dptrain.runtime import env

            with contextlib.suppress(Exception):
                env._STATE.store.set(_regroup.FINISHED, "1")

    @contextlib.contextmanager
    def saving(self):
        """Around a checkpoint due at the current commit: one that did not finish is written again."""
        self.pending_save = self.active
        yield
        self.pending_save = False

    def announce(self) -> None:
        """At ``fit``'s start: tell the launcher whether a failure can be recovered in place."""
        if not self.requested:
            return
        from dptrain.runtime import env

        trainer = self.trainer
        if self.active:
            if trainer.rank == 0:  # a fit after another: its failures are recovered in place again (see finish)
                with contextlib.suppress(Exception):
                    env._STATE.store.delete_key(_regroup.FINISHED)
            # "cuda": the launcher waits until a dead rank's device memory is freed before replacing it.
            env._STATE.store.set(f"recovery/capable/{trainer.rank}", "cuda" if torch.cuda.is_initialized() else "1")
            if not self._watching and _interrupt.install():  # see [Note: stopping a step at once]
                self._watching = _interrupt.watch_modules(trainer.model)
            if self.resizable:
                # DiLoCo goes on with fewer replicas but cannot take a new one in place (it would have no
                # replica of its own to start from): "shrink" tells the launcher to let a node in at the
                # next restart only (see dptrain.launcher.inplace).
                env._STATE.store.set(f"recovery/resizable/{trainer.rank}", SHRINK_ONLY if self.rounds else "1")
            if self.seq < 0:
                self.commit(trainer.state.batch_in_epoch, prepared=False, boundary=False)
        elif trainer.rank == 0 and not trainer.world.restart_count:  # once for the job, not per restart
            print(f"dptrain: --recovery in-place is not available to this job: {self.why_not}; a failure "
                  f"restarts the whole job from its newest checkpoint instead", file=sys.stderr, flush=True)

    # -- recovering ------------------------------------------------------------------------
    def can_recover(self, exc: BaseException) -> bool:
        if not self.active or not isinstance(exc, Exception):
            return False
        return isinstance(exc, _NodeArrived) or _is_peer_failure(exc)

    def recover(self, exc: BaseException) -> None:
        """A survivor's side: wait for the launcher's new generation, re-form the group, restore, go on.

        Raises ``exc`` again when no recovery is announced within :func:`_announcement_wait_s`.
        """
        from dptrain.runtime import env

        failed_at = time.time()
        _forget(exc)
        self._drop_step()
        try:
            generation = _regroup.wait_for_generation(env._STATE.store, env._STATE.generation, _announcement_wait_s())
        except TimeoutError:
            raise exc from None  # (a node that arrived has its generation announced already)
        self.arrived = False
        self._recover_at(generation, failed_at, reform=True)

    def join(self) -> None:
        """A replacement's side, at the end of the Trainer's construction: get the state from a live peer."""
        from dptrain.runtime import env

        self._recover_at(env._STATE.generation, None, reform=False)  # init() formed the group already

    def _recover_at(self, generation: int, failed_at: float | None, reform: bool) -> None:
        """Form ``generation``'s group (unless formed) and restore from it; when a member dies during
        that, start over at the next generation the launcher announces."""
        from dptrain.runtime import env

        while True:
            early = None
            try:
                if reform:
                    self._let_go()
                    generation = env._reform(generation)
                    early = self._pack_early(generation, failed_at)
                self._exchange_and_restore(generation, failed_at, early, reform)
                return
            except Exception as again:  # noqa: BLE001 - a member died during the recovery itself
                if early is not None:
                    early.discard()
                if not _is_peer_failure(again) and not isinstance(again, TimeoutError):
                    raise
                _forget(again)
                self._drop_step()
                try:
                    generation = _regroup.wait_for_generation(env._STATE.store, env._STATE.generation,
                                                              _announcement_wait_s())
                except TimeoutError:
                    raise again from None
                reform = True

    def _let_go(self) -> None:
        """Drop every reference to the broken process group before it is destroyed.

        gloo closes a group's connections only when nothing references it any more; a peer
        blocked in one of its collectives with this (live) rank learns of the failure only
        then -- otherwise it would wait for the whole collective timeout.
        """
        from dptrain import _shm

        # A shared-memory collective that a live peer will never issue (it failed elsewhere first)
        # is abandoned now instead of at the collective timeout.
        _shm.abort_all("in-place recovery re-forms the process group")
        if hasattr(self.trainer.model, "_leave_group"):
            self.trainer.model._leave_group()  # its reducer's works in flight hold the group too
        if self.rounds is not None:
            self.rounds.diloco._drop_in_flight()  # DiLoCo's exchanges in flight hold it too
        # What else still holds the group (a work in a reference cycle) no longer matters to the
        # peers: its connections are shut down before it is destroyed (see dptrain.runtime.regroup).

    def _drop_step(self) -> None:
        """Forget the step in flight: its gradients (some perhaps half-reduced) and a half-done unscale."""
        trainer = self.trainer
        trainer.optimizer.zero_grad(set_to_none=True)
        for p in trainer.model.parameters():
            p.grad = None
        if trainer.scaler is not None:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state
            from collections import defaultdict

            trainer.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _status(self, failed_at: float | None, snapshots: dict[int, _Snapshot], any_commit: bool) -> dict:
        """What a member says of itself in the one exchange that starts a recovery: whether it is new,
        its last commit, and which commits it holds its own part of (``any_commit``: a newcomer, which
        can make its part of whatever commit the survivors reached)."""
        from dptrain import _shm

        return {"rank": self.trainer.rank, "replacement": failed_at is None and self.seq < 0, "seq": self.seq,
                "has": sorted(snapshots), "any": any_commit, "failed_at": failed_at, "pid": os.getpid(),
                "node": _shm.node_identity()}

    def _snapshots(self) -> tuple[dict[int, _Snapshot], bool]:
        """This rank's parts of the commits it can recover to, by commit number, and whether it is a
        newcomer (see :meth:`_newcomer`). A survivor holds its last commit's and perhaps the next one's;
        a replacement reads its rank's files, which the dead process wrote (read already, most
        often, while it waited for the others in ``dptrain.init``: see ``_read_ahead``)."""
        held = {s["seq"]: s for s in (self.snapshot, self.prepared) if s is not None}
        if self.seq >= 0 or not self.directory:
            return held, False
        files = _READ_AHEAD.pop((self.directory, self.trainer.rank), None)
        if files is None:
            files = _read_snapshots(self.directory, self.trainer.rank)
        held.update(files)
        return held, self._newcomer()

    def _likely_source(self, generation: int) -> bool:
        """Whether this survivor will most likely send the state: the lowest rank that the launcher did
        not replace in ``generation`` (the source is the lowest survivor at the newest commit, and the
        survivors' commits differ only when a failure came between a step's all-reduce finishing on some
        ranks and not on others). Only a guess, which decides whether to pack the state early."""
        from dptrain.runtime import env

        said = _regroup.announcement(env._STATE.store, generation)
        gone = said.get("rank")
        if said.get("kind") == "resize" or not isinstance(gone, int):
            return False
        return self.trainer.rank == min(r for r in range(self.trainer.world.world_size) if r != gone)

    def _newcomer_snapshot(self, target: int) -> _Snapshot:
        """A newcomer's part of commit ``target``: a rank that never trained has its own RNG streams, no
        share of the epoch's running loss, and the buffers the source sends with the weights (an empty
        dict keeps them)."""
        snap = self._own_state(torch.zeros((), dtype=torch.float64), 0)
        snap.update(seq=target, buffers={})
        return snap

    def _newcomer(self) -> bool:
        """Whether this process started as a rank of a node let into the running job (see [Note: a node
        coming back] in dptrain.launcher.resize)."""
        from dptrain.runtime import env

        said = _regroup.announcement(env._STATE.store, _settings.get("DPTRAIN_GENERATION"))
        return said.get("kind") == "resize" and bool(said.get("joining"))

    def _shared_state(self) -> dict:
        """What the source sends: the state every rank shares at its last commit."""
        t = self.trainer
        state = {
            "seq": self.seq,
            "model": t.strategy.model_state_dict(t.model, rank0_only=False),
            "optimizer": t.strategy.optimizer_state_dict(t.optimizer),
            "train_state": t.state.state_dict(),
            "loader": self.loader_state,
            "callbacks": t._parts.parts["callbacks"].state_dict(),
            "best_state": t.best_state,
            "checkpoints": sorted(t.checkpointer._ours),
            "pending_save": self.pending_save,
            "ddp_layout": self.layout,
            "world_size": t.world.world_size,
        }
        if t.scheduler is not None:
            state["scheduler"] = t.scheduler.state_dict()
        if t.scaler is not None:
            state["scaler"] = t.scaler.state_dict()
        return state

    def _pack_early(self, generation: int, failed_at: float | None) -> "_transfer.PackedEarly | None":
        """A survivor that will most likely send the state starts packing it, on a thread, once the
        group is re-formed (see :class:`_transfer.PackedEarly`); None for the others."""
        if failed_at is None or self.rounds is not None or not self._likely_source(generation):
            return None
        t = self.trainer
        return _transfer.PackedEarly(self._shared_state, self.directory, _transfer.transfer_device(), t.model,
                                     t.world.world_size)

    def _exchange_and_restore(self, generation: int, failed_at: float | None,
                              early: "_transfer.PackedEarly | None" = None, reformed: bool = True) -> None:
        from dptrain.runtime import env

        if self.rounds is not None:
            self.rounds.recover(generation, failed_at, reformed)
            return
        t = self.trainer
        # One exchange decides it all (every member computes the same from the same list): the target,
        # its source, and whether every member holds its own part of the target.
        snapshots, newcomer = self._snapshots()
        statuses = comm.all_gather_object(self._status(failed_at, snapshots, newcomer))
        survivors = [s for s in statuses if not s["replacement"]]
        if not survivors:
            self._fall_back("every rank of the job is new, so no live rank holds the training state")
        target = max(s["seq"] for s in survivors)
        source = min(s["rank"] for s in survivors if s["seq"] == target)
        mine = snapshots.get(target)
        if mine is None and newcomer:
            mine = self._newcomer_snapshot(target)
        lacking = [s["rank"] for s in statuses if target not in s["has"] and not s["any"]]
        if lacking:
            self._fall_back(f"rank(s) {lacking} have no record of their RNG streams and buffers at commit {target}, "
                            f"so the run could not go on bit for bit")
        # A survivor that will most likely be the source packed its state on a thread while it waited in
        # the exchange for the replacement (``early``, see _pack_early): off the path from the failure to
        # the next step. A failed packing is redone below, by the source alone.
        ahead = early.take() if early is not None else None
        if t.rank != source and ahead is not None:
            _transfer.remove(ahead[4])
            ahead = None  # a wrong guess: its buffer goes before another one is received
        started = time.perf_counter()
        if t.rank == source and ahead is None:
            ahead = _transfer.pack_state(self._shared_state(), self.directory)
        source_node = next(s["node"] for s in statuses if s["rank"] == source)
        one_node = all(s["node"] == source_node for s in statuses)
        shared, how = _transfer.broadcast_state(ahead, source, t.rank, one_node)
        del ahead
        transfer_s = time.perf_counter() - started
        if shared["ddp_layout"] is None:
            self._fall_back(f"rank {source}'s DDP cannot be carried over yet (compression='auto' is still measuring)")
        t.model._rejoin(shared["ddp_layout"])
        world = env.get_world()
        if (world.rank, world.world_size) != (t.rank, t.world.world_size):
            resize.move_to(t, world)
        # The commit's world size (a newcomer's own never changed, but the schedule was planned on that one).
        resized_from = shared["world_size"] if shared["world_size"] != world.world_size else None
        self._restore(shared, mine, source, resized_from)
        self.recoveries += 1
        if t.rank == 0:
            self._say(generation, statuses, shared, source, (how, transfer_s), resized_from)
        env._STATE.store.set(f"recovery/done/{generation}", "1")
        if t.rank != source:  # its weights are views of the source's file, when they came through /dev/shm
            _transfer.release_later([shared.pop("model")])

    def _restore(self, shared: dict, mine: _Snapshot, source: int, resized_from: int | None) -> None:
        t = self.trainer
        where = f"rank {source} (in-place recovery)"
        if t.rank != source:
            t.strategy.load_model_state_dict(t.model, shared["model"], source=where)
            t.strategy.load_optimizer_state_dict(t.optimizer, shared["optimizer"])
        if t.scheduler is not None and "scheduler" in shared:
            if resized_from is not None:
                # Every rank, the source too: on another world size the schedule is re-planned from the
                # progress, as a checkpoint resumed on another world size does (see schedule.py).
                t._parts.scheduler.saved_world_size = resized_from
                t._parts.scheduler.load_state_dict(shared["scheduler"])
            elif t.rank != source:
                t.scheduler.load_state_dict(shared["scheduler"])
        if t.rank != source:
            if t.scaler is not None and "scaler" in shared:
                t.scaler.load_state_dict(shared["scaler"])
            t._parts.parts["callbacks"].load_state_dict(shared["callbacks"])
            t.best_state = shared["best_state"]
        self._drop_step()
        t.state.load_state_dict(shared["train_state"])
        t.state.set_loader_position(shared["loader"])
        t.checkpointer._ours = set(shared["checkpoints"])
        # This rank's own part of the commit, as a checkpoint's per-rank entry is restored: RNG (applied
        # where begin_epoch applies a resumed one), running sums, buffers.
        per_rank: list = [None] * t.world.world_size
        per_rank[t.rank] = mine
        t._parts.parts["per_rank"].load_state_dict(per_rank)
        self.seq, self.snapshot, self.prepared = shared["seq"], mine, None
        if resized_from is not None:
            self._write(mine)  # under this rank's new number, for a replacement of it before the next commit
        self.loader_state, self.layout = shared["loader"], shared["ddp_layout"]
        if t.state.global_step > 0:
            t.optimizer._opt_called = True  # the run has stepped: an LR scheduler's step is in order
        self.pending_save = bool(shared["pending_save"])

    def _say(self, generation: int, statuses: list[dict], shared: dict, source: int, transfer: tuple[str, float],
             resized_from: int | None) -> None:
        """The one line a recovery leaves in the log (rank 0); ``transfer``: how the state came, in how long."""
        from dptrain.runtime import env

        said = _regroup.announcement(env._STATE.store, generation)
        progress = shared["train_state"]
        route, transfer_s = transfer
        new = [s["rank"] for s in statuses if s["replacement"]]
        since = [s["failed_at"] for s in statuses if s["failed_at"] is not None]
        waited = f"{time.time() - min(since):.2f} s" if since else "?"
        if resized_from is not None:
            joined = f"; rank(s) {', '.join(map(str, new))} joined with it" if new else ""
            print(
                f"dptrain: {'recovered in place' if said.get('lost') else 'grew in place'} (generation {generation}): "
                f"{said.get('why', 'the nodes changed')}, at step {progress['global_step']} (epoch "
                f"{progress['epoch'] + 1}, batch {progress['batch_in_epoch']}); "
                + (f"the survivors waited {waited}; " if since and said.get("lost") else "") + f"the job goes on with "
                f"{self.trainer.world.world_size} ranks instead of {resized_from}, the rest of the epoch shared out "
                f"anew among them as on a resume at another world size; state from rank {source} {route} in "
                f"{transfer_s:.3f} s{joined}; no process was restarted and no checkpoint was read",
                file=sys.stderr, flush=True,
            )
            return
        size = sum(v.numel() * v.element_size() for v in shared["model"].values())
        who = f"rank {said.get('rank', '?')}" + (f" (pid {said['pid']})" if said.get("pid") else "")
        why = said.get("why", "failed")
        joined = ", ".join(f"rank {r}" for r in new) or "no new rank"
        how = ("a hot spare" if said.get("spare") else
               "a process forked from the warm template" if said.get("forked") else "a new process")
        print(
            f"dptrain: recovered in place (generation {generation}): {who} {why}, at step {progress['global_step']} "
            f"(epoch {progress['epoch'] + 1}, batch {progress['batch_in_epoch']}); the survivors waited {waited}; "
            f"{joined} ({how}) got the weights, optimizer and progress from rank {source} {route} "
            f"({size / 2**20:.2f} MiB of weights in {transfer_s:.3f} s) and its RNG streams and buffers from its "
            f"rank's step snapshot; no checkpoint was read",
            file=sys.stderr, flush=True,
        )

    def _fall_back(self, why: str) -> None:
        """In-place recovery cannot be exact: have the launcher restart the whole job instead."""
        from dptrain import _shm
        from dptrain.runtime import env

        _shm.discard_ahead()  # os._exit below: nothing else would remove it before the launcher does
        message = f"in-place recovery is not possible: {why}; restarting the whole job from its newest checkpoint"
        with contextlib.suppress(Exception):
            env._STATE.store.set(_regroup.FALLBACK, message)
        print(f"dptrain: rank {self.trainer.rank}: {message}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(FALLBACK_EXIT)  # no clean shutdown: the group is in an unknown state
