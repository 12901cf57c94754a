"""The backward sink: how DDP's reducer learns that a training backward has started.

[Note: why a sink]
The reducer's end-of-backward callback must be queued on the *outer* backward. Queued from
the first gradient hook, it would land on a nested backward when that hook fires inside
reentrant activation checkpointing, and run too early. So DDP's forward passes its outputs
through an identity function whose backward runs before any gradient hook and queues the
callback.

[Note: which backward is ours]
A backward only counts when it accumulates into ``.grad``: ``torch.autograd.grad`` through
the model's outputs (gradient penalties) fires no accumulate-grad hook, and must neither
start nor finish a reduction. The sink asks the autograd engine whether this backward will
run an accumulate-grad node of ours: the reducer's *anchor*, a private leaf tensor that is
an input of the sink (so a plain ``loss.backward()`` reaches it), or a parameter's (for
``backward(inputs=...)``).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["attach_sink", "new_anchor", "backward_accumulates"]


def new_anchor(device: torch.device) -> tuple[torch.Tensor, Any]:
    """The anchor tensor and its accumulate-grad node, held so that the node stays the same one
    (autograd itself keeps only a weak reference to it)."""
    anchor = torch.zeros((), device=device, requires_grad=True)
    return anchor, anchor.view_as(anchor).grad_fn.next_functions[0][0]


def backward_accumulates(anchor_node: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether the running backward accumulates into the parameters' ``.grad``."""
    try:
        if torch._C._will_engine_execute_node(anchor_node):
            return True  # a plain loss.backward(): every node of the graph runs
    except RuntimeError:
        pass
    for p in params:  # backward(inputs=...) or autograd.grad(...)
        try:
            if torch._C._will_engine_execute_node(p.view_as(p).grad_fn.next_functions[0][0]):
                return True
        except RuntimeError:  # autograd.grad(..., inputs=params): captured, not accumulated
            pass
    return False


class _BackwardSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward runs first and tells the reducer."""

    @staticmethod
    def forward(ctx, reducer_ref, anchor, *tensors):
        ctx.set_materialize_grads(False)
        ctx.reducer_ref = reducer_ref
        # Clones, not views: users may modify outputs in place (PyTorch's sink clones too).
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ref = ctx.reducer_ref
        reducer = ref() if isinstance(ref, weakref.ref) else ref  # a traced weakref arrives resolved
        if reducer is not None and backward_accumulates(reducer.anchor_node, reducer.params):
            reducer.backward_started()
        return (None, None, *grads)


def attach_sink(output: Any, reducer: Any) -> Any:
    """``output`` with every tensor that requires grad passed through the sink of ``reducer``."""
    leaves, spec = tree_flatten(output)
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return output
    sunk = _BackwardSink.apply(weakref.ref(reducer), reducer.anchor, *(leaves[i] for i in where))
    for i, t in zip(where, sunk):
        leaves[i] = t
    return tree_unflatten(leaves, spec)
