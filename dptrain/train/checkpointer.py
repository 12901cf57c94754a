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
* Pruning counts only this run's checkpoints: those it wrote, and those older than the one it
  resumed from that its run wrote before -- their ``job`` is one of the run's jobs (``lineage``
  in each checkpoint: this job and the jobs whose checkpoints it continues), or they name no job
  (an older dptrain). It never deletes the one just written, and reads each one's ``job`` again
  right before deleting it (a file of that name may be another job's by now), with the
  shard files it names only. When ``keep_last`` counts, every other file under a checkpoint's name goes
  into ``set-aside/``: one that cannot be read, one that is not a Trainer checkpoint, one of
  another job -- a job writing into the same directory -- and one that appeared while this run
  trained without this run writing it (a job that nothing names, see ``job_identity``); and
  always one ahead of this run. Whose a file is is read without loading it (checkpoint.py's
  [Note: whose checkpoint a file is, read without loading it]).
* The clean-up at start deletes only what interrupted saves left that cannot be anyone else's:
  temporary files of this machine whose writer is gone, shard files of this job without their
  checkpoint. A user's file, another job's save in flight, another machine's temporaries are
  left where they are, and named (checkpoint.py's [Note: what the clean-up at start may
  delete]); every node's first rank sweeps its own machine's temporaries.

Only rank 0 moves files, and the files of one step (a prune, a resume, a start) are named in
one notice; a fresh start's move is agreed with the other ranks (they wait for it, and raise
the same error if it fails).

[Note: folders that are links]
``set-aside/`` and ``previous-run-<when>/`` are folders that dptrain makes inside
checkpoint_dir and moves files into. Someone who can write the directory (see
``_warn_if_others_can_write``) could put a symlink there under such a name, pointing
elsewhere, and the files moved would leave checkpoint_dir -- into their hands. So a folder is
made by ``mkdir`` (which follows no link), opened with O_DIRECTORY | O_NOFOLLOW, checked to be
a folder of this user's, and the files are moved into that descriptor (``rename`` with
``dst_dir_fd``), never through its name again. A ``set-aside`` that is not such a folder is
passed over for ``set-aside-2`` (then -3, ...), which the notice says; a ``previous-run-<when>``
that is not the folder just made fails the move, on every rank, and nothing moves.
checkpoint_dir itself is the user's choice, and may be a link.

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

import contextlib
import errno
import os
import stat
import sys
import time
from typing import Any, Mapping

from dptrain import checkpoint as ckpt
from dptrain import comm
from dptrain.runtime import env
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
_FORMATS = (CHECKPOINT_FORMAT, _FORMAT_V2, _FORMAT_V1)
#: The most jobs a checkpoint's ``lineage`` names (the newest): enough for any run's resumes.
_LINEAGE_MAX = 256
#: How a folder of dptrain's is opened (see [Note: folders that are links]).
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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


def _job_name(job: str | None) -> str:
    return job if job is not None else "a job that nothing names"


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _exists_in(folder: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_in(folder: int, name: str, data: bytes) -> None:
    """Write ``name`` in the open folder ``folder``, atomically (a new temporary, fsync, rename)."""
    tmp = ckpt._temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | ckpt._NEW_FILE, 0o666, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp, dir_fd=folder)
        raise


def _not_a_folder(path: str, exc: OSError) -> str:
    """Why ``path`` could not be opened as a folder (see [Note: folders that are links])."""
    try:
        st = os.lstat(path)
    except OSError:
        return f"{path!r} cannot be opened ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            return f"{path!r} is a symbolic link (to {os.readlink(path)!r}), which dptrain does not follow"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path!r} is {ckpt._kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, not a folder"
    return f"{path!r} cannot be opened ({exc.strerror or exc})"


