"""One FSDP unit: a module's parameters flattened into one flat parameter, sharded across ranks.

A :class:`FlatParamUnit` owns the parameters of one wrapped module (minus those of units
nested inside it). It keeps two tensors:

- ``flat_param``: this rank's shard, an ``nn.Parameter`` of ``padded_numel / world`` elements
  (the whole flat tensor for ``no_shard``). It is what the optimizer sees and steps; with
  ``cpu_offload`` it lives on the CPU, and so does its gradient.
- ``full_param``: the gathered, padded flat tensor on the compute device. Its storage exists
  only while the unit is unsharded (between the all-gather and the reshard); otherwise it
  has zero bytes. The module's original parameter attributes are set to views into it.

[Note: writing gathered bytes without bumping the version counter]
Autograd saves the views (a Linear saves its weight) and, when ``full_shard`` frees the
storage after forward and gathers it again in backward, it checks that the saved tensors
were not modified in place. The collectives therefore write into ``full_param.data``: that
alias shares the storage but has its own version counter, so refilling the storage with the
very same values is invisible to autograd -- which is exactly what is happening.

[Note: one gradient per unit]
The views come from a single ``torch.split`` of ``full_param``, so autograd sums the grads of
all the unit's parameters into ``full_param.grad`` through one backward node, and the
post-accumulate-grad hook on ``full_param`` fires once per backward, after the last of the
unit's parameters got its gradient. That hook is where the gradients are reduce-scattered.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.parallel.fsdp._collectives import all_gather_flat, reduce_scatter_flat, wait

__all__ = ["FlatParamUnit", "ShardingStrategy", "UnitState"]


class ShardingStrategy:
    """The three strategies, as the strings the public API takes."""

    FULL_SHARD = "full_shard"  # shard params, grads, optimizer state; free params after forward
    SHARD_GRAD_OP = "shard_grad_op"  # as full_shard but keep params gathered from forward to backward
    NO_SHARD = "no_shard"  # replicate everything and all-reduce grads, like DDP
    ALL = (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)


class _ParamInfo(NamedTuple):
    module: nn.Module  # the module that owned the parameter
    name: str  # its attribute name there
    shape: torch.Size
    numel: int
    offset: int  # where it starts in the flat tensor


class UnitState(enum.Enum):
    """Where a unit's parameters are: the phases its hooks move it through."""

    SHARDED = "sharded"  # only this rank's shard exists; full_param has no storage
    GATHERING = "gathering"  # an all-gather into full_param is in flight
    UNSHARDED = "unsharded"  # full_param holds the whole (padded) flat parameter


