"""What DistributedDataParallel's constructor checks and resolves before it builds a reducer.

PyTorch's rules, one function each: which group (``process_group`` / ``device_mesh``), which
parameters and buffers DDP manages (``_set_params_and_buffers_to_ignore_for_model``), how
``broadcast_buffers`` and ``forward_sync_buffers`` combine, and the check that every rank
built the same model.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index

from dptrain.runtime import env
from dptrain.comm import BROADCAST_BUCKET_BYTES, broadcast_coalesced  # noqa: F401 - DDP's broadcasts, as setup.*
from dptrain.runtime.tensors import map_tensors
from dptrain.parallel import _verify

__all__ = ["DDPSetupError", "output_device_index", "map_tensors"]

IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"  # PyTorch's name: models marked for torch work here


class DDPSetupError(ValueError, RuntimeError):
    """A DistributedDataParallel set-up error where PyTorch raises ``RuntimeError``.

    It is also a ``ValueError``, which dptrain raised before, so ``except RuntimeError`` (as
    for PyTorch's DDP) and ``except ValueError`` both catch it.
    """


def _root_mesh(device_mesh: Any) -> Any:
    """The mesh ``device_mesh`` was sliced from (itself when it was not), asked as the installed
    torch's own DDP asks: ``DeviceMesh._get_root_mesh`` (2.11 on), ``_mesh_resources.get_root_mesh``
    (2.8) or ``_mesh_resources.get_parent_mesh`` (2.4)."""
    if hasattr(device_mesh, "_get_root_mesh"):
        return device_mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources

    if hasattr(_mesh_resources, "get_root_mesh"):
        return _mesh_resources.get_root_mesh(device_mesh)
    return _mesh_resources.get_parent_mesh(device_mesh) or device_mesh


def resolve_group(process_group: Any, device_mesh: Any) -> Any:
    """The group DDP reduces over: PyTorch's rules for ``process_group`` and ``device_mesh``.

    Returns None when torch.distributed is not initialized (a world of one).

    Raises:
        RuntimeError: no process group, but the launcher says the world is larger
            (``dptrain.init()`` forgotten; see :func:`dptrain.runtime.env.check_joined`).
    """
    if process_group is not None and device_mesh is not None:
        raise DDPSetupError(
            "Cannot specify both process_group and device_mesh arguments: pass device_mesh alone (DDP then "
            "reduces over its group) or process_group alone."
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise DDPSetupError(
                f"Only 1D device mesh is supported, but got {device_mesh} with {device_mesh.ndim} dimensions; "
                "pass the data-parallel dimension, e.g. device_mesh=mesh['dp']."
            )
        if _root_mesh(device_mesh) is not device_mesh:
            raise NotImplementedError(
                "device_mesh: a mesh sliced out of a larger one (DDP combined with tensor parallelism) is not "
                "supported by dptrain's DDP; use torch.nn.parallel.DistributedDataParallel for DDP + TP, or "
                "pass a 1D mesh of its own."
            )
        return device_mesh.get_group(mesh_dim=0)
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if process_group is None:
        env.check_joined("dptrain.DistributedDataParallel")
    return process_group


def resolve_buffer_sync(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None, deprecated: bool = True
) -> tuple[bool, bool]:
    """``(forward_sync_buffers, init_sync_buffers)`` from the new and the deprecated argument.

    PyTorch 2.13's rules and warnings: ``broadcast_buffers`` warns (FutureWarning) whenever it
    is given; ``broadcast_buffers=False`` also keeps buffers out of the initial broadcast,
    ``forward_sync_buffers=False`` does not; the new argument wins when both are given.
    ``deprecated=False`` (a torch without ``forward_sync_buffers``): no warning, as there.
    """
    if broadcast_buffers is not None and deprecated:
        if forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                "deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                FutureWarning,
                stacklevel=4,
            )
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely "
                "on buffers NOT being synced at init (e.g. rank-local buffers), keep using "
                "`broadcast_buffers=False`.",
                FutureWarning,
                stacklevel=4,
            )
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def ignored_names(module: nn.Module) -> set[str]:
    """Parameter and buffer names marked by ``_set_params_and_buffers_to_ignore_for_model``."""
    names = set(getattr(module, IGNORE_ATTR, ()))
    if names:
        known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        unknown = sorted(names - known)
        if unknown:
            warnings.warn(
                f"DistributedDataParallel: {unknown} were marked to be ignored but {type(module).__name__} has "
                "no parameter or buffer of that name (names are fully qualified, e.g. 'encoder.0.weight'); "
                "they are synchronised as usual",
                stacklevel=4,
            )
    return names


def params_for_reducer(module: nn.Module, ignore: set[str]) -> tuple[list[nn.Parameter], list[str]]:
    """Trainable, not ignored, shared ones once: in PyTorch's order, so indices in errors match."""
    params, names, seen = [], [], set()
    for module_name, sub in module.named_modules():
        for param_name, p in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            if p.requires_grad and fqn not in ignore and p not in seen:
                seen.add(p)
                params.append(p)
                names.append(fqn)
    return params, names


def managed_tensors(module: nn.Module, ignore: set[str], buffers: bool) -> list[torch.Tensor]:
    """Parameters (detached) and, if asked, buffers that DDP keeps equal across ranks."""
    out = [p.detach() for n, p in module.named_parameters() if n not in ignore]
    if buffers:
        out += [b for n, b in module.named_buffers() if n not in ignore]
    return out


def buffer_slots(module: nn.Module, ignore: set[str]) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of each buffer DDP keeps equal across ranks, by where it is held:
    reading ``module._buffers[name]`` follows a buffer that is reassigned later."""
    return [(m, n) for prefix, m in module.named_modules() for n in m._buffers
            if (f"{prefix}.{n}" if prefix else n) not in ignore]


def check_devices(module_params: list[nn.Parameter], device_ids: Any, output_device: Any) -> tuple[str, list | None]:
    """PyTorch's device rules; returns ``(device_type, device indices or None)``."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids can only be None or contain a single element, got {list(device_ids)}: one DDP process "
            "drives one device (device_ids=[local_rank])."
        )
    types = {p.device.type for p in module_params}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but input module "
            f"parameters locate in {sorted(types)}."
        )
    device_type = next(iter(types))
    multi = len({p.device for p in module_params}) > 1
    if not device_ids or device_type == "cpu" or multi:
        if device_ids or output_device is not None:
            devices = sorted({str(p.device) for p in module_params})
            raise ValueError(
                f"device_ids={device_ids} / output_device={output_device} only work with a module on one CUDA "
                f"device (pass device_ids=[local_rank]); this module's parameters are on {devices}. For CPU or "
                "multi-device modules leave device_ids and output_device as None."
            )
        return device_type, None
    return device_type, [_get_device_index(d, True) for d in device_ids]  # indices, as PyTorch keeps them


