"""DataParallel: one process, one replica per device, replicas run in threads.

Every forward does the four steps of single-process data parallelism: **replicate** the module onto each device,
**scatter** the inputs along ``dim``, run the replicas in threads (**parallel_apply**), and
**gather** the outputs on ``output_device``. The copies of the parameters are made with
differentiable ``.to()`` calls, so backward through the gathered output sums every
replica's gradient into the original module's parameters.

Limits against DistributedDataParallel (why DDP is the recommended path):

- **Replication every forward**: parameters and buffers are copied to every device on each
  call; DDP copies them once, at construction.
- **One process, many threads**: the replicas share one Python interpreter, so Python-side
  work contends for the GIL; DDP runs one process per device.
- **Scatter / gather overhead**: inputs are split and copied out of, and outputs copied back
  into, ``device_ids[0]``, which also does all the loss and optimizer work; DDP moves only
  gradients, with an all-reduce that overlaps backward.
- **One machine only**; DDP spans machines.

[Note: buffers and BatchNorm]
Like ``torch.nn.DataParallel``, the replica on ``device_ids[0]`` uses the module's own
parameters and buffers; the other replicas get copies that are thrown away after forward.
So in-place buffer updates persist only from replica 0: a training-mode BatchNorm
normalises each replica's chunk with that chunk's statistics, and ``running_mean``,
``running_var`` and ``num_batches_tracked`` are updated from the first chunk alone. Use
SyncBatchNorm with DDP if the statistics must cover the whole batch.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["DataParallel", "replicate", "scatter", "parallel_apply", "gather"]


def _to_device(d: int | str | torch.device) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


# -- replicate ----------------------------------------------------------------------------------
def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Shallow copies of ``module``, one per device, whose tensors are differentiable copies.

    Replica 0 uses the module's own parameters and buffers when it lives on ``devices[0]``.
    Tied parameters stay tied within each replica.
    """
    replicas = []
    for i, device in enumerate(devices):
        cache: dict[int, torch.Tensor] = {}  # id(original tensor) -> its copy, keeps ties

        def copy(t: torch.Tensor, is_param: bool) -> torch.Tensor:
            if id(t) not in cache:
                if i == 0 and t.device == device:
                    cache[id(t)] = t
                elif is_param:
                    # Differentiable: backward of the replica's use sends the gradient home.
                    # (On the same device .to() returns the tensor itself, which is fine:
                    # replicas only read parameters.)
                    cache[id(t)] = t.to(device, non_blocking=True)
                else:
                    # Buffers are updated in place (BatchNorm), so non-first replicas need copies.
                    cache[id(t)] = t.detach().to(device, copy=True)
            return cache[id(t)]

        def build(m: nn.Module) -> nn.Module:
            new = m.__new__(type(m))
            new.__dict__ = m.__dict__.copy()
            new._parameters = {}
            new._buffers = {k: (copy(b, False) if b is not None else None) for k, b in m._buffers.items()}
            new._modules = {k: (build(c) if c is not None else None) for k, c in m._modules.items()}
            for k, p in m._parameters.items():
                # A plain attribute, not a Parameter: the copy is a non-leaf tensor.
                new.__dict__[k] = copy(p, True) if p is not None else None
            return new

        replicas.append(build(module))
    return replicas


# -- scatter / gather ----------------------------------------------------------------------------
def scatter(obj: Any, devices: Sequence[torch.device], dim: int = 0) -> list[Any]:
    """Split tensors along ``dim`` into one chunk per device (recursing into lists, tuples, dicts).

    Non-tensor leaves are given to every replica as they are. Fewer chunks than devices come
    back when the batch is smaller than the number of devices.
    """

    def split(o: Any) -> list[Any] | None:
        if isinstance(o, torch.Tensor):
            chunks = o.chunk(len(devices), dim)
            return [c.to(d, non_blocking=True) for c, d in zip(chunks, devices)]
        if isinstance(o, (list, tuple)) and o:
            parts = [split(x) for x in o]
            n = min(len(p) for p in parts if p is not None) if any(p is not None for p in parts) else None
            if n is None:
                return None
            rows = [[(p[i] if p is not None else x) for p, x in zip(parts, o)] for i in range(n)]
            if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
                return [type(o)(*r) for r in rows]
            return [type(o)(r) for r in rows]
        if isinstance(o, dict) and o:
            keys = list(o)
            parts = [split(o[k]) for k in keys]
            if all(p is None for p in parts):
                return None
            n = min(len(p) for p in parts if p is not None)
            return [type(o)((k, p[i] if p is not None else o[k]) for k, p in zip(keys, parts)) for i in range(n)]
        return None  # not splittable: replicated to every device

    out = split(obj)
    return out if out is not None else [obj for _ in devices]


