"""DistributedDataParallel across a re-formed process group (in-place recovery, issue 32).

[Note: rejoining a re-formed group]
When a rank dies, the survivors keep their processes: they destroy the broken process group,
create the next one (same rank numbers, a new store prefix), and a replacement process takes
the dead rank's place. For their DDPs to go on reducing exactly as an uninterrupted run would:

1. A healthy rank describes its reducer's *learnt state* as plain data
   (``ddp._recovery_layout()``: the bucket layout, the one-time rebuild's progress, the count
   of synced backwards, a static graph's hook counts, the bucket limits and a decided
   ``compression="auto"``; see the reducer's [Note: the learnt state]). A backward that was in
   flight when the peer died does not count: the layout is the one it was armed with.
2. The replacement builds its DDP inside :func:`joining_job`: no collective at construction
   (the other ranks are not constructing anything), a reducer over the new group, no shared
   memory yet.
3. Every rank calls ``ddp._rejoin(layout)`` with the same layout (sent over the new group):
   the old reducer's hooks go and its collectives in flight are abandoned (an old
   shared-memory group is aborted, not waited for), the DDP reduces over the new default
   group, the ranks check they built the same model and vote on shared memory again (the
   two collectives of construction that remain meaningful), a new reducer is built and takes
   over the layout, and every parameter's gradient is set to None.

Parameters, buffers and optimizer state are the caller's business (the Trainer sends them
from the most advanced survivor); DDP does not broadcast them here.

What cannot be carried over raises NotImplementedError before anything is touched, so that
the caller can fall back to a restart (:func:`obstacle` words it): ``overlap_optimizer`` and
PyTorch's ``_apply_optimizer_in_backward`` (a failed backward may have stepped some buckets),
PowerSGD (``compression="powersgd"``, a decided ``"auto"`` that chose it, or a registered
``PowerSGDState``: its error feedback is per rank and the dead rank's is lost), a
``compression="auto"`` still measuring, a communication hook whose state holds a process
group, and a DDP over another group than the default one (``process_group=``/``device_mesh=``)
unless the caller rebuilds that group itself.

[Note: rejoining a group of the caller's]
A DDP over a subgroup (DiLoCo's ``replica="node"``: DDP over the ranks of one node) cannot
follow the re-formed default group on its own: its group died with the old world, and only
the caller knows which ranks the new one holds. The caller makes the new subgroup (on every
rank of the world, in the same order: ``new_group`` is collective over the world) and passes
it: ``ddp._rejoin(layout, process_group=new)``; :func:`obstacle` and :func:`layout_of` take
``group_rebuilt=True`` to allow it. The layout must then come from a rank of the same
subgroup (the reducers of other subgroups learnt their own state).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist

from dptrain import _shm
from dptrain.parallel.ddp import _setup as setup
from dptrain.parallel.ddp._compression import _use as use_compression
from dptrain.parallel.ddp._powersgd import PowerSGDState
from dptrain.parallel.ddp._signature import torch_ddp

__all__ = ["joining_job", "is_joining", "obstacle", "layout_of", "leave_group", "prepare_rejoin", "rejoin",
           "reducer_layout",
           "check_reducer_layout", "adopt_reducer_layout", "LAYOUT_VERSION"]

LAYOUT_VERSION = 1

# How many joining_job() blocks are open (a counter: they may nest). Process-wide, not per
# thread: a replacement builds its model wherever its script does.
_joining = 0
_lock = threading.Lock()


@contextlib.contextmanager
def joining_job() -> Iterator[None]:
    """Build DistributedDataParallel without collectives, for a process that replaces a dead rank.

    Inside the block, the constructor neither checks that every rank built the same model,
    nor broadcasts rank 0's parameters and buffers, nor asks the other ranks about shared
    memory: the job's other ranks are not constructing anything, they wait in their recovery.
    The DDP gets a reducer over the current default group and reduces through gloo/NCCL until
    every rank has called ``ddp._rejoin(layout)``, which does those collectives.

    Example:
        >>> from dptrain.parallel.ddp import joining_job
        >>> with joining_job():                       # in the replacement process only
        ...     ddp = dptrain.DDP(build_model())
        >>> ddp._rejoin(layout)                       # on every rank, same layout
    """
    global _joining
    with _lock:
        _joining += 1
    try:
        yield
    finally:
        with _lock:
            _joining -= 1


_rejoined = False  # this process has been through _rejoin (a replacement is a member from then on)


def is_joining() -> bool:
    """Whether DDP construction does no collective now: a :func:`joining_job` block is open, or this
    process replaces a dead rank (``dptrain run --recovery in-place`` started it for a generation) and
    has not rejoined yet -- a plain loop builds its DDP before anything of dptrain's can open the block."""
    if _joining > 0:
        return True
    if _rejoined:
        return False
    from dptrain.runtime import settings as _settings

    return _settings.get("DPTRAIN_RECOVERY") == "in-place" and bool(_settings.get("DPTRAIN_GENERATION"))


