"""Data-parallel wrappers: DistributedDataParallel (with its reducer and comm hooks), FSDP, DataParallel."""

from dptrain.parallel import comm_hooks
from dptrain.parallel.ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "comm_hooks"]
