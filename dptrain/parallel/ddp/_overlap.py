"""``DistributedDataParallel(overlap_optimizer=opt)``: step each bucket as soon as it is averaged.

[Note: optimizer overlap]
Without it, ``optimizer.step()`` starts when the last bucket's all-reduce has finished, and
the network idles while the optimizer runs. With it, the reducer hands each bucket's
parameters over as soon as that bucket's averaged gradients are in ``.grad`` (see the
reducer's [Note: observers of a backward]) and they are stepped right away, while later
buckets are still on the wire; only the last bucket's update is left after communication.

The update is the user's optimizer, applied to a subset: one optimizer of the same class and
settings per bucket, holding that bucket's parameters in their original parameter groups
and sharing the user's optimizer's ``state`` dict. Hyperparameters are copied from the
user's groups before every step, so LR schedulers work. The optimizers allowed update each
parameter from its own gradient and state only, so stepping in pieces gives bitwise the
parameters of one ``optimizer.step()`` (tested for SGD, Adam and AdamW).

The user's loop stays as it is: ``optimizer.step()`` after a synced backward only steps the
parameters that no bucket holds (ignored or delayed ones), and after a backward that did not
synchronise (``no_sync``, a world of one) it is an ordinary step. Gradient accumulation with
``no_sync`` therefore works unchanged: the update happens in the synced backward.

What cannot work: anything that changes the gradients between backward and the step --
clipping by the global norm, which needs every gradient first, or ``GradScaler.unscale_``.
The step sees the change (the gradients' version counters moved) and raises.
"""

from __future__ import annotations

import inspect
import types
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["OptimizerOverlap", "SUPPORTED"]

# PyTorch's optimizers whose update of a parameter reads only that parameter's gradient and state.
SUPPORTED = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
)