def obstacle(ddp: Any, layout: dict | None = None, describing: bool = False, group_rebuilt: bool = False) -> str | None:
    """Why ``ddp`` cannot rejoin a re-formed group (``describing``: describe itself for one), or None.

    ``group_rebuilt``: the caller makes the new group of a DDP over a subgroup and passes it to
    :func:`rejoin` (see [Note: rejoining a group of the caller's]); without it only a DDP over the
    default group can rejoin.

    The answer must be the same on every rank, since the ranks that find none go on into
    collectives: it rests on settings that every rank's script makes alike, and for
    ``compression="auto"`` on ``layout``, from which a replacement learns the choice (without
    a layout every rank starts afresh, measuring again).
    """
    if not ddp._distributed:
        return "DistributedDataParallel was built without a process group (a world of one): there is nothing to rejoin"
    if not getattr(ddp, "_world_group", False) and not (group_rebuilt and ddp.device_mesh is None):
        what = "device_mesh=" if ddp.device_mesh is not None else "process_group="
        return (f"DistributedDataParallel({what}...): only a DDP over the default process group can follow it to "
                "the re-formed one (or one over a process group its caller makes again and passes to "
                "_rejoin(layout, process_group=...))")
    if ddp._overlap_optimizer is not None:
        return ("DistributedDataParallel(overlap_optimizer=...): a failed backward may have stepped some buckets "
                "already; in-place recovery needs overlap_optimizer=None")
    reducer = ddp.reducer
    if reducer is not None and any(hasattr(p, "_in_backward_optimizers") for p in reducer.params):
        return ("torch.distributed.optim._apply_optimizer_in_backward: a failed backward may have stepped some "
                "parameters already; in-place recovery needs optimizer.step() after backward")
    if ddp.compression == "powersgd":
        return ("DistributedDataParallel(compression='powersgd'): the error feedback of the lost rank cannot be "
                "recovered")
    if ddp.compression == "auto" and (describing or layout is not None):
        choice = auto_choice(ddp, layout)
        if choice is None:
            return ("DistributedDataParallel(compression='auto') is still measuring (it decides within 14 synced "
                    "steps); the measurement cannot be carried over")
        if choice == "powersgd":
            return ("DistributedDataParallel(compression='auto') chose PowerSGD: the error feedback of the lost rank "
                    "cannot be recovered")
    if reducer is not None and _user_hook(ddp, reducer):
        return _hook_obstacle(reducer.comm_hook, reducer.comm_hook_state)
    return None


def _user_hook(ddp: Any, reducer: Any) -> bool:
    """Whether the reducer's communication hook is the user's (register_comm_hook), not one that
    compression= or mixed_precision= installs with every reducer they build."""
    return reducer.comm_hook is not None and ddp.compression is None and ddp._mixed_precision is None


def _hook_obstacle(hook: Any, state: Any) -> str | None:
    name = getattr(hook, "__qualname__", repr(hook))
    if state is None or isinstance(state, dist.ProcessGroup):
        return None  # None means the default group; a group is replaced by the new default one
    if isinstance(state, PowerSGDState) or type(state).__name__ == "PowerSGDState":  # ours or PyTorch's
        return (f"register_comm_hook({type(state).__name__}, {name}): the error feedback of the lost rank cannot be "
                "recovered")
    fields = list(getattr(state, "__dict__", {}).values())
    fields += [getattr(state, n, None) for n in getattr(type(state), "__slots__", ())]
    if any(isinstance(v, dist.ProcessGroup) for v in fields):
        return (f"register_comm_hook({type(state).__name__}, {name}): its state holds a process group, which died "
                "with the old one; register the hook with state None (the default group) to recover in place")
    return None


def auto_choice(ddp: Any, layout: dict | None) -> str | None:
    """The decided option of ``compression="auto"``: the layout's (when given), else this DDP's own."""
    if layout is not None:
        return layout.get("compression_choice")
    auto = ddp._auto_compression
    return None if auto is None else auto.choice