def gather(outputs: Sequence[Any], target: torch.device, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``target`` (recursively).

    Zero-dimensional tensors (e.g. a loss computed inside the module) are stacked into a
    vector with one entry per replica, as ``torch.nn.DataParallel`` does.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack([o.to(target) for o in outputs])
        return torch.cat([o.to(target) for o in outputs], dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if not all(len(o) == len(first) for o in outputs):
            raise ValueError("DataParallel: replicas returned dicts with different keys")
        return type(first)((k, gather([o[k] for o in outputs], target, dim)) for k in first)
    if isinstance(first, (list, tuple)):
        items = [gather(list(col), target, dim) for col in zip(*outputs)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    return list(outputs)  # anything else: one entry per replica


# -- parallel_apply ------------------------------------------------------------------------------
def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple], kwargs: Sequence[dict], devices) -> list[Any]:
    """Run ``replicas[i](*inputs[i], **kwargs[i])`` in one thread each; return outputs in order.

    Grad mode and autocast state are thread-local in PyTorch, so they are carried into the
    threads. An exception in a replica is re-raised here, naming the replica and device.
    """
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)
    grad = torch.is_grad_enabled()
    autocast_cuda = torch.is_autocast_enabled("cuda") if torch.cuda.is_available() else False

    def work(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad), torch.autocast("cuda", enabled=autocast_cuda) if autocast_cuda else _null():
                if devices[i].type == "cuda":
                    with torch.cuda.device(devices[i]):
                        results[i] = replicas[i](*inputs[i], **kwargs[i])
                else:
                    results[i] = replicas[i](*inputs[i], **kwargs[i])
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors[i] = err

    threads = [threading.Thread(target=work, args=(i,), name=f"dptrain-dp-replica-{i}") for i in range(1, len(replicas))]
    for t in threads:
        t.start()
    work(0)  # the calling thread runs replica 0
    for t in threads:
        t.join()
    for i, err in enumerate(errors):
        if err is not None:
            raise RuntimeError(f"DataParallel replica {i} on {devices[i]} failed: {type(err).__name__}: {err}") from err
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- the wrapper ---------------------------------------------------------------------------------
class DataParallel(nn.Module):
    """Split each batch across devices and run a replica of the module on each, in threads.

    Single-process data parallelism on one machine (see the module docstring for its limits
    against :class:`dptrain.DistributedDataParallel`, and [Note: buffers and BatchNorm]).

    Args:
        module: the model; it must live on ``device_ids[0]``.
        device_ids: the devices, one replica each: CUDA indices (``[0, 1]``), or devices /
            strings (``["cuda:0", "cuda:1"]``). A device may repeat, so ``["cpu", "cpu"]`` runs
            two CPU replicas in two threads -- useful for testing on a machine without GPUs.
            Default None: every visible CUDA device, or ``["cpu"]`` (one replica, plain call)
            without CUDA.
        output_device: where outputs are gathered. Default None: ``device_ids[0]``.
        dim: the batch dimension to scatter inputs and gather outputs along. Default 0.

    Raises:
        ValueError: empty ``device_ids``, or the module is not on ``device_ids[0]``.

    Example:
        >>> model = dptrain.DataParallel(MLP([10, 32, 5]), device_ids=["cpu", "cpu"])
        >>> model(torch.randn(8, 10)).shape       # two replicas of 4 samples each
        torch.Size([8, 5])
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None, output_device: Any = None, dim: int = 0) -> None:
        super().__init__()
        if device_ids is None:
            device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else ["cpu"]
        if len(device_ids) == 0:
            raise ValueError("DataParallel needs at least one device in device_ids, got []")
        self.module = module
        self.device_ids = [_to_device(d) for d in device_ids]
        self.output_device = _to_device(output_device) if output_device is not None else self.device_ids[0]
        self.dim = dim
        self.src_device = self.device_ids[0]
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.device != self.src_device and not (self.src_device.type == "cuda" and self.src_device.index is None):
                raise ValueError(
                    f"DataParallel needs the module on device_ids[0] = {self.src_device}, but '{name}' is on "
                    f"{t.device}; call module.to({str(self.src_device)!r}) first"
                )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) == 1:
            return self.module(*inputs, **kwargs)
        scattered_in = scatter(tuple(inputs), self.device_ids, self.dim) if inputs else []
        scattered_kw = scatter(kwargs, self.device_ids, self.dim) if kwargs else []
        n = max(len(scattered_in), len(scattered_kw))
        if not scattered_in:
            scattered_in = [()] * n
        if not scattered_kw:
            scattered_kw = [{}] * n
        n = min(len(scattered_in), len(scattered_kw))
        if n == 0:
            return self.module(*inputs, **kwargs)
        devices = self.device_ids[:n]
        if n == 1:
            return self.module(*scattered_in[0], **scattered_kw[0])
        replicas = replicate(self.module, devices)
        outputs = parallel_apply(replicas, scattered_in[:n], scattered_kw[:n], devices)
        return gather(outputs, self.output_device, self.dim)