def output_device_index(device_ids: list[int] | None, output_device: Any) -> int | None:
    """PyTorch's ``output_device``: an index, ``device_ids[0]`` by default, None for CPU modules."""
    if not device_ids:
        return None
    return _get_device_index(device_ids[0] if output_device is None else output_device, True)


def verify_same_model(module: nn.Module, ignore: set[str], settings: dict, group: Any) -> None:
    """Every rank raises DDPSetupError naming the first difference if the ranks built different models.

    ``settings`` are constructor arguments that shape the collectives: they must agree too,
    or buckets would not line up (see :mod:`dptrain.parallel._verify`).
    """
    _verify.verify_same_model(module, group, dist.get_rank(group), "DistributedDataParallel",
                              list(settings.items()), ignore, error=_different_models)


def _different_models(message: str) -> DDPSetupError:
    # PyTorch's opening words first, for those who search their logs for them.
    return DDPSetupError(f"DDP expects same model across all ranks, but {message}")


def warn_ignored_arguments(check_reduction: bool, bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> None:
    """PyTorch's FutureWarning for ``check_reduction``; ours for a ``bucket_cap_mb`` that a list overrides."""
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
            "using it.",
            FutureWarning,
            stacklevel=4,
        )
    if bucket_cap_mb_list and bucket_cap_mb is not None:
        warnings.warn(
            f"DistributedDataParallel: bucket_cap_mb={bucket_cap_mb} is ignored because bucket_cap_mb_list "
            "gives the size of every bucket",
            stacklevel=4,
        )