def layout_of(ddp: Any, undo_completed_backward: bool = False, group_rebuilt: bool = False) -> dict:
    """``ddp._recovery_layout()``: see there."""
    reason = obstacle(ddp, describing=True, group_rebuilt=group_rebuilt)
    if reason is not None:
        raise NotImplementedError(f"in-place recovery: {reason}")
    reducer = ddp.reducer
    out: dict = {"version": LAYOUT_VERSION}
    out["reducer"] = None if reducer is None else reducer_layout(reducer, undo_completed_backward)
    out["compression_choice"] = auto_choice(ddp, None) if ddp.compression == "auto" else None
    return out


def reducer_layout(reducer: Any, undo_completed_backward: bool = False) -> dict:
    """The learnt state as plain data (see the reducer's [Note: the learnt state]).

    Taken as it was before the latest synced backward when that backward did not complete
    here, or when ``undo_completed_backward`` asks for it (the caller redoes a step whose
    backward completed); otherwise as it is now.
    """
    armed = reducer._armed_state is not None and (reducer._in_flight or undo_completed_backward)
    state = reducer._armed_state if armed else reducer._learnt()
    buckets, limits, new_limits, done, agreed, iterations, counts, unused = state
    used = None if reducer._used_reduced is None else [int(u) for u in reducer._used_reduced.tolist()]
    return {
        "names": list(reducer.names),
        "assignment": [list(b.indices) for b in buckets],
        "bucket_limits": list(limits),
        "new_limits": None if new_limits is None else list(new_limits),
        "rebuild_done": bool(done),
        "rebuild_agreed": None if agreed is None else list(agreed),
        "num_iterations": int(iterations),
        "static_graph": bool(reducer.static_graph),
        "static_counts": None if counts is None else list(counts),
        "global_unused": None if unused is None else list(unused),
        "used_map": used,
    }


def check_reducer_layout(layout: dict, names: list[str], static_graph: bool) -> None:
    """Raise ValueError unless ``layout`` describes a reducer of these parameters and settings."""
    theirs = list(layout["names"])
    if theirs != names:
        first = next((i for i, (a, b) in enumerate(zip(theirs, names)) if a != b), min(len(theirs), len(names)))
        raise ValueError(
            f"DDP recovery layout: it describes {len(theirs)} parameters, this DDP reduces {len(names)}; the first "
            f"difference is at index {first} ({theirs[first] if first < len(theirs) else 'none'!r} vs "
            f"{names[first] if first < len(names) else 'none'!r}): take it from a DDP of the same model"
        )
    if bool(layout["static_graph"]) != static_graph:
        raise ValueError(
            f"DDP recovery layout: it comes from a DDP with static_graph={layout['static_graph']}, this one has "
            f"static_graph={static_graph}"
        )
    assignment = [list(b) for b in layout["assignment"]]
    if sorted(i for b in assignment for i in b) != list(range(len(names))) or not all(assignment):
        raise ValueError("DDP recovery layout: its bucket assignment is not a partition of the parameters")


def adopt_reducer_layout(reducer: Any, layout: dict) -> None:
    """Take over the learnt state of another reducer of the same model (from :func:`reducer_layout`).

    Every rank adopts the same layout at the same point, before the next forward: the
    buckets are reallocated (in shared memory too) only where they differ.

    Raises:
        ValueError: the layout comes from a reducer of other parameters or settings.
    """
    check_reducer_layout(layout, reducer.names, reducer.static_graph)
    assignment = [list(b) for b in layout["assignment"]]
    reducer.bucket_limits = list(layout["bucket_limits"])
    reducer._new_limits = None if layout["new_limits"] is None else list(layout["new_limits"])
    if assignment != reducer.assignment:
        reducer._init_buckets(assignment)
    reducer._rebuild.done = bool(layout["rebuild_done"])
    reducer._rebuild.agreed = None if layout["rebuild_agreed"] is None else list(layout["rebuild_agreed"])
    reducer.num_iterations = int(layout["num_iterations"])
    reducer._static_counts = None if layout["static_counts"] is None else list(layout["static_counts"])
    reducer._global_unused = None if layout["global_unused"] is None else list(layout["global_unused"])
    if layout["used_map"] is not None:
        reducer._used_map(reducer.params[0].device).copy_(torch.tensor(layout["used_map"], dtype=torch.int32))
    reducer._armed_state, reducer._in_flight = None, False


def leave_group(ddp: Any) -> None:
    """``ddp._leave_group()``: drop every reference to the process group -- the reducer (its hooks go,
    its works in flight are abandoned), the shared-memory group (aborted: its peers may be dead or
    elsewhere, and closing would wait for the collectives in flight) and the group itself -- and undo
    what a forward that never reached its end left behind. A user's communication hook is kept for
    :func:`rejoin`. Idempotent."""
    old = ddp.reducer
    if old is not None:
        if _user_hook(ddp, old):
            ddp.__dict__["_kept_comm_hook"] = (old.comm_hook, old.comm_hook_state)
        old.close()
    ddp.reducer = None
    _forget_forward(ddp)
    if ddp._shm is not None:
        ddp._shm.abort("DistributedDataParallel: the process group was re-formed")
        ddp._shm = None
    ddp.process_group = None