def free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class FlatParamUnit:
    """The parameters of one wrapped module, flattened and sharded (internal to FSDP).

    Args:
        module: the wrapped module; it gets the shard registered as ``_flat_param``.
        params: ``(owner_module, attr_name, parameter)`` in the order to flatten; a parameter
            listed twice (tied weights) is stored once and both attributes view it.
        strategy: one of :class:`ShardingStrategy`.
        group, rank, world: the process group and this rank's place in it.
        device: compute device (where the gathered parameters live).
        offload: keep the shard and its gradient on the CPU.
        sync_module_states: broadcast rank 0's values before sharding.
        state: the shared per-root state (forward order, pending reductions, flags).
    """

    def __init__(self, module, params, strategy, group, rank, world, device, offload, sync_module_states, state):
        self.module = module
        self.strategy = strategy
        self.group, self.rank, self.world = group, rank, world
        self.device = torch.device(device)
        self.offload = offload
        self.state = state
        self.shm = None  # the root's shared-memory group, when its ranks share one node (attach_shared_memory)
        self.is_root = False  # set by the root FSDP: its unit stays gathered after forward

        self.name = type(module).__name__  # for messages; the wrapper sets the qualified name
        first = self._layout(params)
        sharded = strategy != ShardingStrategy.NO_SHARD
        self.padded_numel = math.ceil(self.numel / world) * world if sharded else self.numel
        self.shard_numel = self.padded_numel // world if sharded else self.numel
        # no_shard without offload computes on the flat parameter itself: nothing to gather.
        self.identity = not sharded and not offload
        self._split = [i.numel for i in self.infos] + [self.padded_numel - self.numel]
        self.flat_param = nn.Parameter(self._initial_shard(first, sync_module_states), requires_grad=self.requires_grad)

        # The original parameters leave their modules; their bytes are released even when
        # something (an optimizer built too early) still holds the Parameter objects.
        for owner, name, p in params:
            if name in owner._parameters:
                del owner._parameters[name]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p._dptrain_fsdp_flattened = True
        module.register_parameter("_flat_param", self.flat_param)

        if self.identity:
            self.full_param = self.flat_param
        else:
            self.full_param = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
            self.full_param.requires_grad_(self.requires_grad)
        # Attributes exist between iterations too (as views of freed storage: touching their
        # values outside forward/backward is an error, as in PyTorch's FSDP).
        self._set_views(grad=False)
        if not self.identity:
            free_storage(self.full_param)
        self.phase = UnitState.UNSHARDED if self.identity else UnitState.SHARDED
        self._gather_work = None
        self._gather_src = None  # keeps the device copy of an offloaded shard alive while gathering
        if self.requires_grad:
            self.full_param.register_post_accumulate_grad_hook(self._post_backward)

    def _layout(self, params) -> list[torch.Tensor]:
        """Where each parameter goes in the flat tensor; tied weights are stored once. Returns the distinct ones."""
        uniq: dict[int, int] = {}  # id(param) -> index into infos
        self.infos: list[_ParamInfo] = []
        self.aliases: list[tuple[nn.Module, str, int]] = []  # tied weights: (module, name, info index)
        offset = 0
        first = []
        for owner, name, p in params:
            if id(p) in uniq:
                self.aliases.append((owner, name, uniq[id(p)]))
                continue
            uniq[id(p)] = len(self.infos)
            self.infos.append(_ParamInfo(owner, name, p.shape, p.numel(), offset))
            first.append(p)
            offset += p.numel()
        self.dtype = first[0].dtype
        self.requires_grad = first[0].requires_grad
        self.numel = offset
        return first

    def _initial_shard(self, first: list[torch.Tensor], sync_module_states: bool) -> torch.Tensor:
        """This rank's part of the flat tensor (rank 0's values everywhere with ``sync_module_states``)."""
        full = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for info, p in zip(self.infos, first):
                full[info.offset : info.offset + info.numel].copy_(p.detach().reshape(-1))
            if sync_module_states and self.world > 1:
                src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                with comm.guarded(f"FSDP broadcast of unit '{self.name}' (sync_module_states) from rank 0", self.group):
                    dist.broadcast(full, src=src, group=self.group)
        if self.strategy == ShardingStrategy.NO_SHARD:
            shard = full
        else:
            shard = full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel].clone()
        if self.offload:
            shard = shard.cpu()
            if torch.cuda.is_available() and self.device.type == "cuda":
                shard = shard.pin_memory()  # lets the host-to-device copy run async
        return shard

    @staticmethod
    def check_params(module: nn.Module, params) -> None:
        """Raise ValueError if ``params`` cannot share one flat tensor (the wrapper checks every
        unit before flattening any, so a bad model stays untouched)."""
        dtypes = {p.dtype for _, _, p in params}
        grads = {p.requires_grad for _, _, p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"FSDP flattens a unit's parameters into one tensor, but {type(module).__name__} mixes "
                f"dtypes {sorted(map(str, dtypes))}; cast the model to one dtype before wrapping"
            )
        if len(grads) != 1:
            raise ValueError(
                f"FSDP unit {type(module).__name__} mixes frozen and trainable parameters; "
                "wrap the frozen part as its own unit (auto_wrap_policy) or freeze all of it"
            )

    # -- gather / free -------------------------------------------------------------------
    @property
    def unsharded(self) -> bool:
        """The gathered parameters exist or are on their way (GATHERING or UNSHARDED)."""
        return self.phase is not UnitState.SHARDED

    def unshard(self, async_op: bool = False) -> None:
        """Gather the full flat parameter (no-op when already gathered or gathering)."""
        if self.phase is not UnitState.SHARDED:
            return
        alloc_storage(self.full_param)
        src = self.flat_param.detach()
        if self.offload:
            src = src.to(self.device, non_blocking=True)
        if self.strategy == ShardingStrategy.NO_SHARD:
            self.full_param.data.copy_(src)
            self.phase = UnitState.UNSHARDED
            return
        # Always issued asynchronously, so that even a blocking gather is waited for through
        # the guarded wait (a stalled peer is named, not reported as a bare timeout).
        self._gather_work = all_gather_flat(self.full_param.data, src, self.group, self.world, async_op=True,
                                            shm=self.shm)
        self._gather_src = src
        self.phase = UnitState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._gather_work is not None:
            work, self._gather_work = self._gather_work, None
            wait(work, f"FSDP all-gather of unit '{self.name}'", self.group)
        self._gather_src = None
        if self.phase is UnitState.GATHERING:
            self.phase = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the gathered parameters (no-op for no_shard without offload)."""
        if self.identity or self.phase is UnitState.SHARDED:
            return
        self.wait_unshard()
        free_storage(self.full_param)
        self.phase = UnitState.SHARDED

    def _set_views(self, grad: bool) -> None:
        """Point the module attributes at views into ``full_param`` (see [Note: one gradient per unit])."""
        with torch.set_grad_enabled(grad and self.requires_grad):
            chunks = torch.split(self.full_param, self._split)
        views = [c.view(info.shape) for c, info in zip(chunks, self.infos)]
        for view, info in zip(views, self.infos):
            setattr(info.module, info.name, view)
        for owner, name, idx in self.aliases:
            setattr(owner, name, views[idx])

    # -- hooks (installed by the FSDP wrapper) -------------------------------------------
    def pre_forward(self, module, args):
        self.unshard()
        self.wait_unshard()
        self._set_views(grad=torch.is_grad_enabled())

    def post_forward(self, module, args, output):
        self.state.record_forward(self)
        grad = torch.is_grad_enabled() and self.requires_grad
        if not grad or (self.strategy == ShardingStrategy.FULL_SHARD and not self.is_root):
            self.reshard()
        if torch.is_grad_enabled():
            flat, _ = torch.utils._pytree.tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        state = self.state
        state.queue_finalize()
        if self.phase is not UnitState.UNSHARDED:
            self.unshard()
            self.wait_unshard()
        if state.backward_prefetch:
            nxt = state.next_in_backward(self)
            if nxt is not None and not nxt.unsharded:
                nxt.unshard(async_op=True)
        return grad

    def _post_backward(self, full_param: torch.Tensor) -> None:
        state = self.state
        if not state.sync_grads:
            # no_sync(): keep accumulating the unsharded gradient locally, free the params.
            self.reshard()
            return
        grad = full_param.grad
        if grad is None:
            return
        state.drain()  # finish the previous unit's reduction first (bounds memory)
        if self.world > 1:
            grad.div_(self.world)  # average, as DDP does: divide, then sum
        if self.identity:
            work = dist.all_reduce(grad, group=self.group, async_op=True) if self.world > 1 else None
            state.pending.append((self, work, None, None))
            return
        full_param.grad = None
        if self.strategy == ShardingStrategy.NO_SHARD:
            work = dist.all_reduce(grad, group=self.group, async_op=True) if self.world > 1 else None
            out = grad
        else:
            out = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
            work = reduce_scatter_flat(out, grad, self.group, self.world, self.rank, async_op=True, shm=self.shm)
        state.pending.append((self, work, out, grad))
        self.reshard()

    def finish_grad(self, work, out) -> None:
        """Wait for this unit's reduction and add the result to the shard's gradient."""
        wait(work, f"FSDP gradient reduction of unit '{self.name}'", self.group)
        if out is None:  # identity: reduced in place in flat_param.grad
            return
        if self.offload:
            out = out.to("cpu")
        if self.flat_param.grad is None:
            self.flat_param.grad = out
        else:
            self.flat_param.grad.add_(out)

    # -- state dict helpers ----------------------------------------------------------------
    def gather_full(self) -> torch.Tensor:
        """The unpadded full flat tensor (a copy), gathered from every rank."""
        was = self.unsharded
        self.unshard()
        self.wait_unshard()
        out = self.full_param.detach()[: self.numel].clone()
        if not was:
            self.reshard()
        return out

    def load_shard(self, shard: torch.Tensor) -> None:
        """Overwrite this rank's shard (from a sharded state dict)."""
        with torch.no_grad():
            self.flat_param.copy_(shard)
        self._drop_gathered()

    def _drop_gathered(self) -> None:
        if self.phase is not UnitState.SHARDED and not self.identity:
            self.wait_unshard()
            self.phase = UnitState.SHARDED  # stale gathered copy; gather again on next use
            free_storage(self.full_param)

    def load_full(self, full: torch.Tensor) -> None:
        """Take this rank's shard of an unpadded full flat tensor."""
        padded = torch.zeros(self.padded_numel, dtype=self.dtype)
        padded[: self.numel].copy_(full.reshape(-1))
        with torch.no_grad():
            if self.strategy == ShardingStrategy.NO_SHARD:
                self.flat_param.copy_(padded)
            else:
                self.flat_param.copy_(padded[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel])
        self._drop_gathered()
