"""What the units of one FSDP root share during an iteration, and the optimizer guard.

The root's :class:`RootState` knows the order in which the units' forwards finished (backward
visits them in reverse, which is what backward prefetching follows), the gradient reductions
in flight, and whether gradients are synchronised at all (``no_sync``). Its ``finalize`` runs
once at the end of each backward.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dptrain.runtime import env
from dptrain.parallel.fsdp._unit import FlatParamUnit

__all__ = ["RootState", "install_optimizer_check"]


class RootState:
    """What the units of one FSDP root share during an iteration."""

    def __init__(self, backward_prefetch: bool) -> None:
        self.backward_prefetch = backward_prefetch
        self.sync_grads = True  # False inside no_sync()
        # Units in the order their forward *finished*: backward runs them in reverse (the root,
        # whose forward encloses all others, finishes last and is the first in backward).
        self.forward_order: list[FlatParamUnit] = []
        self._position: dict[int, int] = {}
        self.pending: list[tuple] = []  # (unit, work, out, grad) reductions in flight
        self.finalize_queued = False
        self.units: list[FlatParamUnit] = []

    def start_iteration(self) -> None:
        self.forward_order.clear()
        self._position.clear()

    def record_forward(self, unit: FlatParamUnit) -> None:
        if id(unit) not in self._position:
            self._position[id(unit)] = len(self.forward_order)
            self.forward_order.append(unit)

    def next_in_backward(self, unit: FlatParamUnit) -> FlatParamUnit | None:
        # Backward visits units in reverse order of forward completion; the one before us is next.
        i = self._position.get(id(unit))
        if not i:
            return None
        return self.forward_order[i - 1]

    def queue_finalize(self) -> None:
        if not self.finalize_queued:
            self.finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)

    def drain(self) -> None:
        """Wait for the reductions in flight and hand their shard gradients over.

        Called before each new reduction is issued, so at most one unit's full-size
        gradient is alive at a time (the reduce-scatter of unit k overlaps the backward
        compute of unit k-1); keeping them all until the end would cost a full model's
        worth of gradient memory at the peak.
        """
        pending, self.pending = self.pending, []
        for unit, work, out, _grad in pending:
            unit.finish_grad(work, out)

    def finalize(self) -> None:
        """End of backward: wait for every reduction, hand the shard grads over, free params."""
        self.finalize_queued = False
        self.drain()
        for unit in self.units:
            unit.reshard()


# -- an optimizer built before wrapping ---------------------------------------------------
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_HOOK_INSTALLED = [False]


def _check_optimizer(optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
    """Raise if ``optimizer`` holds parameters that FSDP flattened away (global step pre-hook)."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_dptrain_fsdp_flattened", False):
                raise ValueError(
                    f"rank {env.rank()}: the optimizer holds a parameter that FSDP flattened into its "
                    "sharded flat parameters, so it would never be updated; build the optimizer after "
                    "wrapping: `model = dptrain.FSDP(model); opt = torch.optim.Adam(model.parameters())`"
                )
    _CHECKED[optimizer] = count


def install_optimizer_check() -> None:
    """Check, at every optimizer step, that no optimizer holds parameters FSDP flattened away."""
    if not _HOOK_INSTALLED[0]:
        register_optimizer_step_pre_hook(_check_optimizer)
        _HOOK_INSTALLED[0] = True
