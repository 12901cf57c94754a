"""The Checkpointer: everything about the Trainer's checkpoint directory.

It owns the directory's layout (``ckpt-e<epoch>-s<step>.pt``, ``best.pt``, the shard files
of sharded optimizer state), writes atomically and agrees with every rank on the outcome,
prunes old checkpoints, and chooses what a run resumes from. What goes into a checkpoint is
a dict of *stateful* objects -- anything with ``state_dict()`` / ``load_state_dict()`` --
handed over by the Trainer; an object whose ``sharded`` attribute is true is written by
every rank into a file of its own, the others by rank 0 into the checkpoint itself.

[Note: a save is a collective]
Every rank calls :meth:`Checkpointer.save`. Sharded parts are written first, each by its
rank; the ranks then agree (one small gather) that all of them succeeded; rank 0 writes
the checkpoint (the commit point: its atomic rename makes the set complete) and tells the
others how that went. A failure anywhere -- a full disk, an unwritable file -- is raised on
every rank with the same message, so no rank waits for a peer that gave up, and nothing is
pruned: the newest complete checkpoint stays.

[Note: whose files these are]
A checkpoint directory can hold files that are not this run's: an earlier run's checkpoints,
a file cut short, something else under a checkpoint's name. A run never deletes them, and
none of them decides what it keeps or resumes from:

* A fresh start (no resume), or a resume from a file outside the directory, moves an
  earlier run's checkpoints, their shard files and ``best.pt`` into a folder of their own,
  ``previous-run-<when>`` (when: the time of its newest file), one folder per earlier run.
  A job the launcher restarted resumes, so it never moves its own checkpoints -- and only its
  own: a checkpoint names the job that wrote it (``job``, see ``job_identity``). A restart
  whose first attempt died before its Trainer was built finds another job's checkpoint
  newest, and starts fresh as that attempt would have, moving the earlier run aside.
* A resume moves the checkpoints newer than the one it continues from -- files that could not
  be read, or a run that went further from an earlier point -- into ``set-aside/``.
* Pruning counts only this run's readable checkpoints (those it wrote, and older ones that
  look whole), never deletes the one just written, and first moves into ``set-aside/`` any
  file under a checkpoint's name that is ahead of this run or, when ``keep_last`` counts,
  cannot be read.

Only rank 0 moves files, each move with a one-line notice; a fresh start's move is agreed with
the other ranks (they wait for it, and raise the same error if it fails).

[Note: config.yaml]
A script that reads its settings with :func:`dptrain.train.parse_config` (a YAML file plus
command-line overrides) gets them written beside its checkpoints: when the run starts
(:meth:`Checkpointer.prepare`), rank 0 writes the resolved settings (``cli_config.resolved()``)
as ``config.yaml``, atomically and through no link, and ``--config config.yaml`` runs the same
settings again. A ``config.yaml`` already there that holds the same settings is left as it is
(a resumed or restarted run). One that differs -- or that is not a plain file: a link, a
folder -- is kept, renamed ``config-<when>.yaml`` (when: the time it was written); if this run
starts fresh and moves an earlier run's checkpoints into ``previous-run-<when>``, that earlier
``config.yaml`` goes with them (a copy, when its settings were this run's). Nothing is
deleted. Without ``parse_config`` no ``config.yaml`` is written: each checkpoint holds the
TrainerConfig anyway (its ``config`` entry).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import Any, Mapping

from dptrain import checkpoint as ckpt
from dptrain import comm, env
from dptrain.train import _config_file, cli_config
from dptrain.train._config_file import CONFIG_NAME
from dptrain.train.report import on_every_rank

__all__ = ["Checkpointer", "CHECKPOINT_FORMAT", "job_identity", "notice"]

#: ``format`` of a Trainer checkpoint. Version 1 (one dict with the progress at the top
#: level and every rank's FSDP optimizer shard inside) and version 2 (epochs in the history
#: and the best epoch counted from 0) are still read.
CHECKPOINT_FORMAT = "dptrain.trainer/3"
_FORMAT_V2 = "dptrain.trainer/2"
_FORMAT_V1 = "dptrain.trainer/1"
BEST_NAME = "best.pt"
#: Where a fresh run moves an earlier run's checkpoints: ``previous-run-<when>``, one folder per run.
PREVIOUS_RUN = "previous-run"
#: Where files under a checkpoint's name that are not this run's go (see [Note: whose files these are]).
SET_ASIDE = "set-aside"


def job_identity() -> str | None:
    """What names this job across its restarts (written into its checkpoints as ``job``), or None.

    Slurm's job id (a requeue keeps it), else the launcher's run id (``TORCHELASTIC_RUN_ID``:
    ``dptrain run`` draws one per invocation unless ``--rdzv-id`` names it, and so does
    ``torchrun --standalone``). torchrun's default ``none`` and ``dptrain.spawn``'s ``spawn``
    name no job.
    """
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm:{slurm}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"run:{run}" if run and run not in ("none", "spawn") else None


def notice(message: str) -> None:
    """A one-line message to the user, from rank 0 only, on stderr (never lost in warnings filters)."""
    if env.get_world().rank == 0:
        print(f"dptrain: {message}", file=sys.stderr, flush=True)


def _agree(error: tuple[str, str] | None) -> tuple[str, str] | None:
    """Every rank's outcome of a step, gathered: the first failure (naming its rank), or None."""
    outcomes = comm.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if not failed:
        return None
    r, (kind, text) = failed[0]
    return (kind, text if len(outcomes) == 1 else f"rank {r}: {text}")


