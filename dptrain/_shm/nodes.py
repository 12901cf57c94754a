"""Shared memory inside each node of a job that spans nodes (CPU tensors, DDP's gradients).

[Note: the all-reduce across nodes]
With L ranks on each of M nodes, gloo's all-reduce over all M*L ranks moves every byte
through TCP, between the ranks of one node too (loopback), and its ring crosses the slow
link between nodes. Here each node's ranks share one segment (a :class:`ShmGroup` over the
node's ranks) and the all-reduce of a bucket becomes:

1. barrier A -- every rank's bucket holds its gradients;
2. local rank r sums chunk r over the node's ranks, in rank order (as on one node), then
   all-reduces that chunk over gloo with local rank r of every other node (its "rail":
   the ranks of the same local rank), and writes the result into chunk r of every region
   of its node;
3. barrier B -- every region holds the complete result.

Between nodes each rank sends only its 1/L chunk, and the L rails run at once, so the
link carries one bucket's worth per node instead of a ring's share of every rank's. The
summation order is fixed: ``(x0 + x1 + ... in the node's rank order)`` per node, then
gloo's sum over the nodes' partial sums (for two nodes ``a + b``, the same bits on both).

Used when every node has the same number of ranks (at least 2), there are at least two
nodes, every rank can share memory, and the process group is the default one (the node
and rail groups are made with ``new_group``, which every rank must call). Otherwise DDP
uses gloo, as before. ``DPTRAIN_SHM_NODES=0`` turns this off alone; ``DPTRAIN_SHM=0`` and
``DDP(shm=False)`` turn off shared memory altogether.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import settings as _settings
from dptrain._shm import group as _group
from dptrain._shm.group import ShmGroup, region_for
from dptrain._shm.segment import _local_obstacle, _node_identity, shm_disabled_by_env

__all__ = ["for_reducer", "for_parameters", "node_groups", "layout"]


def _disabled() -> bool:
    return not _settings.get("DPTRAIN_SHM_NODES")


def layout(nodes: Sequence[Any]) -> list[list[int]] | None:
    """The ranks of each node (in order of their first rank) from each rank's node identity,
    or None when the job does not have the shape this needs (>= 2 nodes of the same size >= 2)."""
    by_node: dict[Any, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    groups = list(by_node.values())
    sizes = {len(g) for g in groups}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    return groups


# (id of the default group, the layout) -> (node groups, rails): one set per job, however
# many DDP instances are built (every rank makes the same decision, so the cache agrees).
_MADE: dict[tuple, tuple[list, list]] = {}


def _groups(groups: list[list[int]]) -> tuple[list, list]:
    key = (id(dist.distributed_c10d._get_default_group()), tuple(map(tuple, groups)))
    made = _MADE.get(key)
    if made is not None and all(_alive(pg) for pg in made[0] + made[1]):
        return made
    # Every rank makes every group, in the same order (new_group is collective over the world).
    node_pgs = [dist.new_group(ranks) for ranks in groups]
    rails = [dist.new_group([ranks[i] for ranks in groups]) for i in range(len(groups[0]))]
    _MADE[key] = (node_pgs, rails)
    return node_pgs, rails


def _alive(pg: Any) -> bool:
    try:
        dist.get_world_size(pg)
        return True
    except (RuntimeError, ValueError):  # destroyed with the default group (shutdown, then init again)
        return False


def for_reducer(params: Sequence[torch.Tensor], group: Any, want: bool | None, what: str) -> ShmGroup | None:
    """The shared memory of a reducer of ``params``: one segment for the group when its ranks
    share a node, else one per node (:func:`for_parameters`), else None; collective.

    Raises:
        ValueError: ``want`` is True and neither can be used (the one-node reason).
    """
    try:
        flat = _group.for_parameters(params, group, want, what)
    except ValueError:  # shm=True and one segment for all ranks cannot be: one per node may
        across = for_parameters(params, group, want, what)
        if across is None:
            raise
        return across
    return flat or for_parameters(params, group, want, what)


def for_parameters(params: Sequence[torch.Tensor], group: Any, want: bool | None, what: str) -> ShmGroup | None:
    """Like :func:`dptrain._shm.group.for_parameters`, for a job across nodes; collective."""
    nbytes, devices = region_for(params)
    return node_groups(group, nbytes, what=what, want=want, devices=devices)


def node_groups(group: Any, nbytes: int, *, what: str, want: bool | None,
                devices: Sequence[torch.device]) -> ShmGroup | None:
    """This rank's node group, all-reducing across nodes through its rail; collective.

    Returns None on every rank when the job cannot or should not use it (see the module
    note). ``nbytes`` is each rank's region, as for :meth:`ShmGroup.create`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group not in (None, dist.group.WORLD) or dist.get_world_size() < 4 or str(dist.get_backend()) == "nccl":
        return None  # the same on every rank: no need to ask the others
    off = want is False or (want is None and (shm_disabled_by_env() or _disabled()))
    mine = {"node": _node_identity(), "ok": not off and _local_obstacle(devices) is None}
    infos = comm.all_gather_object(mine)
    groups = layout([i["node"] for i in infos]) if all(i["ok"] for i in infos) else None
    if groups is None:
        return None
    me = dist.get_rank()
    node_pgs, rails = _groups(groups)
    mine_at = next(k for k, ranks in enumerate(groups) if me in ranks)
    local = groups[mine_at].index(me)
    shm = ShmGroup.create(node_pgs[mine_at], nbytes, what=what, want=None, devices=devices)
    # A node whose segment failed (e.g. /dev/shm full there) makes every node fall back:
    # half the job summing in shared memory and half through gloo would never meet.
    if not all(comm.all_gather_object(shm is not None)):
        if shm is not None:
            shm.close()
        return None
    rail = rails[local]

    def across_nodes(chunk: torch.Tensor) -> None:
        dist.all_reduce(chunk, group=rail)

    shm.between = across_nodes
    return shm
