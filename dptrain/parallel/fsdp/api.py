"""FullyShardedDataParallel: ZeRO-3 style sharding of parameters, gradients and optimizer state.

Each *unit* (the root module, plus every submodule an auto-wrap policy picks) has its
parameters flattened into one tensor, padded to a multiple of the world size and split
evenly: each rank stores ``1/world`` of it as the ``nn.Parameter`` the optimizer sees, so
parameters, gradients and Adam moments all shrink by the world size (``16 Psi / N`` bytes
for fp32 Adam instead of DDP's ``16 Psi``). One training step, per unit:

1. forward pre-hook: all-gather the unit's flat parameter, point the module's parameter
   attributes at views into it;
2. forward post-hook: free the gathered copy (``full_shard``; the root unit is kept, since
   backward needs it at once) or keep it (``shard_grad_op``); hook the unit's outputs;
3. backward, when the gradient reaches the unit's outputs: gather again and issue the
   next unit's all-gather asynchronously (``backward_prefetch``) so it overlaps this
   unit's backward compute;
4. once every parameter of the unit has its gradient: reduce-scatter the averaged
   gradient (each rank keeps its shard's average) and free the gathered parameters;
5. at the end of backward: wait for the reductions, put the shard gradients in
   ``param.grad`` (on the CPU with ``cpu_offload``).

``no_shard`` replicates everything and all-reduces gradients (DDP's behaviour).

Limits (as in PyTorch's FSDP with flat parameters):

- Outside forward/backward the original parameter attributes (``model.module.fc.weight``)
  are views of freed storage; read weights through :meth:`full_state_dict`.
- Every unit that ran forward must get a gradient in the backward that follows, on every
  rank alike (a unit whose outputs do not reach the loss is not reduced).
- Wrap the model where it will run: ``.to(device)`` after wrapping is not supported (use
  ``device_id``). Activation checkpointing that re-runs a unit's forward inside backward is
  not supported.
- ``state_dict()`` / ``load_state_dict()`` of the wrapper are nn.Module's (flat shards
  keyed ``..._flat_param``); checkpoints use :meth:`full_state_dict` or
  :meth:`sharded_state_dict`.

Wrapping only the root (no ``auto_wrap_policy``) works but gathers the whole model for
forward and backward: no memory is saved and no communication overlaps compute; FSDP
warns once about it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.runtime import env
from dptrain.parallel._verify import verify_same_model
from dptrain.parallel.fsdp import _state_dict
from dptrain.parallel.fsdp._collectives import attach_shared_memory, wait
from dptrain.parallel.fsdp._plan import module_names, owned_params, pick_units, record_key_order
from dptrain.parallel.fsdp._root import RootState, install_optimizer_check
from dptrain.parallel.fsdp._unit import FlatParamUnit, ShardingStrategy

__all__ = ["FullyShardedDataParallel", "FSDP"]


# -- the wrapper -----------------------------------------------------------------------------
class FullyShardedDataParallel(nn.Module):
    """Shard a model's parameters, gradients and optimizer state across the ranks (ZeRO-3).

    Build the optimizer on ``fsdp_model.parameters()`` after wrapping: those are this rank's
    flat shards (one per unit) and the optimizer's state is per rank.

    Args:
        module: the model. Its parameters are flattened per unit and removed from it; after
            wrapping they exist as views only during forward and backward.
        process_group: group to shard over. Default None: the default group (or no group at
            all in a single process, where everything still works).
        auto_wrap_policy: which submodules become units of their own, e.g.
            ``ModuleTypePolicy({TransformerBlock})`` or ``ParamCountPolicy(1_000_000)``, or a
            callable ``(module, nonwrapped_numel) -> bool``. Default None: only the root unit
            (saves no memory; warns once). Submodules already wrapped in FSDP are kept as units.
        sharding_strategy: ``"full_shard"`` (default), ``"shard_grad_op"`` (keep gathered
            parameters from forward until backward) or ``"no_shard"`` (DDP-like).
        cpu_offload: keep the shards, their gradients and so the optimizer step on the CPU.
            Default False.
        backward_prefetch: in backward, start the next unit's all-gather before computing the
            current unit's gradients. Default True.
        device_id: compute device (int = CUDA index, or a ``torch.device``); the module is
            moved there. Default None: the device of the module's parameters.
        sync_module_states: broadcast rank 0's parameters and buffers at construction so
            every rank starts identical. Default True.
        shm: keyword only, not in PyTorch's FSDP: run the all-gathers and reduce-scatters in
            shared memory. None (default): when every rank of the group is on this node and
            the model is on the CPU, unless ``DPTRAIN_SHM=0``; False: never (gloo); True:
            always, raising ValueError where it cannot.

    Raises:
        ValueError: unknown strategy; a parameter shared between two units; a unit mixing
            dtypes or frozen and trainable parameters; a model that differs between ranks
            (raised on every rank, naming the parameter); an optimizer built before wrapping
            (at its first ``step()``); ``shm=True`` where shared memory cannot be used.
        TypeError: ``module`` is not a module; ``shm`` is not None, True or False.
        RuntimeError: no process group while the launcher says the world is larger
            (``dptrain.init()`` not called under ``dptrain run``, ``torchrun`` or ``srun``).

    Example:
        >>> model = FSDP(TinyTransformer(), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}))
        >>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        >>> loss = model(x).logsumexp(-1).mean(); loss.backward()
        >>> model.clip_grad_norm_(1.0); opt.step()
        >>> state = model.full_state_dict()        # plain keys, on rank 0
    """

    _dptrain_fsdp = True  # what _plan.is_fsdp looks for

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        auto_wrap_policy: Callable[[nn.Module, int], bool] | None = None,
        sharding_strategy: str = "full_shard",
        cpu_offload: bool = False,
        backward_prefetch: bool = True,
        device_id: int | str | torch.device | None = None,
        sync_module_states: bool = True,
        *,
        shm: bool | None = None,
    ) -> None:
        super().__init__()
        strategy = getattr(sharding_strategy, "name", sharding_strategy)
        strategy = str(strategy).lower()
        if strategy not in ShardingStrategy.ALL:
            raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}; use one of {list(ShardingStrategy.ALL)}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if shm not in (None, True, False):
            raise TypeError(f"FSDP(shm=...) takes None, True or False, got {shm!r}")
        self.module = module
        self.sharding_strategy = strategy
        self.cpu_offload = bool(cpu_offload)
        self.process_group = process_group
        self._is_root = True
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed:
            env.check_joined("dptrain.FullyShardedDataParallel")
        self._world = dist.get_world_size(process_group) if distributed else 1
        self._rank = dist.get_rank(process_group) if distributed else 0
        self.compute_device = self._place(module, device_id, distributed)
        inner = self._check_nesting(module)
        if self._world > 1:
            verify_same_model(module, process_group, self._rank, "FullyShardedDataParallel")
        if sync_module_states and self._world > 1:
            with torch.no_grad():
                src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
                with comm.guarded("FSDP broadcast of the buffers (sync_module_states) from rank 0", process_group):
                    for buf in module.buffers():
                        dist.broadcast(buf, src=src, group=process_group)
        self._state = RootState(bool(backward_prefetch))
        self._key_order = record_key_order(module)
        self._units: list[FlatParamUnit] = []
        for m in inner:  # manually nested FSDP: their units become ours
            m._is_root = False
            self._units.extend(m._units)
            if m._shm is not None:  # ours serves them all (attach_shared_memory below)
                m._shm.close()
                m._shm = None
        self._units.extend(self._flatten_units(module, auto_wrap_policy, sync_module_states))
        for unit in self._units:
            unit.state = self._state
        self._state.units = self._units
        self._shm = attach_shared_memory(self._units, process_group, self.compute_device, shm)
        install_optimizer_check()
        if self._world > 1 and strategy != ShardingStrategy.NO_SHARD and len(self._units) == 1:
            env._warn_once_main(
                "FSDP wraps only the root module: every forward and backward gathers the whole model, "
                "so no memory is saved and no communication overlaps compute; pass an auto_wrap_policy, "
                "e.g. auto_wrap_policy=ModuleTypePolicy({TransformerBlock})"
            )

    def _place(self, module: nn.Module, device_id: Any, distributed: bool) -> torch.device:
        """The compute device: ``device_id`` (the module moves there), else where the module is."""
        if device_id is not None:
            device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
            module.to(device)
        else:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        if distributed and self._world > 1 and device.type == "cpu" and dist.get_backend(self.process_group) == "nccl":
            raise ValueError(
                f"rank {self._rank}: FSDP over NCCL needs the model on a GPU, but its parameters are on the CPU; "
                "pass device_id=dptrain.local_rank() (use cpu_offload=True to keep the shards in CPU memory)"
            )
        return device

    @staticmethod
    def _check_nesting(module: nn.Module) -> list["FullyShardedDataParallel"]:
        """FSDP wrappers nested inside ``module``; refuse modules flattened by a foreign wrapper."""
        inner = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        nested = {id(x) for f in inner for x in f.module.modules()}
        for name, sub in module.named_modules():
            if "_flat_param" in sub._parameters and id(sub) not in nested:
                raise ValueError(
                    f"module '{name or type(module).__name__}' was already flattened by an FSDP wrapper that is not "
                    "part of this model; wrap the original model once (nest FSDP instances inside it instead)"
                )
        return inner

    def _flatten_units(self, module: nn.Module, policy: Any, sync_module_states: bool) -> list[FlatParamUnit]:
        """Pick the units, check every one, then flatten them (a bad model raises untouched)."""
        unit_modules = pick_units(module, policy)
        owner: dict[int, str] = {}
        names = module_names(module)
        unit_ids = {id(m) for m in unit_modules}
        plan = [(m, owned_params(m, owner, names, unit_ids)) for m in unit_modules]
        plan = [(m, params) for m, params in plan if params]
        for m, params in plan:
            FlatParamUnit.check_params(m, params)
        units = []
        for m, params in plan:
            unit = FlatParamUnit(
                m, params, self.sharding_strategy, self.process_group, self._rank, self._world, self.compute_device,
                self.cpu_offload, sync_module_states, self._state,
            )  # fmt: skip
            m.register_forward_pre_hook(unit.pre_forward, prepend=True)
            m.register_forward_hook(unit.post_forward)
            unit.is_root = m is module
            unit.name = names[id(m)] or "<root>"
            units.append(unit)
        return units

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapper lacks come from the wrapped model (as with torch's FSDP).
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    # -- forward / context managers --------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_root:
            self._state.start_iteration()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, full size) without communication.

        The first backward after the context reduces the accumulated gradients. Costs
        memory: each unit keeps a full-size gradient between steps.

        Example:
            >>> with model.no_sync():
            ...     model(x1).sum().backward()
            >>> model(x2).sum().backward()   # reduce-scatters the sum of both
        """
        self._require_root("no_sync")
        prev = self._state.sync_grads
        self._state.sync_grads = False
        try:
            yield
        finally:
            self._state.sync_grads = prev

    def _require_root(self, what: str) -> None:
        if not self._is_root:
            raise RuntimeError(f"{what}() must be called on the outermost FSDP module, not on a nested one")

    # -- gradient clipping ----------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm``.

        The norm is taken over the whole model (all shards, all ranks), as
        ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model. Collective: call
        it on every rank.

        Args:
            max_norm: largest allowed norm.
            norm_type: p of the p-norm; ``float("inf")`` for the max norm. Default 2.0.

        Returns:
            The total norm before clipping (a scalar tensor, on the shards' device).
        """
        self._require_root("clip_grad_norm_")
        norm_type = float(norm_type)
        grads = [u.flat_param.grad for u in self._units if u.flat_param.grad is not None]
        dev = self._units[0].flat_param.device if self._units else torch.device("cpu")
        if math.isinf(norm_type):
            local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).to(dev, torch.float32)
        else:
            local = sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0, device=dev))
        local = local.reshape(1).clone()
        sharded = self.sharding_strategy != ShardingStrategy.NO_SHARD
        if sharded and self._world > 1:
            # Shards are disjoint: sum the p-th powers (or take the max) across ranks.
            comm_t = local.to(self.compute_device)
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            wait(dist.all_reduce(comm_t, op=op, group=self.process_group, async_op=True), "FSDP gradient-norm all-reduce", self.process_group)
            local = comm_t.to(dev)
        total = local[0] if math.isinf(norm_type) else local[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    # -- state dicts (see _state_dict.py) -------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded model state with the plain model's keys, as CPU tensors.

        Collective (every rank must call it). The result loads with ``load_state_dict`` into
        the unwrapped model. Parameters are identical on every rank; buffers (e.g. BatchNorm
        statistics, which FSDP does not synchronise) are the calling rank's own.

        Args:
            rank0_only: only rank 0 builds the dict; the others get ``{}``. Default True.
        """
        self._require_root("full_state_dict")
        return _state_dict.full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full (plain-key) state dict; pass the same dict on every rank.

        Raises:
            ValueError: missing or unexpected keys, or a shape that differs from the model's.
        """
        self._require_root("load_full_state_dict")
        _state_dict.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict:
        """This rank's shards plus metadata; no communication.

        Returns ``{"metadata": {...}, "flat_params": {unit name: shard}, "buffers": {key: tensor}}``
        with CPU tensors. Save one per rank; load it with :meth:`load_sharded_state_dict` on
        the same rank of an identically wrapped model with the same world size.
        """
        self._require_root("sharded_state_dict")
        return _state_dict.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank.

        Raises:
            ValueError: the dict was saved with another world size, by another rank, with a
                different strategy or wrapping, or for a different model.
        """
        self._require_root("load_sharded_state_dict")
        _state_dict.load_sharded_state_dict(self, state_dict)


FSDP = FullyShardedDataParallel