def _order(path: str) -> tuple[int, int] | None:
    """(step, epoch) of a checkpoint's name, the order in which a run writes them; None for another name."""
    m = ckpt._NAME_RE.match(os.path.basename(path))
    return (int(m.group(2)), int(m.group(1))) if m else None


def _tagged(name: str, tag: str) -> str:
    root, ext = os.path.splitext(name)
    return f"{root}{tag}{ext}"


def _describe(exc: BaseException) -> tuple[str, str]:
    # The kind travels to the other ranks, which raise the same class with the same errno.
    if isinstance(exc, ckpt.CheckpointWriteError):
        kind = f"{'space' if isinstance(exc, ckpt.CheckpointSpaceError) else 'write'}:{exc.errno or 0}"
    else:
        kind = "error"
    return kind, (str(exc) if isinstance(exc, ckpt.CheckpointError) else f"{type(exc).__name__}: {exc}")


class Checkpointer:
    """Checkpoint directory of a run: names, atomic collective saves, pruning, best model, resume choice.

    Args:
        directory: the checkpoint directory, or None (no checkpoints; saving needs a path).
        keep_last: keep only the newest K checkpoints (0: all).
        rank, world_size: this process's place in the job.
    """

    def __init__(self, directory: str | None, keep_last: int, rank: int, world_size: int) -> None:
        self.directory = os.fspath(directory) if directory is not None else None
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self._ours: set[str] = set()  # names of this run's checkpoints known to be readable
        self._restarted = False  # resuming only because the launcher restarted the job (resume=None)
        self._earlier_config: str | None = None  # where prepare() kept a config.yaml that was there before
        self._config_text: str | None = None  # config.yaml as it was already, with this run's settings
        self._config_notice: str | None = None  # said once the start is decided (a fresh start moves the file)

    # -- layout -----------------------------------------------------------------------
    def path_for(self, epoch: int, step: int) -> str:
        if not self.directory:
            raise ValueError("saving a checkpoint needs a path, or TrainerConfig(checkpoint_dir=...)")
        return ckpt.checkpoint_path(self.directory, epoch, step)

    @property
    def best_path(self) -> str | None:
        return os.path.join(self.directory, BEST_NAME) if self.directory else None

    def newest(self) -> str | None:
        """The newest checkpoint of the directory that looks whole (see ``checkpoint._unusable``), or None."""
        if not self.directory:
            return None
        return next((p for p in reversed(ckpt.list_checkpoints(self.directory)) if ckpt._unusable(p) is None), None)

    # -- start of a run ---------------------------------------------------------------
    def prepare(self) -> None:
        """Clean what an interrupted save left and check, before any training, that the
        directory can be written (every rank raises the same error if not); warn when other
        users can write it too."""
        if not self.directory:
            return
        error = None
        if self.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                ckpt.remove_stale_temporaries(self.directory)
                with ckpt._open_temp(self.directory, "write-probe") as probe:  # follows no planted link
                    probe.write(b"dptrain")
                os.remove(probe.name)
            except OSError as exc:
                error = (
                    f"checkpoint_dir {self.directory!r} cannot be written ({type(exc).__name__}: {exc.strerror or exc}); "
                    f"found before training started. Pass a writable TrainerConfig(checkpoint_dir=...)"
                )
            if error is None:
                error = self._write_config()
        error = comm.broadcast_object(error, src=0)
        if error:
            raise on_every_rank(ckpt.CheckpointError(error))
        if self.rank == 0:
            self._warn_if_others_can_write()

    def _write_config(self) -> str | None:
        """Rank 0: write parse_config's settings as config.yaml (see [Note: config.yaml]); an error, or None."""
        config = cli_config.resolved()
        if config is None:
            return None
        path = os.path.join(self.directory, CONFIG_NAME)
        text = _config_file.render(config)
        self._earlier_config = self._config_text = None
        try:
            if _config_file.holds(path, config, text):
                self._config_text = text
                return None
            if os.path.lexists(path):
                self._earlier_config = _config_file.keep_aside(path)
            ckpt._atomic_write(path, lambda f: f.write(text.encode()))
        except OSError as exc:
            return (f"writing the run's settings to {path!r} failed ({exc}); found before training started. Pass a "
                    f"writable TrainerConfig(checkpoint_dir=...)")
        if self._earlier_config:
            self._config_notice = (f"{path!r} held other settings than this run's; they were kept as "
                                   f"{self._earlier_config!r} (nothing is deleted), and this run's were written to "
                                   f"{CONFIG_NAME}")
        return None

    def _say_config_kept(self) -> None:
        """The notice of a config.yaml kept under another name, once the start is decided: a fresh
        start moves it with the earlier run's checkpoints and says so instead."""
        if self._config_notice:
            notice(self._config_notice)
            self._config_notice = None

    def _warn_if_others_can_write(self) -> None:
        # Someone who can write the directory can plant a checkpoint that a resume loads (on
        # torch < 2.10 one that runs code, see checkpoint.py's [Note: weights_only on older
        # torch]) or replace one; the temporary files are safe from them, the rest is not.
        st = os.stat(self.directory)
        if st.st_mode & stat.S_IWOTH:
            who = f"every user ({stat.filemode(st.st_mode)})"
        elif hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0):
            who = f"its owner, uid {st.st_uid}, another user"
        else:
            return
        notice(
            f"checkpoint_dir {self.directory!r} can be written by {who}: someone else could put a file there that a "
            f"resume loads, or replace a checkpoint. Use a directory that only you can write (chmod o-w, or another "
            f"checkpoint_dir)"
        )

    # -- saving -----------------------------------------------------------------------
    def save(self, states: Mapping[str, Any], path: str | None = None, *, epoch: int = 0, step: int = 0,
             prune: bool = True) -> str:
        """Write ``states`` (a dict of stateful objects or plain values) as one checkpoint.

        Collective: call it on every rank (see [Note: a save is a collective]). Returns the
        checkpoint's path.

        Raises:
            CheckpointError: writing failed on some rank (every rank raises the same
                message; the files already there are kept). CheckpointSpaceError for a full disk.
        """
        path = os.fspath(path) if path is not None else self.path_for(epoch, step)
        main: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "world_size": self.world_size, "job": job_identity()}
        shards: dict[str, Any] = {}
        for name, obj in states.items():
            value = obj.state_dict() if hasattr(obj, "state_dict") else obj
            if getattr(obj, "sharded", False):
                shards[name] = value
            else:
                main[name] = value
        main["sharded"] = sorted(shards)
        error = None
        if shards:
            try:
                ckpt.save(shards, ckpt.shard_path(path, self.rank, self.world_size))
            except Exception as exc:  # noqa: BLE001 - agreed with the other ranks below
                error = _describe(exc)
            error = _agree(error)
        if error is None and self.rank == 0:
            try:
                ckpt.save(main, path)
                if prune and self._holds(path):
                    self._prune(path)
            except Exception as exc:  # noqa: BLE001 - broadcast to the other ranks below
                kind, text = _describe(exc)
                error = (kind, text if self.world_size == 1 else f"rank 0: {text}")
        error = comm.broadcast_object(error, src=0)
        if error is not None:
            if self.rank == 0 and shards:
                for r in range(self.world_size):
                    try:
                        os.remove(ckpt.shard_path(path, r, self.world_size))
                    except OSError:
                        pass
            newest = self.newest()
            kept = f" The newest complete checkpoint is {newest!r}." if newest else ""
            kind, text = error
            cls, _, code = kind.partition(":")
            err_type = {"space": ckpt.CheckpointSpaceError, "write": ckpt.CheckpointWriteError}.get(
                cls, ckpt.CheckpointError)
            exc = err_type(f"saving checkpoint {path!r} failed ({text}).{kept}")
            if code:
                exc.errno = int(code) or None  # as the OSError it also is
            raise on_every_rank(exc)
        self._ours.add(os.path.basename(path))
        return path

    def _holds(self, path: str) -> bool:
        """Whether ``path`` is a file directly in the checkpoint directory."""
        return bool(self.directory) and (
            os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(self.directory))

    def _prune(self, written: str) -> None:
        """Rank 0, after writing ``written``: move aside what is not this run's, then delete this
        run's oldest checkpoints beyond ``keep_last`` (see [Note: whose files these are])."""
        mine = _order(written)  # None: a name of the caller's (save_checkpoint(path)), not counted
        ours = []
        for path in ckpt.list_checkpoints(self.directory):
            name = os.path.basename(path)
            if name == os.path.basename(written):
                continue
            if name in self._ours:
                ours.append(path)
                continue
            ahead = mine is not None and _order(path) > mine
            why = ckpt._unusable(path) if ahead or self.keep_last > 0 else None
            if why is None and ahead:
                why = f"is ahead of this run (step {_order(path)[0]}; this run just wrote step {mine[0]})"
            if why:
                self._set_aside(path, why)
                continue
            self._ours.add(name)
            ours.append(path)
        if self.keep_last > 0:
            others = self.keep_last - 1 if mine is not None else self.keep_last
            for path in ours[: max(0, len(ours) - others)]:
                for part in ckpt._shards_of(self.directory, os.path.basename(path)) + [path]:  # the checkpoint last
                    try:
                        os.remove(part)
                    except FileNotFoundError:
                        pass
                self._ours.discard(os.path.basename(path))

    def _set_aside(self, path: str, why: str) -> None:
        """Rank 0: move a file under a checkpoint's name that is not this run's (and its shard
        files) into set-aside/, with a notice. A failure leaves it in place, said too."""
        folder = os.path.join(self.directory, SET_ASIDE)
        name = os.path.basename(path)
        parts = ckpt._shards_of(self.directory, name) + [path]
        try:
            os.makedirs(folder, exist_ok=True)
            tag, n = "", 1
            while any(os.path.lexists(os.path.join(folder, _tagged(os.path.basename(p), tag))) for p in parts):
                n += 1
                tag = f".{n}"
            for part in parts:
                os.replace(part, os.path.join(folder, _tagged(os.path.basename(part), tag)))
        except OSError as exc:
            notice(f"{path!r} {why}; moving it aside failed ({exc.strerror or exc}), so it is left in place, not "
                   f"counted by keep_last")
            return
        notice(f"moved {path!r} to {os.path.join(folder, _tagged(name, tag))!r} (nothing is deleted): it {why}. "
               f"It is not counted by keep_last, and a resume does not pick it")

    def save_best(self, payload: dict[str, Any]) -> None:
        """Write ``best.pt`` (rank 0; not collective: the best model is known on every rank)."""
        if self.directory and self.rank == 0:
            ckpt.save(payload, self.best_path)

    def load_best(self) -> dict[str, Any] | None:
        path = self.best_path
        if path and os.path.exists(path):
            return ckpt.load(path, map_location="cpu")
        return None

    # -- choosing what to resume from ----------------------------------------------------
    def resume_candidates(self, resume: Any, restart_count: int) -> list[str]:
        """The checkpoints to try, best first, for ``Trainer(resume=...)``; [] for a fresh start.

        ``resume=path``: that file (missing: FileNotFoundError). ``"auto"``/True: the
        checkpoints of the directory, newest first (none: a loud notice). None: like
        ``"auto"`` when the launcher restarted the job, else a fresh start. False: a fresh
        start. A fresh start in a directory that holds an earlier run's checkpoints moves
        them aside first, so the two runs never mix (see [Note: whose files these are]).
        Collective.
        """
        if resume is None:
            # A job the launcher restarted continues where it stopped -- if it keeps checkpoints.
            resume = "auto" if restart_count > 0 and self.directory else False
            self._restarted = resume == "auto"
        if resume is True or resume == "auto":
            if not self.directory:
                raise ValueError("resume='auto' needs TrainerConfig(checkpoint_dir=...) to look for checkpoints")
            # Rank 0 lists, so every rank tries the same files in the same order.
            found = comm.broadcast_object(ckpt.list_checkpoints(self.directory) if self.rank == 0 else None, src=0)
            if not found:
                notice(
                    f"resume requested but no checkpoint was found in {self.directory!r}; training from scratch "
                    f"(check --model_dir / checkpoint_dir if you expected to continue)"
                )
                self._say_config_kept()
            return list(reversed(found))
        if resume is not False:
            path = os.fspath(resume)
            if not os.path.exists(path):
                raise FileNotFoundError(f"resume={path!r}: no such checkpoint file; check the path (or pass resume='auto')")
            return [path]
        self._move_aside_earlier_run("starting fresh")
        self._say_config_kept()
        return []

    def _move_aside_earlier_run(self, doing: str) -> None:
        """Collective: rank 0 moves an earlier run's files into previous-run-<when>/; every rank
        raises the same error if that fails (a run must not mix with another's files)."""
        if not self.directory:
            return
        error = None
        if self.rank == 0:
            try:
                self._move_earlier_run(doing)
            except OSError as exc:
                error = (
                    f"checkpoint_dir {self.directory!r} holds an earlier run's checkpoints and moving them aside "
                    f"failed ({type(exc).__name__}: {exc}); nothing was deleted. Pass another checkpoint_dir, or "
                    f"resume='auto' to continue that run"
                )
        error = comm.broadcast_object(error, src=0)
        if error:
            raise on_every_rank(ckpt.CheckpointError(error))

    def _move_earlier_run(self, doing: str) -> None:
        found = ckpt.list_checkpoints(self.directory)
        parts = [p for old in found for p in ckpt._shards_of(self.directory, os.path.basename(old)) + [old]]
        if os.path.lexists(self.best_path):
            parts.append(self.best_path)
        if not parts:
            return
        # Named for when that run wrote its newest file, so a listing reads as a history.
        when = time.strftime("%Y%m%dT%H%M%S", time.localtime(max(os.lstat(p).st_mtime for p in parts)))
        aside, n = os.path.join(self.directory, f"{PREVIOUS_RUN}-{when}"), 1
        while True:
            try:
                os.mkdir(aside)
                break
            except FileExistsError:
                n += 1
                aside = os.path.join(self.directory, f"{PREVIOUS_RUN}-{when}-{n}")
        for part in parts:
            os.replace(part, os.path.join(aside, os.path.basename(part)))
        settings = ""
        if self._earlier_config and os.path.lexists(self._earlier_config):
            # The settings of the run just moved (config.yaml held other settings than this run's).
            os.replace(self._earlier_config, os.path.join(aside, CONFIG_NAME))
            self._earlier_config, self._config_notice, settings = None, None, f" with its {CONFIG_NAME}"
        elif self._config_text is not None:  # that run had the same settings: it keeps a copy of them
            ckpt._atomic_write(os.path.join(aside, CONFIG_NAME), lambda f: f.write(self._config_text.encode()))
            settings = f" with a copy of its {CONFIG_NAME}"
        kept = sum(1 for d in os.listdir(self.directory) if d.startswith(PREVIOUS_RUN))
        many = ""
        if kept > 1:
            many = f"; {kept} earlier runs are kept in {self.directory!r}, delete those you no longer need"
        if found:
            newest = os.path.join(aside, os.path.basename(found[-1]))
            how = (f"To continue that run instead, pass resume={newest!r}, or move the files back and pass "
                   f"resume='auto' (the examples' --resume)")
        else:
            how = "To keep runs apart, give each its own checkpoint_dir"
        notice(
            f"checkpoint_dir {self.directory!r} held checkpoints of an earlier run; {doing}, so they were moved to "
            f"{aside!r}{settings} (nothing is deleted{many}). {how}"
        )

    def _continue_from(self, path: str) -> None:
        """Collective, once a resume read ``path``: what is newer in the directory goes to set-aside/;
        a checkpoint from elsewhere starts the directory afresh (see [Note: whose files these are])."""
        if not self.directory:
            return
        if not self._holds(path):
            self._move_aside_earlier_run(f"resuming from {path!r}, outside it")
            self._say_config_kept()
            return
        self._say_config_kept()
        self._ours.add(os.path.basename(path))
        if self.rank == 0 and _order(path) is not None:
            for newer in ckpt.list_checkpoints(self.directory):
                if _order(newer) > _order(path):
                    self._set_aside(newer, f"is newer than {os.path.basename(path)}, which this run resumes from")

    # -- loading ----------------------------------------------------------------------
    def read(self, path: str, map_location: Any) -> dict[str, Any]:
        """Read checkpoint ``path`` and this rank's shard file, as one dict (no collective).

        Raises:
            FileNotFoundError, CheckpointError: a file is missing, truncated or corrupt.
            ValueError: the file is not a Trainer checkpoint, or its sharded parts were
                written by another number of ranks.
        """
        state = ckpt.load(path, map_location=map_location)
        fmt = state.get("format") if isinstance(state, Mapping) else None
        if fmt == _FORMAT_V1:
            return _from_format_v2(_from_format_v1(state, self.rank, self.world_size, path))
        if fmt not in (CHECKPOINT_FORMAT, _FORMAT_V2):
            raise ValueError(
                f"{path!r} is not a dptrain Trainer checkpoint (format {fmt!r}); to load bare weights use "
                f"dptrain.checkpoint.load_model_state(model, dptrain.checkpoint.load(path))"
            )
        if state.get("sharded"):
            saved_world = int(state["world_size"])
            if saved_world != self.world_size:
                raise ValueError(
                    f"rank {self.rank}: {path!r} holds {state['sharded']} sharded over {saved_world} ranks but this "
                    f"job has {self.world_size}; resume it with {saved_world} ranks (its weights load anywhere: "
                    f"dptrain.checkpoint.load(path)['model'])"
                )
            state.update(ckpt.load(ckpt.shard_path(path, self.rank, saved_world), map_location=map_location))
        return _from_format_v2(state) if fmt == _FORMAT_V2 else state

    @staticmethod
    def _another_jobs(state: Mapping) -> bool:
        """Whether checkpoint ``state`` was written by another job than this one. A job's name is
        the same in all its attempts, so a checkpoint that names another one (or says that no name
        was known) is another job's. Where nothing names this job, or the checkpoint was written
        before checkpoints named their job, it may be this job's and counts as such: a restart
        resumes it, as it always did."""
        me = job_identity()
        return me is not None and "job" in state and state["job"] != me

    def read_first_readable(self, candidates: list[str], map_location: Any) -> tuple[str | None, dict | None]:
        """Read the first candidate every rank can read; name each one skipped and why.

        Collective. A candidate that some rank cannot read (truncated, corrupt, a shard
        file missing) is skipped -- never deleted -- with a notice naming it. Returns
        ``(None, None)`` for no candidates, and where a restart (``resume=None``) finds that
        the first readable one is another job's: that run is moved aside, and this one starts
        fresh (see [Note: whose files these are]).

        Raises:
            CheckpointError: none of the candidates could be read (each one is listed).
        """
        skipped: list[tuple[str, str]] = []  # (path, why)
        for path in candidates:
            state, error = None, None
            try:
                state = self.read(path, map_location)
            except (OSError, ckpt.CheckpointError) as exc:
                error = _describe(exc)
            error = _agree(error) if self.world_size > 1 else error
            if error is None:
                if self._restarted and self._another_jobs(state):
                    notice(f"this job ({job_identity()}) was restarted before its first attempt wrote a checkpoint: "
                           f"the newest one in {self.directory!r} is another job's ({state['job']}), so it starts "
                           f"fresh, as that attempt did, instead of continuing that run")
                    self._move_aside_earlier_run("starting fresh")
                    return None, None
                if skipped:
                    notice(f"resuming from {path!r} instead")
                self._continue_from(path)
                return path, state
            skipped.append((path, error[1]))
            if len(candidates) > 1:
                notice(f"skipping checkpoint {path!r}, which cannot be read ({error[1]}); it is not deleted")
        if not candidates:
            return None, None
        if len(candidates) == 1:
            raise on_every_rank(ckpt.CheckpointError(skipped[0][1]))
        raise on_every_rank(ckpt.CheckpointError(
            f"none of the {len(candidates)} checkpoints in {self.directory!r} can be read: "
            + "; ".join(f"{path!r}: {why}" for path, why in skipped)
        ))


