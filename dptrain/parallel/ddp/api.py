"""DistributedDataParallel: one model replica per rank, gradients averaged by our reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (the installed PyTorch's
constructor arguments, up to 2.13's; same numerics): construction checks that every rank
built the same model and copies rank 0's parameters and buffers to all; each forward
broadcasts buffers (BatchNorm statistics) from rank 0; backward averages gradients through
:class:`dptrain.parallel.ddp._reducer.Reducer`.

[Note: torch.compile]
``torch.compile(dptrain.DDP(model))`` compiles the wrapped module and leaves the wrapper's
own work eager: the steps before and after the module call (buffer broadcast, join, arming
the reducer, the backward sink) are ``torch.compiler.disable``-d, which costs two graph
breaks per forward and nothing else. The reducer's hooks are post-accumulate-grad hooks on
the parameters: they run in the eager autograd engine when the compiled backward hands each
gradient to its parameter, so the reduction is the same code and the same numbers as
without compile. While the module runs, the wrapper registers itself where dynamo's
``DDPOptimizer`` looks for the active DDP module (as PyTorch's DDP does), so dynamo splits
the compiled graph at bucket boundaries and buckets can be all-reduced while the rest of the
compiled backward runs. Compiled autograd (``torch._dynamo.config.compiled_autograd``) was
checked by hand on a small model (gradients averaged) but is not covered by the tests.

[Note: pickling and copies]
``torch.save(ddp)``, ``pickle`` and ``copy.deepcopy(ddp)`` drop the process group and the
reducer and build a fresh reducer when loaded, on the default group (PyTorch's rule; a DDP
on another group refuses to pickle). No collective runs then, so one rank alone may copy
its model (an EMA or a frozen teacher); a copy that trains reduces over the same group, so
every rank must train it. Unlike PyTorch, a registered communication hook is registered on
the copy too. Without an initialized process group the loaded module is a plain wrapper in a
single process; under a launcher that says the world is larger, loading it raises until
``dptrain.init()`` has run (as PyTorch's DDP does).

[Note: in-place recovery]
After a rank died and the process group was re-formed, ``ddp._rejoin(layout)`` on every rank
moves a DDP onto the new default group, and a replacement process builds its DDP inside
:func:`joining_job` (no collective at construction); ``ddp._recovery_layout()`` on a healthy
rank is what they all adopt. The whole protocol is in ``_recovery.py``
([Note: rejoining a re-formed group]).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from dptrain import _shm
from dptrain.runtime.tensors import move_to_device
from dptrain.parallel import dp as _dp
from dptrain.parallel.ddp import _recovery
from dptrain.parallel.ddp import _setup as setup
from dptrain.parallel.ddp._compression import AutoCompression, check_compression, check_extensions, default_bucket_mb
from dptrain.parallel.ddp._compression import install as install_compression
from dptrain.parallel.ddp._delayed import DelayedAllReduce
from dptrain.parallel.ddp._join import DDPJoinHook, all_reduce_requires_sync, find_common_rank
from dptrain.parallel.ddp._mixed_precision import MixedPrecisionState, _UpcastHookState, allreduce_and_upcast_hook
from dptrain.parallel.ddp._optim_in_backward import adopt_optimizers_in_backward
from dptrain.parallel.ddp._overlap import OptimizerOverlap
from dptrain.parallel.ddp._recovery import joining_job
from dptrain.parallel.ddp._reducer import Reducer, bucket_size_limits
from dptrain.parallel.ddp._setup import DDPSetupError
from dptrain.parallel.ddp._signature import bind_arguments, check_bucket_cap_mb, installed_signature, torch_ddp, torch_has
from dptrain.parallel.ddp._sink import attach_sink

__all__ = ["DistributedDataParallel", "DDP", "DDPSetupError", "joining_job"]

_TorchDDP = torch_ddp()  # torch's class, also where its names were rebound to ours


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: one replica per rank, gradients averaged across ranks in backward.

    Drop-in for ``torch.nn.parallel.DistributedDataParallel``: the installed PyTorch's
    arguments in PyTorch's order (an argument that torch lacks, such as
    ``forward_sync_buffers`` before 2.13, raises TypeError as PyTorch's DDP does), the
    same ``module.``-prefixed ``state_dict()``, ``no_sync()``,
    ``join()``, ``register_comm_hook()``, ``_set_static_graph()`` and
    ``_set_params_and_buffers_to_ignore_for_model()``, pickling and ``copy.deepcopy``,
    ``torch.compile`` and ``backward(create_graph=True)``; on two CPU ranks the same
    parameters bit for bit after any number of steps. Without a process group (a world of
    one) it is a transparent wrapper.

    Args:
        module: the model, already on its device. Every rank must build the same model.
        device_ids: ``[local_rank]`` for a single-device CUDA module (inputs are moved
            there); None for CPU and multi-device modules. Default None.
        output_device: for single-device CUDA modules only (default ``device_ids[0]``);
            outputs stay where the module puts them, as with PyTorch's single-device DDP.
        dim: kept for compatibility (single-device DDP does not scatter). Default 0.
        broadcast_buffers: deprecated spelling of ``forward_sync_buffers`` (FutureWarning,
            as in PyTorch 2.13); ``False`` also keeps buffers out of the initial broadcast.
            Default None.
        init_sync: at construction, check that every rank built the same model and copy
            rank 0's parameters and buffers to all. ``False`` skips both (the ranks must
            then already agree). Default True.
        process_group: group to reduce over. Default None (the whole world).
        bucket_cap_mb: bucket size in MiB. Default None: 25 MiB, with a 1 MiB first bucket
            so that the first all-reduce starts early.
        find_unused_parameters: walk the autograd graph from the forward outputs and treat
            parameters it cannot reach as ready (zero contribution); a parameter unused on
            every rank keeps its ``.grad`` untouched. Default False.
        check_reduction: deprecated and without effect; warns (FutureWarning). Default False.
        gradient_as_bucket_view: make ``.grad`` views into the flat bucket buffers (no
            copy-out, less memory). Default False.
        static_graph: the set of used parameters and the number of times each one is used
            are the same every iteration; learnt in the first iteration. Allows a parameter
            to receive its gradient several times per backward (reentrant activation
            checkpointing). Default False.
        delay_all_reduce_named_params: ``(name, parameter)`` pairs reduced outside the
            buckets, in one all-reduce fired when ``param_to_hook_all_reduce``'s gradient is
            computed. Default None.
        param_to_hook_all_reduce: the parameter that fires that all-reduce; given together
            with ``delay_all_reduce_named_params``. Default None.
        mixed_precision: ``torch.nn.parallel.distributed._MixedPrecision(param_dtype,
            reduce_dtype, buffer_dtype)`` (or any object with those fields): forward and
            backward in ``param_dtype``, gradients reduced in ``reduce_dtype``, buffers kept
            in ``buffer_dtype``; parameters and ``.grad`` are full precision outside forward
            and backward. With ``gradient_as_bucket_view=True`` the buckets hold the
            ``param_dtype`` gradients during backward and the reduced bucket is cast back
            into the full-precision ``.grad``. Needs a process group. Default None.
        device_mesh: a 1-D ``DeviceMesh`` to reduce over, instead of ``process_group``.
            Default None.
        skip_all_reduce_unused_params: do not all-reduce a bucket whose parameters are all
            unused in this iteration (their ``.grad`` stays untouched). The unused set must
            be the same on every rank. Default False.
        bucket_cap_mb_list: one size in MiB per bucket, in launch order (the last one
            repeats); overrides ``bucket_cap_mb``. Default None.
        batched_grad_copy: PyTorch's batched numerics: scale a full bucket with one
            division instead of multiplying each gradient by ``1 / world_size``. Default False.
            (Either way dptrain copies a bucket's gradients in together, once it is full.)
        forward_sync_buffers: broadcast buffers (e.g. BatchNorm statistics) from rank 0 at
            the start of each training forward and after ``join()``. Default None (True).

        shm: keyword only, not in PyTorch's DDP: all-reduce the gradients through shared
            memory. None (default): when every rank of the group is on this node and the module
            is on the CPU, unless ``DPTRAIN_SHM=0`` (across nodes: one segment per node, see
            ``DPTRAIN_SHM_NODES`` in docs/multinode.md); False: never (gloo); True: always,
            raising ValueError where it cannot. The same numbers as gloo (bitwise on two
            ranks; in rank order on more). A copy (``copy.deepcopy``, unpickling) reduces
            through gloo: making one needs no collective.
        compression: keyword only, not in PyTorch's DDP: None (default, fp32, PyTorch's
            numbers); ``"auto"``: time the first synced steps; keep fp32 on one node and
            where communication hides behind backward, else try bf16 and PowerSGD for a
            few steps each and keep the fastest (decided within 14 synced steps; rank 0
            prints which and why; see ``compression_choice``); ``"bf16"``, ``"fp16"``
            (with 1/4 MiB buckets unless ``bucket_cap_mb`` is given); ``"powersgd"``
            (rank 4, error feedback, after 10 plain steps). The same on every rank.
            Other settings: ``register_comm_hook``.
        overlap_optimizer: keyword only, not in PyTorch's DDP: an optimizer over the model's
            parameters (SGD, Adam, AdamW, Adagrad, Adamax, NAdam, RAdam, RMSprop, Adadelta,
            Rprop) that steps each bucket as soon as it is averaged, overlapping the update
            with communication; bitwise ``optimizer.step()``'s result. Keep calling
            ``optimizer.step()`` (after a synced backward it steps only what no bucket
            holds) and ``zero_grad()``; ``no_sync`` accumulation works; changing gradients
            before the step (global-norm clipping, ``GradScaler``) raises. Buckets of
            1/4 MiB unless ``bucket_cap_mb`` is given. Copies of the model do not overlap.
            Default None.

    Raises:
        DDPSetupError: (a ``RuntimeError`` and a ``ValueError``) the ranks built different
            models (every rank raises, naming the first difference and the ranks), the
            module has no parameter that requires grad, it holds uninitialized (lazy)
            parameters, or both ``process_group`` and ``device_mesh`` were given.
        TypeError: an argument that the installed torch's DDP does not have (PyTorch's
            message: "got an unexpected keyword argument"), or a list as ``bucket_cap_mb``.
        ValueError: ``device_ids``/``output_device`` for a CPU or multi-device module, a
            bucket size that is not positive, only one of the two delayed-all-reduce
            arguments, an unknown ``compression``, an ``overlap_optimizer`` that cannot be
            stepped bucket by bucket, or ``compression``/``overlap_optimizer`` together
            with ``mixed_precision``.
        NotImplementedError: ``device_mesh`` sliced out of a larger mesh (DDP with tensor
            parallelism), ``mixed_precision`` without a process group, or an argument of a
            torch newer than dptrain.
        RuntimeError: no process group while the launcher says the world is larger
            (``dptrain.init()`` not called under ``dptrain run``, ``torchrun`` or ``srun``).

    Example:
        >>> dptrain.init()
        >>> model = dptrain.DDP(nn.Linear(10, 5))
        >>> loss = model(torch.randn(8, 10)).sum(); loss.backward()   # grads averaged
        >>> with model.no_sync():                  # accumulate without communication
        ...     model(x1).sum().backward()
        >>> model(x2).sum().backward()            # averages the accumulated gradients
        >>> ema = copy.deepcopy(model)            # a working copy, no collective
        >>> fast = torch.compile(model)           # compiled module, same reducer
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The installed torch's arguments, no more (see dptrain.parallel.ddp._signature).
        self._construct(**bind_arguments(self, args, kwargs, _IMPLEMENTED))

    def _construct(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: list[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        shm: bool | None = None,
        compression: str | None = None,
        overlap_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
            )
        self.process_group = setup.resolve_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        # Whether it reduces over the default group, the one that _rejoin can follow when the
        # process group is re-formed (the group object itself dies with the old one).
        self._world_group = device_mesh is None and self.process_group is not None and (
            process_group is None or process_group is dist.group.WORLD)
        self._distributed = self.process_group is not None
        self.module = module
        self.dim = dim
        delayed = list(delay_all_reduce_named_params or [])
        self.parameters_to_ignore = setup.ignored_names(module) | {n for n, _ in delayed}
        managed = self._check_module(module, bool(delayed))
        self.device_type, self.device_ids = setup.check_devices(managed, device_ids, output_device)
        self.output_device = setup.output_device_index(self.device_ids, output_device)
        self.device = managed[0].device
        sync = setup.resolve_buffer_sync(broadcast_buffers, forward_sync_buffers, torch_has("forward_sync_buffers"))
        self.forward_sync_buffers, init_sync_buffers = sync
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        self.bucket_cap_mb_list = list(bucket_cap_mb_list) if bucket_cap_mb_list else None
        self.bucket_bytes_cap = max(bucket_size_limits(bucket_cap_mb, bucket_cap_mb_list))  # read by dynamo
        # PyTorch's attributes: the per-bucket byte limits ([] without bucket_cap_mb_list) and
        # whether the default 1 MiB first bucket applies.
        self.bucket_bytes_cap_list = bucket_size_limits(None, self.bucket_cap_mb_list) if self.bucket_cap_mb_list else []
        self.bucket_bytes_cap_default = bucket_cap_mb is None and not self.bucket_cap_mb_list
        self.broadcast_bucket_size = setup.BROADCAST_BUCKET_BYTES  # PyTorch's attribute (parameter broadcasts)
        self.mixed_precision = mixed_precision
        self.static_graph = False  # set by _set_static_graph() below, as in PyTorch
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._lazy_init_ran = False  # see _pre_forward: optimizers in backward are adopted then
        self._divide_by_initial_world_size = True
        setup.warn_ignored_arguments(check_reduction, bucket_cap_mb, bucket_cap_mb_list)
        self._check_mixed_precision()
        self.compression = check_compression(compression)
        self._auto_compression: AutoCompression | None = None
        self._overlap_optimizer = overlap_optimizer
        self._overlap: OptimizerOverlap | None = None
        check_extensions(self.mixed_precision, self.compression, overlap_optimizer)
        self.reducer: Reducer | None = None
        self._delayed: DelayedAllReduce | None = None
        self._mixed_precision: MixedPrecisionState | None = None
        self._rank = dist.get_rank(self.process_group) if self._distributed else 0
        self._shm_wish = shm
        self._shm: Any = None
        if self._distributed:
            self._set_up_ranks(delayed, param_to_hook_all_reduce, init_sync, init_sync_buffers, static_graph)
        if static_graph:
            self._set_static_graph()

    def _set_up_ranks(self, delayed: list, hook_param: Any, init_sync: bool, sync_buffers: bool, static: bool) -> None:
        """The collectives of construction (in PyTorch's order), then the reducer.

        Inside :func:`joining_job` none of them: a replacement's peers are not constructing
        (see [Note: in-place recovery]); it reduces through gloo/NCCL until ``_rejoin``.
        """
        if _recovery.is_joining():
            if delayed:
                self._delayed = DelayedAllReduce(delayed, hook_param, self.process_group)
            self._build_reducer()
            return
        if delayed:
            self._delayed = DelayedAllReduce(delayed, hook_param, self.process_group)
            setup.broadcast_coalesced([p.detach() for _, p in delayed], 0, self.process_group,
                                      "DDP initial broadcast of the delayed parameters")
        if init_sync and self._reducer_params()[0]:
            setup.verify_same_model(self.module, self.parameters_to_ignore, self._settings(static), self.process_group)
            tensors = setup.managed_tensors(self.module, self.parameters_to_ignore, sync_buffers)
            setup.broadcast_coalesced(tensors, 0, self.process_group, "DDP initial broadcast of the model")
        params = self._reducer_params()[0]
        if params:  # a collective: every rank decides together whether memory can be shared
            self._shm = _shm.for_reducer(params, self.process_group, self._shm_wish, "DDP gradient all-reduce")
        self._build_reducer()

    def _check_module(self, module: nn.Module, has_delayed: bool) -> list[nn.Parameter]:
        """The managed parameters; PyTorch's errors for a module DDP cannot train."""
        managed = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        if not any(p.requires_grad for p in managed) and not has_delayed:
            raise DDPSetupError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                f"gradient: no parameter of {type(module).__name__} requires grad (or all are ignored). Train it "
                "without DDP, or unfreeze a parameter."
            )
        for n, p in module.named_parameters():
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise DDPSetupError(
                    f"Modules with uninitialized parameters can't be used with `DistributedDataParallel`: '{n}' is "
                    "a lazy parameter. Run a dummy forward pass to correctly initialize the modules."
                )
        return managed or list(module.parameters())

    def _check_mixed_precision(self) -> None:
        if self.mixed_precision is None:
            return
        if not self._distributed:
            raise NotImplementedError(
                "DistributedDataParallel(mixed_precision=...) needs an initialized process group (dptrain.init() "
                "under dptrain run or torchrun); in a single process use torch.autocast instead"
            )

    def _settings(self, static_graph: bool) -> dict:
        # Constructor arguments that shape the collectives: every rank must pass the same.
        mp = self.mixed_precision
        mp_dtypes = None if mp is None else [str(mp.param_dtype), str(mp.reduce_dtype), str(mp.buffer_dtype)]
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "bucket_cap_mb_list": self.bucket_cap_mb_list,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": static_graph,
            "forward_sync_buffers": self.forward_sync_buffers,
            "skip_all_reduce_unused_params": self.skip_all_reduce_unused_params,
            "mixed_precision": mp_dtypes,
            "compression": self.compression,
        }

    def _reducer_params(self) -> tuple[list[nn.Parameter], list[str]]:
        return setup.params_for_reducer(self.module, self.parameters_to_ignore)

    def _build_reducer(self) -> None:
        """The reducer (and mixed precision's hook); no collective, so unpickling may call it."""
        params, names = self._reducer_params()
        if not params:
            return  # every trainable parameter is delayed: no buckets (PyTorch's rule)
        if self.mixed_precision is not None and self._mixed_precision is None:
            self._mixed_precision = MixedPrecisionState(self.mixed_precision, self.module, self.parameters_to_ignore)
        self.reducer = Reducer(
            params,
            names,
            self.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            bucket_cap_mb_list=self.bucket_cap_mb_list or default_bucket_mb(
                self.bucket_cap_mb, self.compression, self._overlap_optimizer is not None
            ),
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            batched_grad_copy=self.batched_grad_copy,
            grad_dtype=None if self._mixed_precision is None else self._mixed_precision.grad_dtype,
            shm=self._shm,
        )
        if self._mixed_precision is not None:
            self.reducer.comm_hook_state = _UpcastHookState(self)
            self.reducer.comm_hook = allreduce_and_upcast_hook
        self._auto_compression = install_compression(
            self.reducer, self.compression, self._shm is not None, self.bucket_cap_mb is None and not self.bucket_cap_mb_list
        )
        if self._overlap_optimizer is not None:
            self._overlap = OptimizerOverlap(self._overlap_optimizer, self.reducer)
            self.reducer.on_bucket_reduced = self._overlap.step_bucket

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)  # what torch.compile compiles (see [Note: torch.compile])
        return self._post_forward(output)

    @torch.compiler.disable
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        reducer = self.reducer
        if reducer is None:  # a world of one, or every parameter delayed: nothing to prepare
            return inputs, kwargs
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            reducer.check_prior_reduction()
        if not self._lazy_init_ran:  # PyTorch's moment: before the first forward, after the constructor
            self._lazy_init_ran = True
            adopt_optimizers_in_backward(reducer, reducer.params)
        work = Join.notify_join_context(self)
        if work is not None:
            reducer.set_divisor_work(work, self._divide_by_initial_world_size)
        if torch.is_grad_enabled():
            reducer.rebuild_buckets()  # once, after the first backward (see the reducer's notes)
        buffers = self._buffers_to_sync()
        if buffers:
            src = find_common_rank(self, self._rank, True) if self._join_config.enable else 0
            self._sync_buffers(src, buffers)
        if self._join_config.enable:
            all_reduce_requires_sync(self, joined=False)
        if self.device_ids:
            target = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = setup.map_tensors((inputs, kwargs), lambda t: t.to(target, non_blocking=True))
        if self._mixed_precision is not None:
            inputs, kwargs = self._mixed_precision.before_forward(inputs, kwargs)
        # Where dynamo's DDPOptimizer finds the DDP module whose buckets split compiled graphs.
        outer = _TorchDDP._active_ddp_module
        self.__dict__["_outer_ddp"] = None if outer is self else outer  # not a submodule: plain attribute
        _TorchDDP._active_ddp_module = self
        return inputs, kwargs

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        if self._delayed is not None:
            self._delayed.point_grads_at_buffer()
        reducer = self.reducer
        if reducer is None:
            return output
        _TorchDDP._active_ddp_module = self.__dict__.pop("_outer_ddp", None)
        if not torch.is_grad_enabled() and self._mixed_precision is not None:
            self._mixed_precision.restore()  # no backward follows
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            reducer.prepare_for_backward(output if self.find_unused_parameters and not self.static_graph else None)
            output = attach_sink(output, reducer)
        else:
            self.require_forward_param_sync = False
        return output

    @property
    def compression_choice(self) -> str | None:
        """The compression in use: None (fp32), "bf16", "fp16" or "powersgd"; with
        ``compression="auto"``, None until it has decided (within 14 synced steps), then its choice."""
        if self._auto_compression is not None:
            choice = self._auto_compression.choice
            return None if choice in (None, "fp32") else choice
        return self.compression

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (PyTorch's method of the same name)."""
        return self._will_sync_buffers()

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """The buffers the next forward broadcasts (none when it broadcasts none).

        Which modules hold which buffers is found once (as PyTorch lists them once): walking
        every module at every forward costs ~0.5 us a module on the step's critical path. The
        slots are read every time, so a module that reassigns a buffer (``.to()``, or
        ``self.running_mean = ...``) is still followed; a tensor held by two modules counts once.
        """
        if not (self.require_forward_param_sync and self.forward_sync_buffers):
            return []
        slots = self.__dict__.get("_buffer_slots")
        if slots is None:
            slots = self.__dict__["_buffer_slots"] = setup.buffer_slots(self.module, self.parameters_to_ignore)
        found = {id(b): b for m, n in slots if (b := m._buffers.get(n)) is not None}
        return list(found.values())

    def _will_sync_buffers(self) -> bool:
        return bool(self._buffers_to_sync())

    def _sync_buffers(self, src: int, buffers: list[torch.Tensor]) -> None:
        with _preserve_version_counters(buffers):
            setup.broadcast_coalesced(buffers, src, self.process_group, "DDP buffer broadcast (forward)")

    # ------------------------------------------------------------------ settings after construction
    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated name of ``forward_sync_buffers`` (PyTorch 2.13 keeps it as a property)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Sequence[str]
    ) -> None:
        """Exclude parameters and buffers, by fully qualified name, from DDP's synchronisation.

        Call on the plain model before wrapping it. Ignored parameters get no gradient
        all-reduce and, like ignored buffers, no broadcast at construction, forward or
        ``join()``; they may differ between ranks. Same name, attributes and effect as
        PyTorch's, so models prepared for either DDP work with both.

        Example:
            >>> ignore = ["head.bias", "bn.running_mean"]
            >>> DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
            >>> ddp = DistributedDataParallel(model)
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                param._ddp_ignored = True
        for name, buffer in module.named_buffers():
            if name in params_and_buffers_to_ignore:
                buffer._ddp_ignored = True

    def _set_static_graph(self) -> None:
        """Turn on static-graph mode after construction, before training (PyTorch's private API)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.static_graph = True
        if self.reducer is not None:
            self.reducer.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
                "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be "
                "sure these unused parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        if self._distributed and self.process_group is not dist.group.WORLD:
            raise DDPSetupError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
                "is, when you have called init_process_group and have not passed process_group (or device_mesh) "
                "to the DDP constructor. Pickle ddp.module instead."
            )
        state = dict(self.__dict__)
        state.pop("process_group")
        reducer = state.pop("reducer")
        state.pop("_outer_ddp", None)
        state.pop("_buffer_slots", None)  # found anew in the copy, whose modules are others
        state["_shm"] = None  # a copy reduces through gloo: see the shm argument
        state["_auto_compression"] = None  # a copy with compression="auto" measures and decides anew
        state["_overlap_optimizer"] = state["_overlap"] = None  # the optimizer holds the original's parameters
        if reducer is not None and self._mixed_precision is None and reducer.comm_hook is not None and not self.compression:
            state["_comm_hook"] = (reducer.comm_hook, reducer.comm_hook_state)
        return state

    def __setstate__(self, state: dict) -> None:
        comm_hook = state.pop("_comm_hook", None)
        super().__setstate__(state)
        self.process_group = setup.resolve_group(None, None)  # refuses a forgotten init under a launcher
        self._distributed = self.process_group is not None
        self._world_group = self._distributed
        self._rank = dist.get_rank(self.process_group) if self._distributed else 0
        self.reducer = None
        self._lazy_init_ran = False  # the copy's reducer adopts the copy's optimizers in backward
        if not self._distributed:
            self._mixed_precision = None
            return
        self._build_reducer()
        if self.reducer is not None and self.static_graph:
            self.reducer.set_static_graph()
        if self._delayed is not None:
            self._delayed.attach(self.process_group)
        if comm_hook is not None and self.reducer is not None:
            self.register_comm_hook(comm_hook[1], comm_hook[0])

    # ------------------------------------------------------------------ in-place recovery
    def _recovery_layout(self, undo_completed_backward: bool = False, *, group_rebuilt: bool = False) -> dict:
        """What a DDP of the same model on another process needs to reduce exactly like this one.

        Plain, picklable data (send it with ``broadcast_object_list``): the bucket layout, the
        one-time bucket rebuild's progress (done, or the order agreed on), the number of synced
        backwards, a static graph's learnt hook counts and unused set, the bucket limits, and
        the decision of ``compression="auto"``. No collective; one rank may call it alone.

        A synced backward that did not complete on this rank (a peer died during it) does not
        count: the layout is the one that backward started with, as the step will be redone.
        A backward that completed counts, unless ``undo_completed_backward`` is True: pass it
        when the step that will be redone had its backward complete here (it failed later,
        e.g. in a metric's all-reduce), so that the redone backward starts from the same
        layout as the first time. Take the layout from the rank whose training state the
        others restore (rank 0 when it is as far as any), at the same step.

        ``group_rebuilt`` (default False): this DDP reduces over a process group of its own
        (``process_group=``), which the caller will make again after the re-form and pass to
        :meth:`_rejoin`; without it such a DDP raises. The layout then fits the ranks of that
        group only.

        Raises:
            NotImplementedError: this DDP cannot be recovered in place (see
                :meth:`_recovery_obstacle`); the message names why.
        """
        return _recovery.layout_of(self, undo_completed_backward, group_rebuilt)

    def _recovery_obstacle(self, *, group_rebuilt: bool = False) -> str | None:
        """Why this DDP cannot be recovered in place (``overlap_optimizer``, PowerSGD, a
        ``compression="auto"`` still measuring, a group other than the default one unless the
        caller rebuilds it -- ``group_rebuilt``, default False --, ...), or None."""
        return _recovery.obstacle(self, describing=True, group_rebuilt=group_rebuilt)

    def _leave_group(self) -> None:
        """Let go of the process group before it is destroyed (in-place recovery; no collective).

        Nothing of this DDP references the group afterwards, so destroying it closes its
        connections at once; the reducer's backward in flight is dropped and a shared-memory
        group aborted. :meth:`_rejoin` does it too when it was not done first.
        """
        _recovery.leave_group(self)

    def _prepare_rejoin(self, directory: str | None, world_size: int | None = None) -> bool:
        """Before :meth:`_rejoin`, while waiting for the other ranks: make what the rejoin will most
        likely need (no collective; call it on one rank or several).

        With shared memory on one node, that is the segment of the new reducer, made in
        ``directory`` -- a private folder on /dev/shm that outlives this process, such as
        ``dptrain run``'s recovery folder -- and used by the next :meth:`_rejoin` when its size
        is the one the ranks need there (else removed then): the rejoin then does one exchange
        less and no rank reserves pages on the way to the next step.

        Args:
            directory: where the segment may be made; None, or a folder not on /dev/shm:
                nothing is made.
            world_size: the ranks of the group to come (default None: those of the current
                default group, which must exist). Given, nothing asks the process group: it
                may be being re-formed on another thread meanwhile.

        Returns:
            True when something was made, else False (the rejoin does it all, as without).

        Example:
            >>> ddp._prepare_rejoin(os.environ["DPTRAIN_RECOVERY_DIR"])   # doctest: +SKIP
            >>> ddp._rejoin(layout)                                       # on every rank
        """
        return _recovery.prepare_rejoin(self, directory, world_size)

    def _rejoin(self, layout: dict | None = None, *, verify: bool = True, process_group: Any = None) -> None:
        """Move onto the re-formed default process group (or ``process_group``); collective: every rank
        of that group calls it.

        Call after the old default group was destroyed and a new one created with the same
        rank numbers, on every rank with the same ``layout`` (from :meth:`_recovery_layout` on
        a healthy rank), before the next forward. A survivor's backward in flight is dropped:
        the old reducer's hooks are removed, its collectives abandoned (a shared-memory group
        is aborted, not waited for, so a dead or absent peer cannot hold it). Then the DDP
        reduces over the new ``dist.group.WORLD``; the ranks check that they built the same
        model (``verify``) and decide on shared memory again (when this DDP may use it), as at
        construction; a new reducer is built and adopts ``layout`` -- without one every rank
        starts afresh, as a new DDP would (the bucket rebuild, a static graph's first
        iteration and ``compression="auto"``'s measurement happen again). A registered
        communication hook is kept (a process group as its state becomes the new one), as is
        the state of ``mixed_precision`` (parameters back in full precision) and of
        ``delay_all_reduce_named_params``. Every parameter's ``.grad`` is set to None.

        Parameters, buffers and optimizer state are not sent: restoring them is the caller's
        business (before or after this call).

        Args:
            layout: from :meth:`_recovery_layout` on a healthy rank; the same on every rank.
            verify: check that every rank built the same model (one all-gather). Default True.
            process_group: the group to reduce over from now on, made by the caller after the
                re-form, for a DDP built with a ``process_group=`` of its own (e.g. DiLoCo's
                node group, made again with ``dptrain.parallel.diloco.node_group()`` on every
                rank of the world); ``layout`` then comes from a rank of that group. Default
                None: the new default group (a DDP over a group of its own then raises).

        Raises:
            NotImplementedError: this DDP cannot be recovered in place; raised before anything
                is changed, on every rank alike, so the caller can fall back to a restart.
            TypeError: ``process_group`` is not a ``torch.distributed.ProcessGroup``.
            ValueError: ``layout`` comes from a DDP of another model or settings (also raised
                before anything is changed).
            RuntimeError: no process group is initialized.
        """
        _recovery.rejoin(self, layout, verify, process_group)

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside the block.

        The forward must run inside the block too; the first synced backward after it
        averages the accumulated gradients.

        Example:
            >>> with model.no_sync():
            ...     model(x1).sum().backward()
            >>> model(x2).sum().backward()   # (g1 + g2) averaged over ranks
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the all-reduce of each bucket with ``hook(state, bucket) -> Future[Tensor]``.

        ``bucket`` has ``buffer()``, ``gradients()``, ``parameters()``, ``index()`` and
        ``is_last()`` like ``torch.distributed.GradBucket``; the buffer is *not* divided by
        the world size. The future must hold a tensor of the buffer's size: the averaged
        gradients. Hooks from :mod:`dptrain.parallel.comm_hooks` and PyTorch's own
        (``torch.distributed.algorithms.ddp_comm_hooks``) both work. Call once, before the
        first backward.

        Raises:
            TypeError: ``hook`` is not callable.
            RuntimeError: a hook was already registered (``mixed_precision`` registers one).

        Example:
            >>> from dptrain.parallel import comm_hooks
            >>> model.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        """
        if not callable(hook):
            raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
        if self.reducer is None:
            return  # a world of one: gradients are already the average
        if self.compression is not None:
            raise RuntimeError(
                f"DistributedDataParallel(compression={self.compression!r}) manages the communication hook; pass "
                "compression=None to register your own"
            )
        if self.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per DistributedDataParallel model")
        self.reducer.comm_hook_state = state
        self.reducer.comm_hook = hook

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Any:
        """Context manager for uneven inputs: ranks that run out of batches shadow the others.

        A rank that leaves the loop early keeps answering the others' collectives with zero
        gradients until every rank is done; then all ranks copy the model of the last rank to
        finish. Same semantics as PyTorch's ``DistributedDataParallel.join``.

        Args:
            divide_by_initial_world_size: divide gradients by the world size even when some
                ranks have joined (True), or by the number of ranks still training. Default True.
            enable: False turns the context manager into a no-op. Default True.
            throw_on_early_termination: raise on every rank as soon as one rank joins, instead
                of shadowing. Default False.

        Example:
            >>> with model.join():
            ...     for x, y in loader:        # a different number of batches per rank
            ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        if self.reducer is None:
            return contextlib.nullcontext()
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # -- PyTorch's legacy input/output helpers, kept by PyTorch for compatibility; so here too --
    def to_kwargs(self, inputs: tuple, kwargs: dict, device_id: int) -> tuple[tuple, tuple]:
        """``((inputs on the device,), (kwargs on the device,))``, as PyTorch's DDP returns them."""
        device = torch.device(self.device_type, device_id)
        return (tuple(move_to_device(tuple(inputs), device)),), (move_to_device(dict(kwargs or {}), device),)

    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[Any]) -> tuple[tuple, tuple]:
        """Split ``inputs`` and ``kwargs`` along ``dim`` over ``device_ids`` (one chunk per device)."""
        devices = [torch.device(self.device_type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
        ins = _dp.scatter(tuple(inputs), devices, self.dim) if inputs else []
        kws = _dp.scatter(dict(kwargs), devices, self.dim) if kwargs else []
        n = max(len(ins), len(kws))
        ins = list(ins) + [()] * (n - len(ins))
        kws = list(kws) + [{}] * (n - len(kws))
        return tuple(tuple(i) for i in ins), tuple(kws)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        """Concatenate per-device ``outputs`` along ``dim`` on ``output_device``."""
        device = torch.device(self.device_type, output_device) if isinstance(output_device, int) else torch.device(output_device)
        return _dp.gather(outputs, device, self.dim)


# torch 2.4's _unsafe_preserve_version_counter takes one tensor; later ones also take a tuple.
_PRESERVE_TAKES_TUPLE = "tensors" in inspect.signature(torch.autograd._unsafe_preserve_version_counter.__init__).parameters


def _preserve_version_counters(tensors: list[torch.Tensor]) -> Any:
    if _PRESERVE_TAKES_TUPLE:
        return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))
    stack = contextlib.ExitStack()
    for t in tensors:
        stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
    return stack


_IMPLEMENTED = frozenset(inspect.signature(DistributedDataParallel._construct).parameters)
DistributedDataParallel.__init__.__signature__ = installed_signature()  # what inspect and IDEs show
DDP = DistributedDataParallel
