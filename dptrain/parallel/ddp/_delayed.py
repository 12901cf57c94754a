"""``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce`` of DistributedDataParallel.

PyTorch's semantics: the named parameters leave the reducer. Their gradients accumulate in
one flat buffer (each ``.grad`` is a view of it, set at the end of every forward), and when
the gradient of ``param_to_hook_all_reduce`` is computed in backward, the whole buffer is
divided by the world size and all-reduced in one collective. Put the hook on a parameter
whose gradient comes after all the delayed ones (e.g. the first layer). As in PyTorch, this
happens in every backward, inside ``no_sync()`` too. Unlike PyTorch, which never waits for
that all-reduce, the end of backward waits for it, so the optimizer reads finished sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dptrain import comm

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    """The flat gradient buffer of the delayed parameters and the hook that reduces it."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], hook_param: torch.Tensor, group: Any) -> None:
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError(
                "param_to_hook_all_reduce must be a parameter that requires grad (its gradient triggers the "
                f"delayed all-reduce), got {type(hook_param).__name__}"
            )
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"delay_all_reduce_named_params share one flat gradient buffer, so they need one dtype; got "
                f"{sorted(map(str, dtypes))} for {self.names}"
            )
        self.hook_param = hook_param
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                                  device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.group = None
        self._handle = None
        self.attach(group)

    def attach(self, group: Any) -> None:
        """Reduce over ``group`` from now on (also after unpickling)."""
        self.group = group
        if self._handle is not None:
            self._handle.remove()
        self._handle = self.hook_param.register_hook(self._on_hook_param_grad)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["group"] = None
        state["_handle"] = None  # the hook lives on the parameter; attach() registers it again
        return state

    def point_grads_at_buffer(self) -> None:
        """End of forward: gradients accumulate in the flat buffer (PyTorch's _clear_grad_buffer)."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()

    def _on_hook_param_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return grad
        self.buffer.div_(dist.get_world_size(self.group))
        work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
        # Waited at the end of backward, guarded like every wait: a peer that dies there is named.
        Variable._execution_engine.queue_callback(
            lambda: comm.wait(work, "DDP delayed all-reduce (delay_all_reduce_named_params)", self.group))
        return grad
