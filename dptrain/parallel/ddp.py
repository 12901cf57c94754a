"""DistributedDataParallel: one model replica per rank, gradients averaged by our reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same constructor, same
numerics): construction checks that every rank built the same model and copies rank 0's
parameters and buffers to all; each forward broadcasts buffers (BatchNorm statistics) from
rank 0; backward averages gradients through :class:`dptrain.parallel.reducer.Reducer`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptrain import _shm, comm, env
from dptrain.parallel.reducer import Reducer

__all__ = ["DistributedDataParallel", "DDP"]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # PyTorch's broadcast_bucket_size


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast ``tensors`` from ``src`` with one flat broadcast per dtype/device (and 250 MiB)."""
    chunks: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in chunks or sizes[key] + nbytes > _BROADCAST_BUCKET_BYTES:
            chunks.setdefault(key, []).append([])
            sizes[key] = 0
        chunks[key][-1].append(t)
        sizes[key] += nbytes
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    group_src = src
    global_src = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for chunk_list in chunks.values():
            for chunk in chunk_list:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                dist.broadcast(flat, src=global_src, group=group)
                if me != group_src:
                    offset = 0
                    for t in chunk:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()


def _describe(module: nn.Module) -> list[tuple]:
    """What must be identical on every rank: parameters and buffers, by name, shape and dtype."""
    desc = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    desc += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return desc


def _first_mismatch(descs: list[list[tuple]]) -> str | None:
    """A message naming the first difference between rank 0 and the lowest differing rank."""
    ref = descs[0]
    for r, desc in enumerate(descs[1:], start=1):
        if desc == ref:
            continue
        for a, b in zip(desc, ref):
            if a == b:
                continue
            if a[0] == "setting" and b[0] == "setting":
                return f"rank {r} passed {a[1]}={a[2]!r} but rank 0 passed {b[1]}={b[2]!r}"
            if (a[0], a[1]) != (b[0], b[1]):
                return (
                    f"rank {r} holds {a[0]} '{a[1]}' where rank 0 holds {b[0]} '{b[1]}' (same position "
                    "in named_parameters()/named_buffers())"
                )
            what = []
            if a[2] != b[2]:
                what.append(f"shape {a[2]} but rank 0 holds {b[2]}")
            if a[3] != b[3]:
                what.append(f"dtype {a[3]} but rank 0 holds {b[3]}")
            if a[4] != b[4]:
                what.append(f"requires_grad={a[4]} but rank 0 has requires_grad={b[4]}")
            return f"rank {r} holds {a[0]} '{a[1]}' of " + "; ".join(what)
        longer, shorter, who = (desc, ref, r) if len(desc) > len(ref) else (ref, desc, 0)
        extra = longer[len(shorter)]
        other = 0 if who == r else r
        return (
            f"rank {r} has {len(desc)} parameters+buffers but rank 0 has {len(ref)}; "
            f"the first extra one is {extra[0]} '{extra[1]}' on rank {who}, missing on rank {other}"
        )
    return None


def _move_to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move_to_device(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _move_to_device(v, device)) for k, v in obj.items())
    return obj


