"""Data-parallel wrappers: DistributedDataParallel (with its reducer and comm hooks), FSDP, DataParallel,
and DiLoCo (local steps, a rare outer sync across slow links)."""

from dptrain.runtime.errors import ModelMismatchError
from dptrain.parallel import comm_hooks
from dptrain.parallel.ddp import DDP, DistributedDataParallel
from dptrain.parallel import diloco
from dptrain.parallel.diloco import DiLoCo
from dptrain.parallel.dp import DataParallel
from dptrain.parallel.fsdp import FSDP, FullyShardedDataParallel, ModuleTypePolicy, ParamCountPolicy

__all__ = [
    "ModelMismatchError",
    "DDP",
    "DistributedDataParallel",
    "comm_hooks",
    "DiLoCo",
    "diloco",
    "DataParallel",
    "FSDP",
    "FullyShardedDataParallel",
    "ModuleTypePolicy",
    "ParamCountPolicy",
]
