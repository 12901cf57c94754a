"""FSDP state dicts: the full weights with the plain model's keys, and per-rank shards.

``full_state_dict`` gathers each unit's flat parameter and cuts it back into the original
parameters, in the plain model's state-dict order and names (tied weights under each name),
so the result loads into the unwrapped model. ``sharded_state_dict`` is this rank's shards
with enough metadata to refuse loading them into anything but the same wrapping on the same
world size.
"""

from __future__ import annotations

import torch

from dptrain.parallel.fsdp._plan import module_names

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict", "metadata"]


def param_slots(fsdp):
    """fqn -> (unit, info) for every parameter name, tied aliases included."""
    names = module_names(fsdp.module)
    slots = {}
    for u in fsdp._units:
        for info in u.infos:
            slots[_join(names[id(info.module)], info.name)] = (u, info)
        for owner, attr, idx in u.aliases:
            slots[_join(names[id(owner)], attr)] = (u, u.infos[idx])
    return names, slots


def full_state_dict(fsdp, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """See :meth:`FullyShardedDataParallel.full_state_dict` (this is its body)."""
    names, _ = param_slots(fsdp)
    keep = not rank0_only or fsdp._rank == 0
    values: dict[tuple[int, str], torch.Tensor] = {}
    for u in fsdp._units:
        full = u.gather_full()
        if keep:
            for info in u.infos:
                values[(id(info.module), info.name)] = full[info.offset : info.offset + info.numel].view(info.shape).cpu().clone()
            for owner, attr, idx in u.aliases:
                values[(id(owner), attr)] = values[(id(u.infos[idx].module), u.infos[idx].name)]
    if not keep:
        return {}
    out = {}
    for kind, m, attr in fsdp._key_order:
        key = _join(names[id(m)], attr)
        if kind == "param":
            out[key] = values[(id(m), attr)]
        else:
            out[key] = getattr(m, attr).detach().cpu().clone()
    return out


def load_full_state_dict(fsdp, state_dict: dict[str, torch.Tensor]) -> None:
    """See :meth:`FullyShardedDataParallel.load_full_state_dict`."""
    names, slots = param_slots(fsdp)
    expected = [_join(names[id(m)], a) for _, m, a in fsdp._key_order]
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if missing or unexpected:
        raise ValueError(
            f"rank {fsdp._rank}: full state dict does not match the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; "
            "strip a 'module.' prefix with dptrain.checkpoint.strip_prefix if it has one"
        )
    for u in fsdp._units:
        full = torch.empty(u.numel, dtype=u.dtype)
        for info in u.infos:
            key = _join(names[id(info.module)], info.name)
            value = state_dict[key]
            if tuple(value.shape) != tuple(info.shape):
                raise ValueError(f"rank {fsdp._rank}: '{key}' has shape {tuple(value.shape)} in the state dict but {tuple(info.shape)} in the model")
            full[info.offset : info.offset + info.numel].copy_(value.reshape(-1))
        u.load_full(full)
    with torch.no_grad():
        for kind, m, attr in fsdp._key_order:
            if kind == "buffer":
                getattr(m, attr).copy_(state_dict[_join(names[id(m)], attr)])


def metadata(fsdp) -> dict:
    names = module_names(fsdp.module)
    units = []
    for u in fsdp._units:
        units.append(
            {
                "name": names[id(u.module)] or "<root>",
                "params": [[_join(names[id(i.module)], i.name), list(i.shape)] for i in u.infos],
                "numel": u.numel,
                "padded_numel": u.padded_numel,
                "shard_numel": u.shard_numel,
            }
        )
    return {"world_size": fsdp._world, "rank": fsdp._rank, "sharding_strategy": fsdp.sharding_strategy, "units": units}


def sharded_state_dict(fsdp) -> dict:
    """See :meth:`FullyShardedDataParallel.sharded_state_dict`."""
    meta = metadata(fsdp)
    names = module_names(fsdp.module)
    flat = {um["name"]: u.flat_param.detach().cpu().clone() for um, u in zip(meta["units"], fsdp._units)}
    buffers = {
        _join(names[id(m)], a): getattr(m, a).detach().cpu().clone() for kind, m, a in fsdp._key_order if kind == "buffer"
    }
    return {"metadata": meta, "flat_params": flat, "buffers": buffers}


def load_sharded_state_dict(fsdp, state_dict: dict) -> None:
    """See :meth:`FullyShardedDataParallel.load_sharded_state_dict`."""
    if not isinstance(state_dict, dict) or "metadata" not in state_dict:
        raise ValueError(f"rank {fsdp._rank}: not a sharded FSDP state dict (no 'metadata'); did you mean load_full_state_dict?")
    saved, mine = state_dict["metadata"], metadata(fsdp)
    for key in ("world_size", "rank", "sharding_strategy"):
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"rank {fsdp._rank}: sharded state dict was saved with {key}={saved.get(key)!r} but this model has "
                f"{key}={mine[key]!r}; load it with the same world size, rank and strategy, or save a full state dict instead"
            )
    if saved["units"] != mine["units"]:
        for a, b in zip(saved["units"], mine["units"]):
            if a != b:
                raise ValueError(f"rank {fsdp._rank}: sharded state dict unit {a['name']!r} ({a['numel']} elements, params {[p[0] for p in a['params']][:4]}...) does not match this model's unit {b['name']!r} ({b['numel']} elements); wrap the same model with the same policy")
        raise ValueError(f"rank {fsdp._rank}: sharded state dict has {len(saved['units'])} units, this model has {len(mine['units'])}")
    with torch.no_grad():
        for um, u in zip(mine["units"], fsdp._units):
            u.load_shard(state_dict["flat_params"][um["name"]])
        names = module_names(fsdp.module)
        for kind, m, a in fsdp._key_order:
            if kind == "buffer":
                getattr(m, a).copy_(state_dict["buffers"][_join(names[id(m)], a)])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
