"""Planning an FSDP wrap: which modules become units, which parameters each unit owns, and the
plain model's names and state-dict order (which flattening would otherwise erase)."""

from __future__ import annotations

from torch import nn

__all__ = ["is_fsdp", "module_names", "record_key_order", "pick_units", "owned_params"]


def is_fsdp(module: nn.Module) -> bool:
    """True for a dptrain FSDP wrapper (marked by its class, so this module needs no import of it;
    ``dptrain.checkpoint`` asks the same way)."""
    return getattr(type(module), "_dptrain_fsdp", False) is True


def module_names(root: nn.Module) -> dict[int, str]:
    """id(module) -> its name in the plain (unwrapped) model; nested FSDP wrappers vanish."""
    names: dict[int, str] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if is_fsdp(m):
            names[id(m)] = prefix
            m = m.module
        names[id(m)] = prefix
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name)

    walk(root, "")
    return names


def record_key_order(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """The plain model's state_dict entries, in order, as (kind, owner module, attribute)."""
    order: list[tuple[str, nn.Module, str]] = []

    def walk(m: nn.Module) -> None:
        if is_fsdp(m):
            order.extend(m._key_order)  # its parameters were flattened already
            return
        for name, p in m._parameters.items():
            if p is not None:
                order.append(("param", m, name))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                order.append(("buffer", m, name))
        for child in m._modules.values():
            if child is not None:
                walk(child)

    walk(module)
    return order


def pick_units(root: nn.Module, policy) -> list[nn.Module]:
    """Unit modules chosen by the policy, children before parents, the root last."""
    units: list[nn.Module] = []

    def visit(m: nn.Module, is_root: bool) -> int:
        if is_fsdp(m):
            return 0
        n = sum(p.numel() for p in m._parameters.values() if p is not None)
        for child in m._modules.values():
            if child is not None:
                n += visit(child, False)
        if not is_root and policy is not None and n > 0 and policy(m, n):
            units.append(m)
            return 0
        return n

    visit(root, True)
    units.append(root)
    return units


def owned_params(unit_module: nn.Module, owner: dict[int, str], names, unit_ids: set) -> list:
    """The parameters a unit flattens: its subtree's, minus nested units' (already taken)."""
    out = []
    stack = [unit_module]
    while stack:
        m = stack.pop()
        for name, p in list(m._parameters.items()):
            if p is None or name == "_flat_param":
                continue
            fqn = f"{names.get(id(m), '?')}.{name}".lstrip(".")
            unit_name = names.get(id(unit_module), "?") or "<root>"
            if id(p) in owner and owner[id(p)] != unit_name:
                raise ValueError(
                    f"parameter '{fqn}' is shared between FSDP units '{owner[id(p)]}' and '{unit_name}'; "
                    "a flat parameter belongs to one unit -- wrap the common parent of the modules that "
                    "share it as one unit (adjust auto_wrap_policy) or untie the weights"
                )
            owner[id(p)] = unit_name
            out.append((m, name, p))
        for child in reversed(list(m._modules.values())):
            if child is None or is_fsdp(child) or id(child) in unit_ids:
                continue
            stack.append(child)
    # Parameters in module order (depth-first), matching state_dict order within the unit.
    order = {id(m): i for i, m in enumerate(unit_module.modules())}
    out.sort(key=lambda t: order.get(id(t[0]), 0))
    return out
