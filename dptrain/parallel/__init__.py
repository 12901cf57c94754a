"""Data-parallel wrappers: DistributedDataParallel (with its reducer and comm hooks), FSDP, DataParallel."""

from dptrain._errors import ModelMismatchError
from dptrain.parallel import comm_hooks
from dptrain.parallel.ddp import DDP, DistributedDataParallel
from dptrain.parallel.dp import DataParallel
from dptrain.parallel.fsdp import FSDP, FullyShardedDataParallel, ModuleTypePolicy, ParamCountPolicy

__all__ = [
    "ModelMismatchError",
    "DDP",
    "DistributedDataParallel",
    "comm_hooks",
    "DataParallel",
    "FSDP",
    "FullyShardedDataParallel",
    "ModuleTypePolicy",
    "ParamCountPolicy",
]