def _sweep_notice(directory: str, removed: list[str], left: list[tuple[str, str]]) -> str:
    """One line for what the clean-up at start removed and what it left (see prepare)."""
    said = []
    if removed:
        said.append(f"removed {_files(len(removed))} that interrupted saves left behind (temporary files whose "
                    f"writer is gone, shard files of this job without their checkpoint): "
                    + ", ".join(repr(n) for n in removed))
    if left:
        said.append(f"left {_files(len(left))} where {'it is' if len(left) == 1 else 'they are'}, which may be another "
                    f"job's or yours (nothing else is deleted): " + "; ".join(f"{n!r} {why}" for n, why in left)
                    + ". Delete those yourself once no other job writes into this directory")
    return f"checkpoint_dir {directory!r}: " + "; ".join(said)


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
        self._lineage: list[str | None] = []  # the jobs whose checkpoints this run continues (see _jobs)
        # Rank 0: names of the checkpoints that this run's past left in the directory (older than the
        # one it resumed from); None where that is not known (another rank, a start not decided yet).
        self._past: set[str] | None = None
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
        """Clean what interrupted saves left -- only that, see checkpoint.py's [Note: what the
        clean-up at start may delete] -- and check, before any training, that the directory can
        be written (every rank raises the same error if not); name in one notice what was removed
        and what was left; warn when other users can write the directory too. Collective."""
        if not self.directory:
            return
        error, swept = None, ([], [])
        if self.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                swept = ckpt._sweep(self.directory, job_identity())
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
        self._say_swept(*swept)
        if self.rank == 0:
            self._warn_if_others_can_write()

    def _say_swept(self, removed: list[str], left: list[tuple[str, str]]) -> None:
        """Collective: the first rank of every other machine sweeps its own machine's temporary files
        (whether their writer runs can only be told there); rank 0 names what all of them removed and
        left, with its own sweep's (``removed``, ``left``), in one notice."""
        if self.world_size > 1:
            part = None
            if self.rank != 0 and env.get_world().local_rank == 0:
                try:
                    part = ckpt._sweep(self.directory, None, everything=False)
                except Exception as exc:  # noqa: BLE001 - a sweep never stops a run; rank 0 says it
                    part = ([], [(self.directory, f"could not be swept for rank {self.rank}'s machine "
                                                  f"({type(exc).__name__}: {exc})")])
            here = ckpt._machine()
            parts = comm.all_gather_object((here, part))
            if self.rank != 0:
                return
            swept_there = {machine for machine, p in parts if p is not None} - {here}
            left = [(n, why) for n, why in left if ckpt._temp_machine(n) not in swept_there]
            for _, p in parts:
                if p is not None:
                    removed, left = removed + p[0], left + p[1]
        if self.rank == 0 and (removed or left):
            left = list({n: (n, why) for n, why in left}.values())
            notice(_sweep_notice(self.directory, sorted(set(removed)), left))

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
        me = job_identity()
        main: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "world_size": self.world_size, "job": me,
                                "lineage": ([j for j in self._lineage if j != me] + [me])[-_LINEAGE_MAX:]}
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
            shards["job"] = me  # whose a shard file is, for the clean-up at start (it may outlive its checkpoint)
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

    def _jobs(self) -> set[str | None]:
        """The jobs whose checkpoints are this run's: this job, and those of the run it continues."""
        return {job_identity(), *self._lineage}

    def _not_ours(self, path: str, ahead: str | None = None) -> tuple[dict[str, Any], str | None]:
        """(what ``path`` says of itself, read without loading it; why it is not one of this run's
        checkpoints, or None). ``ahead``: why it is ahead of this run, if it is."""
        entries, why = ckpt._peek(path)
        if why is None and ahead:
            why = ahead
        if why is None:
            if entries.get("format") not in _FORMATS:
                why = f"is not a dptrain Trainer checkpoint (its format is {entries.get('format')!r})"
            elif "job" in entries and entries["job"] not in self._jobs():
                why = (f"was written by another job ({_job_name(entries['job'])}), not by this one "
                       f"({_job_name(job_identity())})")
        return entries, why

    def _shard_files(self, path: str, entries: Mapping[str, Any]) -> list[str]:
        """The shard files of checkpoint ``path``: those of the world size it names (by name alone
        for a format that does not say)."""
        found = ckpt._shards_of(self.directory, os.path.basename(path))
        world, sharded = entries.get("world_size"), entries.get("sharded")
        if isinstance(world, int) and isinstance(sharded, (list, tuple)):
            found = [p for p in found if sharded and ckpt._SHARD_RE.match(os.path.basename(p)).group(2) == str(world)]
        return found

    def _prune(self, written: str) -> None:
        """Rank 0, after writing ``written``: move aside what is not this run's, then delete this
        run's oldest checkpoints beyond ``keep_last`` (see [Note: whose files these are])."""
        mine = _order(written)  # None: a name of the caller's (save_checkpoint(path)), not counted
        ours: list[str] = []
        aside: list[tuple[str, str]] = []
        for path in ckpt.list_checkpoints(self.directory):
            name = os.path.basename(path)
            if name == os.path.basename(written):
                continue
            if name in self._ours:
                ours.append(path)
                continue
            ahead = mine is not None and _order(path) > mine
            if not ahead and self.keep_last <= 0:
                continue  # nothing is deleted: whose it is does not matter
            _, why = self._not_ours(path, (f"is ahead of this run (step {_order(path)[0]}; this run just wrote "
                                           f"step {mine[0]})") if ahead else None)
            if why is None and self._past is not None and name not in self._past:
                why = "was not written by this run: it appeared in checkpoint_dir while this run trained"
            if why:
                aside.append((path, why))
                continue
            self._ours.add(name)
            ours.append(path)
        if self.keep_last > 0:
            others = self.keep_last - 1 if mine is not None else self.keep_last
            for path in ours[: max(0, len(ours) - others)]:
                self._ours.discard(os.path.basename(path))
                if not os.path.lexists(path):
                    continue
                entries, why = self._not_ours(path)  # read again: one of this name may be another's by now
                if why:
                    aside.append((path, why))
                    continue
                for part in self._shard_files(path, entries) + [path]:  # the checkpoint last
                    try:
                        os.remove(part)
                    except FileNotFoundError:
                        pass
        self._set_aside(aside)

    def _folder(self, base: str, fresh: bool) -> tuple[int, str, list[str]]:
        """A folder of dptrain's in the directory, open (see [Note: folders that are links]):
        ``base``, else ``base-2``, ``base-3``, ... where the name is taken by something else.
        ``fresh``: only a folder made now. Returns (its descriptor, its path, why each name
        before it was passed over).

        Raises:
            OSError: a folder made now is not the one found open (a race), or no name is free.
        """
        passed: list[str] = []
        for n in range(1, 1000):
            path = os.path.join(self.directory, base if n == 1 else f"{base}-{n}")
            try:
                os.mkdir(path)
                made = True
            except FileExistsError:
                if fresh:
                    continue
                made = False
            try:
                fd = os.open(path, _FOLDER)
            except OSError as exc:
                why = _not_a_folder(path, exc)
            else:
                st = os.fstat(fd)
                why = None
                if not stat.S_ISDIR(st.st_mode):
                    why = f"{path!r} is not a folder"
                elif hasattr(os, "geteuid") and st.st_uid != os.geteuid():
                    why = f"{path!r} belongs to another user (uid {st.st_uid})"
                if why is None:
                    return fd, path, passed
                os.close(fd)
            if made:
                raise OSError(errno.EEXIST, f"the folder made a moment ago was replaced: {why}", path)
            passed.append(why)
        raise OSError(errno.EEXIST, f"no name of the form {base}-<n> is free", os.path.join(self.directory, base))

    def _set_aside(self, items: list[tuple[str, str]]) -> None:
        """Rank 0: move the files ``items`` names -- (path, why), files under a checkpoint's name
        that are not this run's -- and their shard files into set-aside/, said in one notice. A
        file that cannot be moved stays where it is, said too."""
        if not items:
            return
        moved: list[tuple[str, str, str]] = []  # (from, to, why)
        failed: list[tuple[str, str, str]] = []  # (path, why, what went wrong)
        passed: list[str] = []
        try:
            folder, where, passed = self._folder(SET_ASIDE, fresh=False)
        except OSError as exc:
            failed = [(path, why, str(exc.strerror or exc)) for path, why in items]
        else:
            try:
                for path, why in items:
                    name = os.path.basename(path)
                    parts = ckpt._shards_of(self.directory, name) + [path]  # the checkpoint last
                    try:
                        tag, n = "", 1
                        while any(_exists_in(folder, _tagged(os.path.basename(p), tag)) for p in parts):
                            n += 1
                            tag = f".{n}"
                        for part in parts:
                            os.replace(part, _tagged(os.path.basename(part), tag), dst_dir_fd=folder)
                        moved.append((path, os.path.join(where, _tagged(name, tag)), why))
                    except OSError as exc:
                        failed.append((path, why, str(exc.strerror or exc)))
            finally:
                os.close(folder)
        # Where set-aside/ is not a folder of dptrain's, the notice says why the files went elsewhere.
        nothing = f"nothing is deleted; {'; '.join(passed)}, so not there" if passed else "nothing is deleted"
        if len(moved) == 1 and not failed:
            src, dst, why = moved[0]
            notice(f"moved {src!r} to {dst!r} ({nothing}): it {why}. It is not counted by keep_last, and a resume "
                   f"does not pick it")
            return
        said = []
        if moved:
            said.append(f"moved {_files(len(moved))} into {where!r} ({nothing}): "
                        + "; ".join(f"{src!r} as {os.path.basename(dst)!r}: it {why}" for src, dst, why in moved))
        if failed:
            said.append(f"left {_files(len(failed))} in place, as moving {'it' if len(failed) == 1 else 'them'} "
                        f"aside failed: " + "; ".join(f"{path!r} ({error}): it {why}" for path, why, error in failed))
        notice(". ".join(said) + ". None of them is counted by keep_last, and a resume does not pick them")

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
                self._past = set()  # a run with no past: what appears later is not its own
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
        self._past, self._lineage = set(), []  # a run with no past: what appears later is not its own

    def _move_earlier_run(self, doing: str) -> None:
        found = ckpt.list_checkpoints(self.directory)
        parts = [p for old in found for p in ckpt._shards_of(self.directory, os.path.basename(old)) + [old]]
        if os.path.lexists(self.best_path):
            parts.append(self.best_path)
        if not parts:
            return
        # Named for when that run wrote its newest file, so a listing reads as a history.
        when = time.strftime("%Y%m%dT%H%M%S", time.localtime(max(os.lstat(p).st_mtime for p in parts)))
        folder, aside, _ = self._folder(f"{PREVIOUS_RUN}-{when}", fresh=True)
        try:
            for part in parts:
                os.replace(part, os.path.basename(part), dst_dir_fd=folder)
            settings = ""
            if self._earlier_config and os.path.lexists(self._earlier_config):
                # The settings of the run just moved (config.yaml held other settings than this run's).
                os.replace(self._earlier_config, CONFIG_NAME, dst_dir_fd=folder)
                self._earlier_config, self._config_notice, settings = None, None, f" with its {CONFIG_NAME}"
            elif self._config_text is not None:  # that run had the same settings: it keeps a copy of them
                _write_in(folder, CONFIG_NAME, self._config_text.encode())
                settings = f" with a copy of its {CONFIG_NAME}"
        finally:
            os.close(folder)
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

    def _continue_from(self, path: str, state: Mapping[str, Any]) -> None:
        """Collective, once a resume read ``path`` (``state``): what is newer in the directory goes
        to set-aside/, what is older is this run's past; a checkpoint from elsewhere starts the
        directory afresh (see [Note: whose files these are])."""
        if not self.directory:
            return
        if not self._holds(path):
            self._move_aside_earlier_run(f"resuming from {path!r}, outside it")
            self._say_config_kept()
            return
        self._say_config_kept()
        name = os.path.basename(path)
        self._ours.add(name)
        lineage = state.get("lineage")
        if not isinstance(lineage, (list, tuple)):  # written before checkpoints said their lineage
            lineage = [state["job"]] if "job" in state else []
        self._lineage = list(lineage)
        if self.rank == 0:
            start, newer, self._past = _order(path), [], set()
            for other in ckpt.list_checkpoints(self.directory):
                if start is not None and _order(other) > start:
                    newer.append((other, f"is newer than {name}, which this run resumes from"))
                elif os.path.basename(other) != name:
                    self._past.add(os.path.basename(other))
            self._set_aside(newer)

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
                self._continue_from(path, state)
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
