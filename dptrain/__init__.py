"""dptrain: data-parallel training for PyTorch.

One script trains the same way on one CPU, on every GPU of a machine, and across machines::

    import dptrain
    dptrain.init()                                   # torchrun / dptrain run / srun / alone
    model = dptrain.DDP(model)                       # our reducer, PyTorch's numerics
    sampler = dptrain.DistributedSampler(dataset)    # PyTorch's indices, resumable

Launch with ``dptrain run --nproc-per-node 2 train.py`` (or ``torchrun``).

The public names are imported when first used (``dptrain.DDP`` imports the DDP module),
so ``import dptrain`` is cheap and the ``dptrain run`` launcher starts its ranks before it
imports torch itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dptrain.runtime import torch_version as _torch_version

_torch_version.check()  # a clear ImportError for a torch older than dptrain supports

from dptrain.runtime.errors import RankFailedError  # imported now: it needs no torch

__version__ = "0.1.0"

# public name -> the module that defines it (a module name alone: the module itself)
_EXPORTS = {
    "World": "dptrain.runtime.env",
    "device": "dptrain.runtime.env",
    "get_world": "dptrain.runtime.env",
    "init": "dptrain.runtime.env",
    "is_initialized": "dptrain.runtime.env",
    "is_main_process": "dptrain.runtime.env",
    "local_rank": "dptrain.runtime.env",
    "rank": "dptrain.runtime.env",
    "shutdown": "dptrain.runtime.env",
    "world_size": "dptrain.runtime.env",
    "comm": "dptrain.comm",
    "checkpoint": "dptrain.checkpoint",
    "DistributedSampler": "dptrain.data",
    "prepare_dataloader": "dptrain.data",
    "gather_results": "dptrain.data",
    "main_process_first": "dptrain.data",
    "DistributedDataParallel": "dptrain.parallel.ddp",
    "DDP": "dptrain.parallel.ddp",
    "FullyShardedDataParallel": "dptrain.parallel.fsdp",
    "FSDP": "dptrain.parallel.fsdp",
    "DataParallel": "dptrain.parallel.dp",
    "ZeroRedundancyOptimizer": "dptrain.parallel.zero",
    "DiLoCo": "dptrain.parallel.diloco",
    "seed_everything": "dptrain.seeding",
    "Trainer": "dptrain.train",
    "TrainerConfig": "dptrain.train",
    "RecoverableLoop": "dptrain.train",
    # The function; its module is dptrain.launcher.spawn (no dptrain/spawn.py module would
    # rebind this attribute when imported).
    "spawn": "dptrain.launcher.spawn",
}

# The subpackages a user reaches as attributes (`dptrain.train.EarlyStopping`): imported on
# first use like every other name, so `import dptrain` stays cheap and loads no launcher.
_SUBPACKAGES = ("train", "models", "parallel", "data", "environments")
_EXPORTS.update({name: f"dptrain.{name}" for name in _SUBPACKAGES})

_MODULES = {"comm", "checkpoint", *_SUBPACKAGES}  # exported as modules

__all__ = [*_EXPORTS, "RankFailedError"]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dptrain import checkpoint, comm, data, environments, models, parallel, train
    from dptrain.data import DistributedSampler, gather_results, main_process_first, prepare_dataloader
    from dptrain.runtime.env import (World, device, get_world, init, is_initialized, is_main_process, local_rank, rank,
                             shutdown, world_size)
    from dptrain.launcher.spawn import spawn
    from dptrain.parallel.ddp import DDP, DistributedDataParallel
    from dptrain.parallel.dp import DataParallel
    from dptrain.parallel.fsdp import FSDP, FullyShardedDataParallel
    from dptrain.parallel.diloco import DiLoCo
    from dptrain.parallel.zero import ZeroRedundancyOptimizer
    from dptrain.seeding import seed_everything
    from dptrain.train import RecoverableLoop, Trainer, TrainerConfig
