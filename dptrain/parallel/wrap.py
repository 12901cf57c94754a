"""Auto-wrap policies: which submodules of a model become FSDP units of their own.

A policy is a callable ``policy(module, nonwrapped_numel) -> bool``; FSDP walks the model
bottom-up and asks it about every submodule (never the root, which is always a unit), with
``nonwrapped_numel`` the number of parameter elements in the submodule's subtree that no
deeper unit has taken yet. Any callable with that signature works as a policy.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

__all__ = ["ModuleTypePolicy", "ParamCountPolicy"]


class ModuleTypePolicy:
    """Wrap every submodule whose type is one of ``module_types`` as its own unit.

    Args:
        module_types: an iterable of ``nn.Module`` subclasses (e.g. ``{TransformerBlock}``).

    Example:
        >>> FSDP(model, auto_wrap_policy=ModuleTypePolicy({nn.TransformerEncoderLayer}))
    """

    def __init__(self, module_types: Iterable[type]) -> None:
        self.module_types = tuple(module_types)
        bad = [t for t in self.module_types if not (isinstance(t, type) and issubclass(t, nn.Module))]
        if not self.module_types or bad:
            raise ValueError(f"ModuleTypePolicy needs nn.Module subclasses, got {list(module_types)!r}")

    def __call__(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return isinstance(module, self.module_types)

    def __repr__(self) -> str:
        return f"ModuleTypePolicy({{{', '.join(t.__name__ for t in self.module_types)}}})"


class ParamCountPolicy:
    """Wrap a submodule once it holds at least ``min_num_params`` parameters not yet wrapped.

    The tree is walked bottom-up, so the smallest subtrees reaching the threshold become
    units and what is left over goes to their parents (and finally the root).

    Args:
        min_num_params: threshold in parameter elements; must be >= 1.

    Example:
        >>> FSDP(MLP([1024] * 9), auto_wrap_policy=ParamCountPolicy(1_000_000))
    """

    def __init__(self, min_num_params: int) -> None:
        if int(min_num_params) < 1:
            raise ValueError(f"ParamCountPolicy needs min_num_params >= 1, got {min_num_params}")
        self.min_num_params = int(min_num_params)

    def __call__(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return nonwrapped_numel >= self.min_num_params

    def __repr__(self) -> str:
        return f"ParamCountPolicy({self.min_num_params})"
