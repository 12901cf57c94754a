"""PyTorch's ``torch.distributed.optim._apply_optimizer_in_backward`` under our DDP.

That function gives each parameter its own optimizer (``param._in_backward_optimizers``) and
a hook that steps it as soon as the parameter's gradient is accumulated. Under DDP that
would step on the local gradient; PyTorch's DDP therefore removes those hooks (before the
first forward) and steps each parameter's optimizers once its bucket is averaged, then sets
the parameter's ``.grad`` to None at the end of backward. We do the same, through the
reducer's ``on_bucket_reduced`` (see the reducer's [Note: observers of a backward]), so
a script that uses it trains as with PyTorch's DDP.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["adopt_optimizers_in_backward"]


def _hook_handles() -> Any:
    try:
        from torch.distributed.optim import apply_optimizer_in_backward as module
    except ImportError:  # a torch without it: nothing can have been registered
        return {}
    return getattr(module, "param_to_optim_hook_handle_map", {})


def adopt_optimizers_in_backward(reducer: Any, params: Sequence[torch.nn.Parameter]) -> bool:
    """Take over the in-backward optimizers of ``params``; False when none has one.

    Raises:
        ValueError: the reducer already steps an optimizer per bucket (``overlap_optimizer``).
    """
    chosen = [p for p in params if hasattr(p, "_in_backward_optimizers")]
    if not chosen:
        return False
    if reducer.on_bucket_reduced is not None:
        raise ValueError(
            "DistributedDataParallel(overlap_optimizer=...) and torch.distributed.optim._apply_optimizer_in_backward "
            "both step the optimizer during backward; use one of them"
        )
    handles = _hook_handles()
    for p in chosen:
        for handle in handles.get(p, []):
            handle.remove()  # it would step on the local gradient, before the average
    reducer.on_bucket_reduced = _step_in_backward
    return True


def _step_in_backward(bucket_params: Sequence[torch.nn.Parameter]) -> None:
    # Called with the averaged gradients in .grad, bucket by bucket, at the end of backward.
    for p in bucket_params:
        optimizers = getattr(p, "_in_backward_optimizers", None)
        if optimizers is None:
            continue
        for optimizer in optimizers:
            optimizer.step()
        p.grad = None  # PyTorch's DDP leaves these gradients None after their step