def check_optimizer(optimizer: Any) -> None:
    """Raise a clear error for what ``overlap_optimizer`` cannot step bucket by bucket."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"overlap_optimizer must be a torch.optim.Optimizer built over the model's parameters, got "
            f"{type(optimizer).__name__}"
        )
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise ValueError(
            f"overlap_optimizer: {type(optimizer).__name__} cannot be stepped one bucket at a time (it may combine "
            f"parameters, or need a closure); supported: {names}. Pass overlap_optimizer=None and call "
            "optimizer.step() as usual"
        )


class OptimizerOverlap:
    """Steps ``optimizer`` bucket by bucket for a reducer; see [Note: optimizer overlap].

    Args:
        optimizer: the user's optimizer (checked with :func:`check_optimizer`).
        reducer: the reducer whose buckets it steps (read: its parameters, names, iterations).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: Any) -> None:
        check_optimizer(optimizer)
        if getattr(optimizer, "_dptrain_overlap", None) is not None:
            raise ValueError(
                "overlap_optimizer: this optimizer already steps the buckets of another DistributedDataParallel; "
                "give each wrapped model its own optimizer"
            )
        bucket_params = reducer.params
        self.optimizer = optimizer
        self.reducer = reducer
        self.names = dict(zip(map(id, reducer.params), reducer.names))
        self._iteration = -1
        self._in_buckets = {id(p) for p in bucket_params}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not held & self._in_buckets:
            raise ValueError(
                "overlap_optimizer holds none of the parameters this DistributedDataParallel averages; build it "
                "over model.parameters() of the wrapped model"
            )
        self._subs: dict[tuple[int, ...], tuple[torch.optim.Optimizer, list[int]]] = {}
        self._layout: tuple = ()
        self._stepped: list[tuple[nn.Parameter, torch.Tensor, int]] = []  # (param, its grad, grad version)
        self._original_step: Callable = optimizer.step
        optimizer.step = _step_replacement(optimizer)
        optimizer._dptrain_overlap = self

    def detach(self) -> None:
        """Give the optimizer its own ``step`` back."""
        if getattr(self.optimizer, "_dptrain_overlap", None) is self:
            self.optimizer.step = self._original_step
            del self.optimizer._dptrain_overlap

    # ---- called by the reducer with each averaged bucket
    def step_bucket(self, params: Sequence[nn.Parameter]) -> None:
        if self._iteration != self.reducer.num_iterations:
            # A new synced backward: what the user's step checks is this backward's work only.
            self._iteration, self._stepped = self.reducer.num_iterations, []
        sub = self._sub_optimizer([p for p in params if p.requires_grad])
        if sub is None:
            return
        optimizer, groups = sub
        optimizer.state = self.optimizer.state  # shared; load_state_dict replaces the user's dict
        for sub_group, g in zip(optimizer.param_groups, groups):
            for key, value in self.optimizer.param_groups[g].items():
                if key != "params":
                    sub_group[key] = value
        optimizer.step()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._stepped.append((p, p.grad, p.grad._version))

    def _sub_optimizer(self, params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, list[int]] | None:
        layout = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        if layout != self._layout:  # add_param_group, or first use
            self._subs, self._layout = {}, layout
        key = tuple(id(p) for p in params)
        if key not in self._subs:
            self._subs[key] = self._build(params)
        return self._subs[key]

    def _build(self, params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, list[int]] | None:
        wanted = {id(p) for p in params}
        groups, indices = [], []
        for gi, group in enumerate(self.optimizer.param_groups):
            members = [p for p in group["params"] if id(p) in wanted]
            if members:
                groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=members))
                indices.append(gi)
        if not groups:
            return None
        # The constructor's own arguments only (AdamW keeps a default its constructor does not
        # take); the groups carry every setting of the user's groups anyway.
        cls = type(self.optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        return cls(groups, **kwargs), indices

    # ---- the user's optimizer.step()
    def user_step(self, closure: Callable | None) -> Any:
        if not self._stepped:
            return self._original_step(closure) if closure is not None else self._original_step()
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) with DistributedDataParallel(overlap_optimizer=...): the parameters were "
                "already stepped during backward; closures (re-evaluating the loss) need an ordinary step. Pass "
                "overlap_optimizer=None"
            )
        stepped, self._stepped = self._stepped, []
        for p, grad, version in stepped:
            if p.grad is not grad or (p.grad is not None and p.grad._version != version):
                if p.grad is None:
                    continue  # zero_grad(set_to_none=True) before step: nothing was changed
                raise RuntimeError(self._changed_message(p))
        rest = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in self._in_buckets]
        if rest:
            sub = self._sub_optimizer(rest)
            if sub is not None:
                self.step_bucket(rest)
                self._stepped = []
        return None

    def _changed_message(self, p: nn.Parameter) -> str:
        name = self.names.get(id(p), "a parameter")
        return (
            f"DistributedDataParallel(overlap_optimizer=...) stepped '{name}' during backward, as soon as its bucket "
            "was averaged, but its gradient was changed after that (clipping by the global norm such as "
            "torch.nn.utils.clip_grad_norm_, or GradScaler.unscale_), too late to affect the step. Clipping by "
            "the global norm needs every gradient before any parameter moves: pass overlap_optimizer=None to clip, "
            "or do not change gradients between backward and optimizer.step()"
        )


def _step_replacement(optimizer: torch.optim.Optimizer) -> Callable:
    """What ``optimizer.step`` becomes.

    Normally a bound method: an LR scheduler built afterwards wraps it as it wraps any
    optimizer's ``step``. A scheduler built *before* the DDP has already wrapped the original;
    the replacement then keeps its mark (see :func:`scheduler_tracked_step`).
    """
    if not getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return types.MethodType(_overlapped_step, optimizer)
    return scheduler_tracked_step(optimizer, _overlapped_step)


def scheduler_tracked_step(optimizer: torch.optim.Optimizer, step_fn: Callable) -> Callable:
    """``step_fn(optimizer, closure)`` as an ``optimizer.step`` that LR schedulers accept.

    A PyTorch LR scheduler wraps ``optimizer.step`` when it is built and, on every
    ``scheduler.step()``, checks that ``optimizer.step`` still carries its
    ``_wrapped_by_lr_sched`` mark (else it warns "optimizer.step() has been overridden") and
    that a step set ``optimizer._opt_called`` (else it warns that the scheduler stepped
    first). A step installed after the scheduler keeps both.
    """
    owner = weakref.ref(optimizer)  # no cycle through the instance attribute

    def step(closure: Callable | None = None) -> Any:
        opt = owner()
        opt._opt_called = True
        return step_fn(opt, closure)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    step.__wrapped__ = step_fn  # type: ignore[attr-defined]
    return step


def _overlapped_step(optimizer: torch.optim.Optimizer, closure: Callable | None = None) -> Any:
    # LR schedulers' step tracking (``_opt_called``) is set by their own wrapper when built
    # after the DDP, and by scheduler_tracked_step when built before it.
    return optimizer._dptrain_overlap.user_step(closure)
