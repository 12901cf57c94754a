"""DDP-native mixed precision: ``DistributedDataParallel(mixed_precision=...)``.

PyTorch's semantics (``torch.nn.parallel.distributed._MixedPrecision``): forward and backward
run on ``param_dtype`` copies of the parameters (floating-point inputs are cast to it too),
gradients are all-reduced in ``reduce_dtype`` (default: ``param_dtype``) and divided by the
world size after the sum, buffers are kept in ``buffer_dtype``. Outside forward and backward
the parameters are the full-precision originals, and ``.grad`` is full precision, so the
optimizer and ``state_dict()`` see full precision.

How: each forward swaps every managed parameter's ``.data`` for a low-precision copy of its
full-precision master; the reduction is a communication hook (as in PyTorch) that puts the
masters back for the bucket's parameters before the averaged gradients are written into
``.grad``; a callback at the end of backward puts back any parameter the hooks did not cover
(frozen parameters). A forward without gradient puts them back at once.

With ``gradient_as_bucket_view=True`` the buckets hold ``param_dtype`` gradients: during
backward ``.grad`` is a low-precision view of its bucket (as in PyTorch); the hook gives the
bucket's parameters full-precision ``.grad`` again and the reducer writes the averaged
bucket into them (PyTorch's numbers bitwise, see ``tests/parallel/ddp/test_ddp_mixed_precision.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dptrain.parallel.ddp._setup import map_tensors

__all__ = ["MixedPrecisionState", "check_config"]


def check_config(config: Any) -> None:
    """Raise TypeError unless ``config`` has PyTorch's three dtype fields (each a dtype or None)."""
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
    for name in fields:
        value = getattr(config, name, "missing")
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(
                f"mixed_precision must have {', '.join(fields)} (a torch.dtype or None each), like "
                f"torch.nn.parallel.distributed._MixedPrecision(param_dtype=torch.bfloat16); got {config!r} "
                f"with {name}={value!r}"
            )


class MixedPrecisionState:
    """Full-precision masters of the managed parameters and the switch between the precisions."""

    def __init__(self, config: Any, module: nn.Module, ignore: set[str]) -> None:
        check_config(config)
        self.config = config
        self.params = [p for n, p in module.named_parameters() if n not in ignore]
        self.masters = [p.data for p in self.params]  # full precision, what the optimizer updates
        self.low = False  # parameters currently hold their param_dtype copies
        if config.buffer_dtype is not None:
            for n, b in module.named_buffers():
                if n not in ignore:
                    b.data = b.data.to(config.buffer_dtype)

    @property
    def grad_dtype(self) -> torch.dtype | None:
        return self.config.param_dtype

    def before_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Switch to ``param_dtype`` copies; cast floating-point inputs."""
        dtype = self.config.param_dtype
        if dtype is None:
            return inputs, kwargs
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if not self.low:
                    self.masters[i] = p.data  # may have been replaced since (model.to(), assignment)
                p.data = self.masters[i].to(dtype)
                if p.grad is not None and p.grad.dtype != dtype:
                    # Accumulated full-precision gradients (no_sync, no zero_grad) keep
                    # accumulating in param_dtype, as in PyTorch.
                    p.grad = p.grad.to(dtype)
        self.low = True
        cast = lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t  # noqa: E731
        return map_tensors((inputs, kwargs), cast)

    def restore(self, params: Any = None) -> None:
        """Put the full-precision masters back (all parameters, or ``params``), grads upcast."""
        if not self.low:
            return
        chosen = None if params is None else {id(p) for p in params}
        for p, master in zip(self.params, self.masters):
            if chosen is not None and id(p) not in chosen:
                continue
            if p.data.dtype != master.dtype:
                p.data = master
                if p.grad is not None and p.grad.dtype != master.dtype:
                    p.grad = p.grad.to(master.dtype)
        if params is None:
            self.low = False


class _UpcastHookState:
    """State of :func:`allreduce_and_upcast_hook`: the DDP module and the end-of-backward flag."""

    def __init__(self, ddp: Any) -> None:
        self.ddp_ref = weakref.ref(ddp)
        self.queued = False

    def __getstate__(self) -> dict:
        return {}  # rebuilt with the reducer when the DDP module is unpickled

    def end_of_backward(self) -> None:
        self.queued = False
        ddp = self.ddp_ref()
        if ddp is not None and ddp._mixed_precision is not None:
            ddp._mixed_precision.restore()


def allreduce_and_upcast_hook(state: _UpcastHookState, bucket: Any) -> torch.futures.Future:
    """Sum the bucket in ``reduce_dtype``, divide by the world size; masters back for its parameters."""
    ddp = state.ddp_ref()
    config = ddp._mixed_precision.config
    buffer = bucket.buffer()
    if config.reduce_dtype is not None and buffer.dtype != config.reduce_dtype:
        buffer = buffer.to(config.reduce_dtype)
    world = dist.get_world_size(ddp.process_group)
    fut = dist.all_reduce(buffer, group=ddp.process_group, async_op=True).get_future()
    # The gradients of these parameters are complete: the optimizer may see full precision.
    ddp._mixed_precision.restore(bucket.parameters())
    if not state.queued:
        state.queued = True
        Variable._execution_engine.queue_callback(state.end_of_backward)
    return fut.then(lambda f: f.value()[0].div_(world))
