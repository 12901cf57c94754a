"""What the DDP reducer says when a backward goes wrong: which parameters, on which rank, the fix.

Each message names the rank, the parameters by name and by index (the index PyTorch's DDP
prints, so messages can be compared), what happened and how to fix it.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

__all__ = ["missing_gradients", "other_ranks_failed", "static_graph_changed", "gradient_twice"]

_PREFIX = "DistributedDataParallel on rank {rank}: "

# [Note: PyTorch's wording]
# Users search their logs, and tests match messages, by what PyTorch's C++ reducer says
# ("Expected to have finished reduction in the prior iteration", "Your training graph has
# changed in this iteration", "marked as ready twice", "Parameter indices which did not
# receive grad for rank N: ..."). Each message below starts with PyTorch's sentence, as
# PyTorch words it, so those searches find ours; then says, in our words, what happened,
# which parameters by name, and the fix.
_UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one."
_STATIC_CHANGED = (
    "This error indicates that your training graph has changed in this iteration, e.g., one parameter is used in "
    "first iteration, but then got unused in the second iteration. this is not compatible with static_graph set "
    "to True."
)


def _lines(names: Sequence[str], missing: Sequence[int], rank: int) -> str:
    listed = ", ".join(names[i] for i in missing[:20]) + (" ..." if len(missing) > 20 else "")
    return (
        f"Parameters which did not receive grad for rank {rank}: {listed}\n"
        f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, missing))}\n"
    )


def missing_gradients(names: Sequence[str], missing: Sequence[int], static_graph: bool) -> str:
    """Parameters that got no gradient in a backward that expected one for each."""
    rank = dist.get_rank()
    head = _PREFIX.format(rank=rank) + _UNFINISHED
    if static_graph:
        return head + " " + _STATIC_CHANGED + "\n" + _lines(names, missing, rank) + (
            f"The previous backward produced no gradient for these {len(missing)} parameter(s), which received "
            "their gradients in the first iteration (that iteration fixed the graph). static_graph=True needs the "
            "same parameters used the same number of times every iteration; if the set of used parameters "
            "changes, pass find_unused_parameters=True instead of static_graph=True."
        )
    return head + f" The previous backward produced no gradient for {len(missing)} parameter(s).\n" + _lines(
        names, missing, rank
    ) + (
        "These parameters were not used to compute the loss, so their gradients could not be reduced. Fix: enable "
        "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
        "DistributedDataParallel(...), and make sure all `forward` function outputs participate in calculating "
        "loss; or make every parameter take part in the loss (or set requires_grad=False on the ones you do not "
        "train)."
    )


def other_ranks_failed(count: int) -> str:
    """This rank's backward was complete, but ``count`` other ranks' were not."""
    return _PREFIX.format(rank=dist.get_rank()) + _UNFINISHED + (
        f" In the previous backward {count} other rank(s) produced no gradient for some parameters (their error "
        "names them). Pass find_unused_parameters=True to DistributedDataParallel(...) when the set of parameters "
        "used in forward can differ between ranks or iterations."
    )


def static_graph_changed(name: str, index: int, expected: int) -> str:
    """A parameter received more gradients than in the first iteration of a static graph."""
    return _PREFIX.format(rank=dist.get_rank()) + (
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, "
        "but then got used in the second iteration. this is not compatible with static_graph set to True.\n"
        f"The training graph changed although static_graph=True: parameter '{name}' (index {index}) received more "
        f"gradients in this backward than the {expected} it received in the first iteration, which fixed the "
        f"graph ({'it was unused then' if expected == 0 else 'it is now used more often'}). With static_graph=True "
        "every iteration must use the same parameters the same number of times; if the set of used parameters "
        "changes, pass find_unused_parameters=True instead of static_graph=True."
    )


def gradient_twice(name: str, index: int) -> str:
    """A parameter's hook fired twice in one backward without static_graph."""
    return _PREFIX.format(rank=dist.get_rank()) + (
        f"Expected to mark a variable ready only once. Parameter at index {index} with name {name} has been "
        "marked as ready twice. This means that multiple autograd engine hooks have fired for this particular "
        f"parameter during this iteration.\nThe parameter '{name}' (index {index}) received its gradient twice in one "
        "backward (reentrant backward such as activation checkpointing, or a module called twice with a reentrant "
        "graph). Pass static_graph=True if the graph is the same every iteration."
    )