def _from_format_v1(state: dict[str, Any], rank: int, world_size: int, path: str) -> dict[str, Any]:
    """A format-1 checkpoint (one flat dict) in today's layout."""
    tr = state["trainer"]
    out = {
        "format": _FORMAT_V2,
        "world_size": state["world_size"],
        "model": state["model"],
        "scheduler": state.get("scheduler"),
        "scaler": state.get("scaler"),
        "per_rank": state["per_rank"],
        "train_loader": state.get("train_loader"),
        "config": state.get("config"),
        "train_state": {
            "epoch": state["epoch"], "batch_in_epoch": state["batch_in_epoch"], "global_step": state["global_step"],
            "history": tr["history"], "best_metric": tr["best_metric"], "best_epoch": tr["best_epoch"],
        },
    }
    if "optimizer_per_rank" in state:
        shards = state["optimizer_per_rank"]
        if len(shards) != world_size:
            raise ValueError(
                f"rank {rank}: {path!r} holds FSDP optimizer shards for {len(shards)} ranks but this job has {world_size}; "
                f"resume with the same world size"
            )
        out["optimizer"] = shards[rank]
    else:
        out["optimizer"] = state["optimizer"]
    return out



def _from_format_v2(state: dict[str, Any]) -> dict[str, Any]:
    """A format-2 checkpoint (epochs of the history and the best epoch from 0) in today's numbering."""
    progress = state["train_state"]
    progress["history"] = [{**h, "epoch": h["epoch"] + 1} if "epoch" in h else h for h in progress["history"]]
    if progress.get("best_epoch") is not None:
        progress["best_epoch"] += 1
    early = (state.get("callbacks") or {}).get("EarlyStopping")
    if early and early.get("best_epoch") is not None:
        early["best_epoch"] += 1
    state["format"] = CHECKPOINT_FORMAT
    return state