def prepare_rejoin(ddp: Any, directory: str | None, world_size: int | None = None) -> bool:
    """``ddp._prepare_rejoin(directory, world_size)``: see there."""
    if ddp._shm_wish is False:
        return False
    if world_size is None:
        if not (dist.is_available() and dist.is_initialized()) or str(dist.get_backend()) == "nccl":
            return False  # (GPUs under NCCL: no shared memory to make)
        world_size = dist.get_world_size()
    params = ddp._reducer_params()[0]
    if not params:  # (and GPU parameters: ahead_for_parameters makes nothing for them)
        return False
    return _shm.ahead_for_parameters(params, world_size, directory)


def rejoin(ddp: Any, layout: dict | None, verify: bool, process_group: Any = None) -> None:
    """``ddp._rejoin(layout)``: see there and [Note: rejoining a re-formed group] (``process_group``:
    [Note: rejoining a group of the caller's])."""
    global _rejoined
    _rejoined = True
    if layout is not None and layout.get("version") != LAYOUT_VERSION:
        raise ValueError(f"DDP recovery layout of version {layout.get('version')!r}; this dptrain reads version "
                         f"{LAYOUT_VERSION} (every rank must run the same dptrain)")
    reason = obstacle(ddp, layout, group_rebuilt=process_group is not None)
    if reason is not None:
        raise NotImplementedError(f"in-place recovery: {reason}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"DistributedDataParallel._rejoin(process_group=...) takes a torch.distributed ProcessGroup "
                        f"(e.g. from dist.new_group(ranks)), got {type(process_group).__name__}")
    if layout is not None and layout.get("reducer") is not None:
        check_reducer_layout(layout["reducer"], ddp._reducer_params()[1], ddp.static_graph)  # before any change
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("DistributedDataParallel._rejoin: no process group; create the new one first "
                           "(init_process_group), then call _rejoin on every rank")
    leave_group(ddp)  # done already when the caller let go before destroying the old group
    hook = ddp.__dict__.pop("_kept_comm_hook", None)

    ddp.process_group = dist.group.WORLD if process_group is None else process_group
    ddp._rank = dist.get_rank(ddp.process_group)
    ddp._lazy_init_ran = False  # the new reducer adopts the optimizers in backward, as at construction
    for p in ddp.module.parameters():
        p.grad = None  # a failed step's partial gradients must not leak into the redone one

    if verify:
        settings = ddp._settings(ddp.static_graph)
        setup.verify_same_model(ddp.module, ddp.parameters_to_ignore, settings, ddp.process_group)
    params = ddp._reducer_params()[0]
    if params:  # a collective, as at construction: every rank decides together
        ddp._shm = _shm.for_reducer(params, ddp.process_group, ddp._shm_wish, "DDP gradient all-reduce")
    ddp._build_reducer()
    if ddp._delayed is not None:
        ddp._delayed.attach(ddp.process_group)
    reducer = ddp.reducer
    if reducer is None:
        return
    if hook is not None:
        state = ddp.process_group if isinstance(hook[1], dist.ProcessGroup) else hook[1]
        ddp.register_comm_hook(state, hook[0])
    if ddp.compression == "auto" and layout is not None:
        _adopt_auto_choice(ddp, auto_choice(ddp, layout))
    if layout is not None and layout.get("reducer") is not None:
        adopt_reducer_layout(reducer, layout["reducer"])


def _forget_forward(ddp: Any) -> None:
    """Undo what a forward that never reached its end left behind: mixed precision's
    low-precision parameters, and the DDP that dynamo's DDPOptimizer sees as active."""
    if ddp._mixed_precision is not None:
        ddp._mixed_precision.restore()
    torch_class = torch_ddp()
    if getattr(torch_class, "_active_ddp_module", None) is ddp:
        torch_class._active_ddp_module = ddp.__dict__.pop("_outer_ddp", None)


def _adopt_auto_choice(ddp: Any, choice: str) -> None:
    # The choice a healthy rank made after measuring: installed as it installed it (its bucket
    # limits come with the layout, adopted next).
    auto = ddp._auto_compression
    auto.choice = choice
    auto.message = f'dptrain: DDP compression="auto" chose {choice} (carried over by in-place recovery)'
    ddp.reducer.observer = None
    use_compression(ddp.reducer, choice, auto.resize, start_iter=0)
