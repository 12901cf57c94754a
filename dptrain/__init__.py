"""dptrain: data-parallel training for PyTorch.

One script trains the same way on one CPU, on every GPU of a machine, and across machines::

    import dptrain
    dptrain.init()                                   # torchrun / dptrain run / srun / alone
    model = dptrain.DDP(model)                       # our reducer, PyTorch's numerics
    sampler = dptrain.DistributedSampler(dataset)    # PyTorch's indices, resumable

Launch with ``dptrain run --nproc-per-node 2 train.py`` (or ``torchrun``).
"""

from dptrain import comm
from dptrain.env import (
    World,
    device,
    get_world,
    init,
    is_initialized,
    is_main_process,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from dptrain._errors import RankFailedError
from dptrain.spawn import spawn
from dptrain.data import DistributedSampler, gather_results, main_process_first, prepare_dataloader
from dptrain.parallel.ddp import DDP, DistributedDataParallel
from dptrain.parallel.fsdp import FSDP, FullyShardedDataParallel
from dptrain.parallel.dp import DataParallel
from dptrain.parallel.zero import ZeroRedundancyOptimizer
from dptrain import checkpoint
from dptrain.seeding import seed_everything
from dptrain.train import Trainer, TrainerConfig

__version__ = "0.1.0"

__all__ = [
    "World",
    "comm",
    "device",
    "get_world",
    "init",
    "is_initialized",
    "is_main_process",
    "local_rank",
    "rank",
    "shutdown",
    "spawn",
    "world_size",
    "RankFailedError",
    "DistributedSampler",
    "prepare_dataloader",
    "gather_results",
    "main_process_first",
    "DistributedDataParallel",
    "DDP",
    "FullyShardedDataParallel",
    "FSDP",
    "DataParallel",
    "ZeroRedundancyOptimizer",
    "checkpoint",
    "seed_everything",
    "Trainer",
    "TrainerConfig",
]