class _BackwardSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward runs first and tells the reducer.

    [Note: why a sink] The reducer's end-of-backward callback must be queued on the *outer*
    backward. Queued from the first gradient hook, it would land on a nested backward when
    that hook fires inside reentrant activation checkpointing, and run too early.
    """

    @staticmethod
    def forward(ctx, reducer_ref, *tensors):
        ctx.set_materialize_grads(False)
        ctx.reducer_ref = reducer_ref
        # Clones, not views: users may modify outputs in place (PyTorch's sink clones too).
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer_ref()
        if reducer is not None:
            reducer.backward_started()
        return (None, *grads)


def _attach_sink(output: Any, reducer: Reducer) -> Any:
    leaves, spec = tree_flatten(output)
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return output
    sunk = _BackwardSink.apply(weakref.ref(reducer), *(leaves[i] for i in where))
    for i, t in zip(where, sunk):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: one replica per rank, gradients averaged across ranks in backward.

    Drop-in for ``torch.nn.parallel.DistributedDataParallel``: same arguments, same
    ``module.``-prefixed ``state_dict()``, ``no_sync()``, ``join()``,
    ``register_comm_hook()``, and on two CPU ranks the same parameters bit for bit after
    any number of steps. Without a process group (a world of one) it is a transparent
    wrapper.

    Args:
        module: the model, already on its device. Every rank must build the same model.
        device_ids: ``[local_rank]`` for a single-device CUDA module (inputs are moved
            there); None for CPU modules or to use the module's device. Default None.
        output_device: accepted for compatibility; outputs stay where the module puts them
            (as with PyTorch's single-device DDP). Default None.
        dim: accepted for compatibility (PyTorch's single-device DDP does not scatter either).
            Default 0.
        broadcast_buffers: broadcast buffers (e.g. BatchNorm statistics) from rank 0 at the
            start of each training forward. Default True.
        process_group: group to reduce over. Default None (the whole world).
        bucket_cap_mb: bucket size in MiB. Default None: 25 MiB, with a 1 MiB first bucket
            so that the first all-reduce starts early.
        find_unused_parameters: walk the autograd graph from the forward outputs and treat
            parameters it cannot reach as ready (zero contribution); a parameter unused on
            every rank keeps its ``.grad`` untouched. Default False.
        check_reduction: deprecated in PyTorch and ignored; warns once when True. Default False.
        gradient_as_bucket_view: make ``.grad`` views into the flat bucket buffers (no
            copy-out, less memory). Default False.
        static_graph: the set of used parameters and the number of times each one is used
            are the same every iteration; learnt in the first iteration. Allows a parameter
            to receive its gradient several times per backward (reentrant activation
            checkpointing). Default False.
        shm: all-reduce gradients through shared memory (not in PyTorch's DDP). None
            (default): when every rank of the group is on this node and the module is on the
            CPU, unless ``DPTRAIN_SHM=0``; False: never (gloo); True: always, raising
            ValueError where it cannot. Same numbers as gloo (bitwise on two ranks).

    Raises:
        ValueError: the ranks built different models (every rank raises, naming the first
            difference and the ranks), the module has no parameter that requires grad, or
            ``device_ids`` was given for a CPU module.

    Example:
        >>> dptrain.init()
        >>> model = dptrain.DDP(nn.Linear(10, 5))
        >>> loss = model(torch.randn(8, 10)).sum(); loss.backward()   # grads averaged
        >>> with model.no_sync():                  # accumulate without communication
        ...     model(x1).sum().backward()
        >>> model(x2).sum().backward()            # averages the accumulated gradients
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        shm: bool | None = None,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        self.module = module
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_cap_mb = bucket_cap_mb
        if check_reduction:
            env._warn_once_main("DistributedDataParallel(check_reduction=True) is deprecated and does nothing")
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "DistributedDataParallel needs a module with at least one parameter that requires grad; "
                f"{type(module).__name__} has none. Train it without DDP, or unfreeze a parameter."
            )
        devices = {p.device for _, p in module.named_parameters()}
        self.device_type = next(iter(devices)).type
        if device_ids is not None:
            if len(devices) > 1 or self.device_type == "cpu" or len(device_ids) != 1:
                raise ValueError(
                    f"device_ids={list(device_ids)} only works with a module on one CUDA device (pass "
                    f"device_ids=[local_rank]); this module's parameters are on {sorted(map(str, devices))}. "
                    "For CPU or multi-device modules leave device_ids=None."
                )
            self.device_ids = [
                torch.device(self.device_type, d) if isinstance(d, int) else torch.device(d) for d in device_ids
            ]
        else:
            self.device_ids = None
        self.output_device = output_device
        self.device = self.device_ids[0] if self.device_ids else next(iter(devices))

        self._distributed = dist.is_available() and dist.is_initialized()
        if process_group is None and self._distributed:
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.reducer: Reducer | None = None
        if self._distributed:
            self._rank = dist.get_rank(process_group)
            self._verify_same_model()
            _broadcast_coalesced(
                [p.detach() for p in module.parameters()] + list(module.buffers()), 0, self.process_group
            )
            grads = [p for _, p in named]
            self._shm = _shm.for_parameters(grads, process_group, shm, "DDP gradient all-reduce")
            self.reducer = Reducer(
                grads,
                [n for n, _ in named],
                process_group,
                bucket_cap_mb=bucket_cap_mb,
                gradient_as_bucket_view=gradient_as_bucket_view,
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
                shm=self._shm,
            )
        else:
            self._rank = 0

    def _verify_same_model(self) -> None:
        # Settings that shape the collectives must agree too, or buckets would not line up.
        settings = [
            ("setting", k, getattr(self, k))
            for k in ("bucket_cap_mb", "find_unused_parameters", "static_graph", "broadcast_buffers")
        ]
        descs = comm.all_gather_object(settings + _describe(self.module), group=self.process_group)
        problem = _first_mismatch(descs)
        if problem is not None:
            raise ValueError(
                f"DistributedDataParallel on rank {self._rank}: the ranks built different models: {problem}. "
                "Build the same model on every rank (same code, same arguments) before wrapping it."
            )

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        reducer = self.reducer
        if reducer is None:  # a world of one: nothing to synchronise
            return self.module(*inputs, **kwargs)
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:
            reducer.check_prior_reduction()
        work = Join.notify_join_context(self)
        if work is not None:
            reducer.set_divisor_work(work, self._divide_by_initial_world_size)
        if self._will_sync_buffers():
            src = self._find_common_rank(self._rank, True) if self._join_config.enable else 0
            self._sync_buffers(src)
        if self._join_config.enable:
            self._all_reduce_requires_sync(joined=False)
        if self.device_ids:
            inputs = _move_to_device(inputs, self.device_ids[0])
            kwargs = _move_to_device(kwargs, self.device_ids[0])
        output = self.module(*inputs, **kwargs)
        if grad_sync:
            self.require_forward_param_sync = True
            reducer.prepare_for_backward(output if self.find_unused_parameters and not self.static_graph else None)
            output = _attach_sink(output, reducer)
        else:
            self.require_forward_param_sync = False
        return output

    def _will_sync_buffers(self) -> bool:
        return (
            self.require_forward_param_sync and self.broadcast_buffers and any(True for _ in self.module.buffers())
        )

    def _sync_buffers(self, src: int) -> None:
        buffers = list(self.module.buffers())
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            _broadcast_coalesced(buffers, src, self.process_group)

    def _find_common_rank(self, rank: int, candidate: bool) -> int:
        """The highest group rank among candidates (PyTorch's rule for join's authoritative rank)."""
        t = torch.tensor([rank if candidate else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def _all_reduce_requires_sync(self, joined: bool) -> bool | None:
        """Join: tell the joined ranks whether this iteration's backward synchronises (1 per rank)."""
        syncing = not joined and self.require_backward_grad_sync
        flag = torch.full((1,), float(syncing), device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not joined:
            return None
        work.wait()
        return bool(flag.item() != 0)

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
            RuntimeError: a hook was already registered.

        Example:
            >>> from dptrain.parallel import comm_hooks
            >>> model.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        """
        if not callable(hook):
            raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
        if self.reducer is None:
            return  # a world of one: gradients are already the average
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
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        super().train(mode)
        return self


class _DDPJoinHook(JoinHook):
    """What a joined rank does each round: the collectives of one forward and backward, with zeros."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._will_sync_buffers():
            ddp._sync_buffers(ddp._find_common_rank(ddp._rank, False))
        should_sync = ddp._all_reduce_requires_sync(joined=True)
        ddp.require_forward_param_sync = bool(should_sync)
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = ddp._find_common_rank(ddp._rank, is_last_joiner)
        tensors = [p.detach() for p in ddp.module.parameters()]
        if ddp.broadcast_buffers:
            tensors += list(ddp.module.buffers())
        _broadcast_coalesced(tensors, src, ddp.process_group)


DDP = DistributedDataParallel
