"""ZeRO-1: each rank keeps and steps the optimizer state of about 1/N of the parameters.

:class:`ZeroRedundancyOptimizer` has the signature and semantics of
``torch.distributed.optim.ZeroRedundancyOptimizer``: the same sorted-greedy partition (a
parameter belongs to one rank; within each parameter group, largest first, to the rank
with the fewest elements so far), a local optimizer of ``optimizer_class`` over this rank's
share, parameters shared back after every step, ``consolidate_state_dict(to)`` and a
``state_dict()`` in the unsharded optimizer's format.

[Note: sharing the parameters back]
After the local step, every rank needs the parameters the others updated. On one node with
CPU tensors the ranks use a shared-memory segment (:mod:`dptrain._shm`): each rank writes
its updated shard into its region, and after one barrier every rank copies the other
shards out -- one memory copy per byte, no broadcast. Elsewhere each owner broadcasts its
shard as one flat tensor per dtype (one collective per rank instead of one per
parameter). Either way the values are copies, so training is bitwise the same as with the
unsharded optimizer.

[Note: the checkpoint format]
``state_dict()`` (after ``consolidate_state_dict(to=r)``, on rank r) returns exactly what
the unsharded optimizer's ``state_dict()`` would: ``{"state": {i: ...}, "param_groups":
[...]}`` with ``i`` the parameter's index across all groups in order. It does not depend
on the number of ranks, so ``load_state_dict`` restores it on any world size: each rank
keeps the entries of the parameters it owns. A plain ``torch.optim`` optimizer loads it
too, and this class loads a plain optimizer's state dict.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from dptrain import _shm, comm
from dptrain.runtime import env

__all__ = ["ZeroRedundancyOptimizer"]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shard an optimizer's state across the ranks of a process group (ZeRO stage 1).

    Each rank builds ``optimizer_class`` over its share of the parameters, so it holds
    about ``1 / world_size`` of the optimizer state; after each :meth:`step` the updated
    parameters are shared back so that every replica is identical. Used after
    :class:`dptrain.DistributedDataParallel` (or any code that averages gradients), the
    parameters equal, bit for bit, those of the unsharded optimizer.

    Args:
        params: an iterable of tensors or of parameter-group dicts (as for any optimizer).
        optimizer_class: the ``torch.optim.Optimizer`` subclass to run on each shard.
        process_group: the group to shard over. Default None: the whole world (a world of
            one, without a process group, keeps everything on this rank).
        parameters_as_bucket_view: pack each rank's trainable parameters into one flat
            tensor per device (``param.data`` become views of it) so they are shared back
            with one copy each. Default False.
        overlap_with_ddp: must be False (default); overlapping the step with PyTorch's
            DDP communication hooks is not supported.
        shm: share parameters through shared memory: None (default) when every rank is on
            this node with CPU tensors and ``DPTRAIN_SHM`` is not 0; False: never; True:
            always, raising ValueError where it cannot. Keyword only.
        **defaults: passed to ``optimizer_class`` (``lr=...``, ``momentum=...``).

    Raises:
        TypeError: ``params`` is not an iterable of tensors or dicts, or
            ``optimizer_class`` is not an Optimizer subclass.
        ValueError: ``params`` is empty or mixes dense types; ``overlap_with_ddp=True``.
        RuntimeError: no process group while the launcher says the world is larger
            (``dptrain.init()`` not called under ``dptrain run``, ``torchrun`` or ``srun``).

    Example:
        >>> model = dptrain.DDP(net)
        >>> opt = dptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        >>> loss_fn(model(x), y).backward(); opt.step()
        >>> opt.consolidate_state_dict(to=0)          # every rank
        >>> if dptrain.rank() == 0:
        ...     torch.save(opt.state_dict(), "opt.pt")   # loads on any number of ranks
    """

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        shm: bool | None = None,
        **defaults: Any,
    ) -> None:
        params = self._check_params(params)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.Adam, "
                f"got {optimizer_class!r}"
            )
        if overlap_with_ddp:
            raise ValueError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) needs PyTorch's DDP communication hooks "
                "(ddp_zero_hook), which dptrain does not support; use overlap_with_ddp=False and call step() "
                "after backward"
            )
        self.initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed:
            env.check_joined("dptrain.ZeroRedundancyOptimizer")
        if process_group is None and distributed:
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.global_rank = dist.get_global_rank(process_group, self.rank) if distributed else 0
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._overlap_with_ddp = False
        self._optim_defaults = defaults
        self._default_device = self._all_params[0].device
        self._shm_wish = shm
        self._partition: list[list[dict]] = []
        self._all_state_dicts: list[dict] = []
        self._buckets: list[list[torch.Tensor]] = []
        self._is_trainable_mask = self._trainable_mask()
        self.optim = optimizer_class(self._partition_parameters()[self.rank], **defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._build_param_buckets()
        # The shared-memory group is made at the first step (a collective), so that building
        # the optimizer, like PyTorch's, does not communicate; False until decided.
        self._shm: _shm.ShmGroup | None | bool = False
        self.initialized = True

    # ------------------------------------------------------------------ parameters
    def _check_params(self, params: Any) -> list:
        if isinstance(params, torch.Tensor):
            raise TypeError(f"params must be an iterable of tensors or dicts, got a single {torch.typename(params)}")
        try:
            items = list(params)
        except TypeError:
            raise TypeError(f"params must be an iterable of tensors or dicts, got {torch.typename(params)}") from None
        if not items:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        if all(isinstance(p, torch.Tensor) for p in items):
            self._all_params = list(items)
        elif all(isinstance(g, dict) for g in items):
            if any("params" not in g for g in items):
                raise ValueError("every parameter group passed to ZeroRedundancyOptimizer needs a 'params' key")
            # Lists, so that a generator of parameters is read once, here.
            items = [{**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
                     for g in items]
            self._all_params = [p for g in items for p in g["params"]]
        else:
            raise TypeError("params must be an iterable of tensors or an iterable of dicts, not a mix")
        kinds = {(torch.typename(p), p.is_sparse) for p in self._all_params}
        if len(kinds) > 1 or any(sparse for _, sparse in kinds):
            raise ValueError(
                "ZeroRedundancyOptimizer needs all parameters of one dense type, got "
                f"{sorted(name + (' (sparse)' if sparse else '') for name, sparse in kinds)}"
            )
        return items

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _partition_parameters(self) -> list[list[dict]]:
        """Per rank, its share of every parameter group (PyTorch's sorted-greedy rule).

        Within each group, parameters are visited largest first (a stable sort, so equal
        sizes keep their order) and each goes to the rank with the fewest elements so far
        (the lowest such rank on a tie); the running sizes carry over from group to group.
        """
        if not self._partition:
            self._partition = [[] for _ in range(self.world_size)]
            sizes = [0] * self.world_size
            for group in self.param_groups:
                shares: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
                for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                    r = sizes.index(min(sizes))
                    shares[r].append(p)
                    sizes[r] += p.numel()
                for r, share in enumerate(shares):
                    self._partition[r].append({**group, "params": share})
        return self._partition

    def _index_to_param(self) -> list[torch.Tensor]:
        return list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group; call it on every rank, as PyTorch's ZeRO requires.

        The new group's parameters are partitioned like the others; the earlier groups keep
        their owners, so the local optimizers keep their state.
        """
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._all_params = self._index_to_param()
        self._partition = []
        mine = self._partition_parameters()[self.rank]
        self.optim.add_param_group(mine[-1])
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._build_param_buckets()
        self._drop_shm()

    @staticmethod
    def _sync_param_groups(src: list[dict], dst: list[dict]) -> None:
        """Copy every setting but ``params`` (lr from a scheduler, betas, ...) from ``src`` to ``dst``."""
        for s, d in zip(src, dst):
            d.update({k: v for k, v in s.items() if k != "params"})

    # ------------------------------------------------------------------ sharing back
    def _per_rank_tensors(self) -> list[list[torch.Tensor]]:
        """What each rank shares back after its step: its bucket(s), or its parameters."""
        if self.parameters_as_bucket_view:
            return [[dev[r] for dev in self._buckets] for r in range(self.world_size)]
        return [[p.data for g in groups for p in g["params"]] for groups in self._partition_parameters()]

    def _drop_shm(self) -> None:
        """The shards changed size: make a new group at the next step."""
        if self._shm:
            self._shm.close()
        self._shm = False

    def _make_shm(self, per_rank: list[list[torch.Tensor]]) -> None:
        need = max(sum(-(-t.numel() * t.element_size() // 64) * 64 for t in ts) for ts in per_rank)
        self._shm = _shm.ShmGroup.create(
            self.process_group, need, what="ZeRO parameter sync", want=self._shm_wish,
            devices=sorted({p.device for p in self._all_params}, key=str),
        )

    def _build_param_buckets(self) -> None:
        """parameters_as_bucket_view: one flat tensor per (device, rank); trainable params view it."""
        if not self.parameters_as_bucket_view:
            return
        devices = list(dict.fromkeys(p.device for p in self._all_params))
        self._buckets = []
        for device in devices:
            per_rank = []
            for groups in self._partition_parameters():
                params = [p for g in groups for p in g["params"] if p.device == device]
                for p in params:
                    if not p.requires_grad:
                        p.data = p.data.detach().clone()  # out of any earlier bucket
                train = [p for p in params if p.requires_grad]
                dtype = params[0].dtype if params else self._all_params[0].dtype
                bucket = torch.empty(sum(p.numel() for p in train) or 1, dtype=dtype, device=device)
                offset = 0
                for p in train:
                    bucket[offset : offset + p.numel()].copy_(p.data.reshape(-1))
                    p.data = bucket[offset : offset + p.numel()].view_as(p.data)
                    offset += p.numel()
                per_rank.append(bucket)
            self._buckets.append(per_rank)

    def _sync_params(self) -> None:
        """Give every rank the parameters the others just updated (see [Note: sharing back])."""
        if self.world_size < 2:
            return
        per_rank = self._per_rank_tensors()
        name = "ZeRO parameter sync"
        if self._shm is False:
            self._make_shm(per_rank)
        with comm.guarded(name, self.process_group):
            if self._shm is not None:
                self._shm.all_gather(per_rank)
            else:
                self._broadcast_shards(per_rank)

    def _broadcast_shards(self, per_rank: list[list[torch.Tensor]]) -> None:
        with torch.no_grad():
            for r, tensors in enumerate(per_rank):
                src = dist.get_global_rank(self.process_group, r)
                by_kind: dict[tuple, list[torch.Tensor]] = {}
                for t in tensors:
                    by_kind.setdefault((t.dtype, t.device), []).append(t)
                for ts in by_kind.values():
                    flat = torch.cat([t.reshape(-1) for t in ts]) if r == self.rank else torch.empty(
                        sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
                    dist.broadcast(flat, src=src, group=self.process_group)
                    if r != self.rank:
                        torch._foreach_copy_(ts, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in ts]), ts)])

    # ------------------------------------------------------------------ step
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Step this rank's shard with the local optimizer, then share the parameters back.

        Collective: every rank of the group must call it. ``closure`` and ``kwargs`` go to
        the local optimizer's ``step``.

        Returns:
            What the local optimizer's ``step`` returns (the closure's loss, if any).
        """
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            env._warn_once_main("ZeroRedundancyOptimizer: the set of trainable parameters changed; rebuilding buckets")
            self._is_trainable_mask = mask
            if self.parameters_as_bucket_view:
                self._build_param_buckets()
                self._drop_shm()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    # ------------------------------------------------------------------ state dicts
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's shard of the optimizer state on group rank ``to`` (CPU copies).

        Collective: call it on every rank, then :meth:`state_dict` on rank ``to``.

        Raises:
            ValueError: ``to`` is not a rank of the group.
        """
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): the group has ranks 0..{self.world_size - 1}")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        local = _to_cpu(self.optim.state_dict())
        if self.world_size == 1:
            self._all_state_dicts = [local]
            return
        gathered: list | None = [None] * self.world_size if self.rank == to else None
        name = "ZeRO consolidate_state_dict"
        with comm.guarded(name, self.process_group):
            dist.gather_object(local, gathered, dst=dist.get_global_rank(self.process_group, to), group=self.process_group)
        self._all_state_dicts = gathered if self.rank == to else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, in the unsharded optimizer's format (see [Note: the checkpoint format]).

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called for this rank.
        """
        if not self._all_state_dicts:
            raise RuntimeError(
                f"rank {self.global_rank}: the optimizer state has not been consolidated on this rank; call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks before state_dict()"
            )
        out = super().state_dict()  # param_groups with global indices; the wrapper holds no state itself
        index = {p: i for i, p in enumerate(self._index_to_param())}
        state = {}
        for local, groups in zip(self._all_state_dicts, self._partition_parameters()):
            for local_group, group in zip(local["param_groups"], groups):
                for local_i, p in zip(local_group["params"], group["params"]):
                    if local_i in local["state"]:
                        state[index[p]] = local["state"][local_i]
        out["state"] = dict(sorted(state.items()))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (of any world size) or of the unsharded optimizer.

        Each rank keeps the state of the parameters it owns. Settings (lr, betas, ...) come
        from ``state_dict["param_groups"]``.

        Raises:
            ValueError: the state dict has another number of groups or of parameters per group.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "loaded state dict has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]} but this optimizer has "
                f"{[len(g['params']) for g in self.param_groups]}; load it into an optimizer over the same parameters"
            )
        saved_index = {p: i for p, i in zip(self._index_to_param(), itertools.chain.from_iterable(g["params"] for g in groups))}
        local_state, local_groups, n = {}, [], 0
        for saved_group, mine in zip(groups, self._partition_parameters()[self.rank]):
            ids = []
            for p in mine["params"]:
                if saved_index[p] in state_dict["state"]:
                    local_state[n] = state_dict["state"][saved_index[p]]
                ids.append(n)
                n += 1
            local_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        # The local optimizer's own loader casts the state to each parameter's dtype and device.
        self.optim.load_state_dict({"state": local_state, "param_groups": copy.deepcopy(local_groups)})
        self._sync_param_groups(groups, self.param_groups)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # ------------------------------------------------------------------ join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For uneven inputs under ``Join``: a rank that ran out of data keeps stepping (and sharing)."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        # The others share their shards after each step: a joined rank must share its own.
        self.zero.step()
