"""What the DDP reducer says when a backward goes wrong: which parameters, on which rank, the fix.

Each message names the rank, the parameters by name and by index (the index PyTorch's DDP
prints, so messages can be compared), what happened and how to fix it.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

__all__ = ["missing_gradients", "other_ranks_failed", "static_graph_changed", "gradient_twice"]

_PREFIX = "DistributedDataParallel on rank {rank}: "


def missing_gradients(names: Sequence[str], missing: Sequence[int], static_graph: bool) -> str:
    """Parameters that got no gradient in a backward that expected one for each."""
    rank = dist.get_rank()
    listed = ", ".join(repr(names[i]) for i in missing[:20]) + (" ..." if len(missing) > 20 else "")
    what = (
        _PREFIX.format(rank=rank) + f"the previous backward produced no gradient for {len(missing)} parameter(s): "
        f"{listed}. Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, missing))}. "
    )
    if static_graph:
        return what + (
            "With static_graph=True these parameters received their gradients in the first iteration, which "
            "fixed the graph; the training graph changed since. static_graph=True needs the same parameters used "
            "the same number of times every iteration; if the set of used parameters changes, pass "
            "find_unused_parameters=True instead of static_graph=True."
        )
    return what + (
        "These parameters were not used to compute the loss, so their gradients could not be reduced. Fix: pass "
        "find_unused_parameters=True to DistributedDataParallel(...), or make sure every parameter takes part in "
        "the loss (or set requires_grad=False on the ones you do not train)."
    )


def other_ranks_failed(count: int) -> str:
    """This rank's backward was complete, but ``count`` other ranks' were not."""
    return _PREFIX.format(rank=dist.get_rank()) + (
        f"in the previous backward {count} other rank(s) produced no gradient for some parameters (their error "
        "names them). Pass find_unused_parameters=True to DistributedDataParallel(...) when the set of parameters "
        "used in forward can differ between ranks or iterations."
    )


def static_graph_changed(name: str, index: int, expected: int) -> str:
    """A parameter received more gradients than in the first iteration of a static graph."""
    return _PREFIX.format(rank=dist.get_rank()) + (
        f"the training graph changed although static_graph=True: parameter '{name}' (index {index}) received more "
        f"gradients in this backward than the {expected} it received in the first iteration, which fixed the "
        f"graph ({'it was unused then' if expected == 0 else 'it is now used more often'}). With static_graph=True "
        "every iteration must use the same parameters the same number of times; if the set of used parameters "
        "changes, pass find_unused_parameters=True instead of static_graph=True."
    )


def gradient_twice(name: str, index: int) -> str:
    """A parameter's hook fired twice in one backward without static_graph."""
    return _PREFIX.format(rank=dist.get_rank()) + (
        f"parameter '{name}' (index {index}) received its gradient twice in one backward (reentrant backward such "
        "as activation checkpointing, or a module called twice with a reentrant graph). Pass static_graph=True if "
        "the graph is the same every iteration."
    )
