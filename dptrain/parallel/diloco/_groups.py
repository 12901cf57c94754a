"""Who exchanges pseudo-gradients with whom: the world, a group the user names, or the rails
between the nodes of a hierarchical job.

[Note: hierarchical DiLoCo]
A model wrapped in :class:`dptrain.DistributedDataParallel` over the ranks of one node (its
``process_group``, e.g. from :func:`node_group`) trains synchronously inside the node --
DDP's gradient all-reduce, in shared memory on CPU -- so the node's ranks hold one replica.
The outer exchange then runs between replicas: for each place ``i`` in the DDP groups, a
"rail" group of the ``i``-th rank of every group. Every rank learns every rank's DDP group
(one all-gather of objects) and makes every rail with ``new_group`` in the same order,
because ``new_group`` is collective over the world.

After in-place recovery re-formed the world, every group made here died with the old one:
the survivors call :func:`node_group` and :func:`topology_for` again, in the order a
replacement's construction calls them (node group first, then the rails), and pass the new
node group as ``node`` since their DDP moves onto it only afterwards (see
[Note: DiLoCo's node replicas, recovered in place] in :mod:`dptrain.train.rollback`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import env
from dptrain.parallel.ddp import DistributedDataParallel
from dptrain.parallel.diloco._exchange import Topology

__all__ = ["node_group", "topology_for"]

# (id of the default group, the ranks of each group) -> the groups made for them, so that two
# DiLoCo instances (or node_group() twice) do not make new groups every time.
_MADE: dict[tuple, list] = {}


def _made(key_groups: list[list[int]]) -> list:
    # Groups destroyed with their world go: a re-formed default group may get the old one's id (its
    # memory freed and reused), and groups of the old world must never be taken for the new one's --
    # a rank that took them would skip the new_group calls the others make, and every rank would hang.
    for stale in [k for k, groups in _MADE.items() if not all(_alive(pg) for pg in groups)]:
        del _MADE[stale]
    key = (id(dist.distributed_c10d._get_default_group()), tuple(map(tuple, key_groups)))
    if key not in _MADE:
        _MADE[key] = [dist.new_group(ranks) for ranks in key_groups]
    return _MADE[key]


def _alive(pg: Any) -> bool:
    """Whether ``pg`` belongs to the current world: destroy_process_group() forgets every group's ranks
    (a destroyed group object itself still answers size() and rank()). The placeholder new_group()
    returns to a rank outside the group tells nothing; each rank is in one group of each list made here,
    and that one dies with the world as every other rank's does, so every rank decides alike."""
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        return True
    try:
        dist.get_process_group_ranks(pg)
        return True
    except (KeyError, RuntimeError, ValueError):
        return False


def node_group() -> Any:
    """The process group of this node's ranks, made on every rank (collective over the world).

    Pass it as ``process_group`` to :class:`dptrain.DistributedDataParallel` to train
    synchronously inside each node and let :class:`dptrain.DiLoCo` synchronise the nodes
    rarely. The nodes are the launcher's (``GROUP_RANK``, or ``rank // LOCAL_WORLD_SIZE``).

    Returns:
        The group of the ranks on this node; None without a process group (a single process).

    Raises:
        ValueError: the nodes hold different numbers of ranks (DiLoCo's rails need the same
            number on each); the message shows the count of each node.

    Example:
        >>> model = dptrain.DDP(net, process_group=dptrain.parallel.diloco.node_group())  # doctest: +SKIP
        >>> diloco = dptrain.DiLoCo(model, opt, sync_every=100)                           # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()):
        env.check_joined("dptrain.parallel.diloco.node_group")
        return None
    nodes = comm.all_gather_object(env.get_world().node_rank)
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    groups = [by_node[k] for k in sorted(by_node)]
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"rank {dist.get_rank()}: the nodes hold different numbers of ranks "
                         f"({', '.join(f'node {k}: {len(by_node[k])}' for k in sorted(by_node))}); start the same "
                         f"--nproc-per-node on every node to train each node as one DiLoCo replica")
    made = _made(groups)
    return made[sorted(by_node).index(nodes[dist.get_rank()])]


def _size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def topology_for(model: Any, group: Any, node: Any = None) -> Topology:
    """The topology of ``model``'s outer exchange; collective over the world for a DDP model.

    ``group`` given: that group, every rank one replica. A :class:`DistributedDataParallel`
    over a group smaller than the world: the rails (see the module note). Otherwise the world.
    ``node`` (default None: the DDP's own group): the DDP group to take instead, a new one made
    after a re-form that the DDP has not moved onto yet.

    Raises:
        ValueError: DDP groups of different sizes, or overlapping ones.
    """
    inner = model.process_group if node is None and isinstance(model, DistributedDataParallel) else node
    if group is not None or not isinstance(model, DistributedDataParallel) or inner is None:
        return Topology(outer=group, outer_size=_size(group))
    mine = tuple(dist.get_process_group_ranks(inner))
    every = comm.all_gather_object(mine)
    groups = sorted(set(every))
    covered = sorted(r for g in groups for r in g)
    if covered != list(range(dist.get_world_size())) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"rank {dist.get_rank()}: DiLoCo over DDP replicas needs DDP groups of equal size that "
                         f"split the world, got {[list(g) for g in groups]}; build DDP with "
                         f"process_group=dptrain.parallel.diloco.node_group() on every rank")
    if len(groups) == 1:  # DDP over the whole world: one replica, nothing to exchange
        return Topology()
    width = len(groups[0])
    rails = _made([[g[i] for g in groups] for i in range(width)])
    index = mine.index(dist.get_rank())
    return Topology(outer=rails[index], outer_size=len(groups), node=inner, node_size=width, node_index=index)
