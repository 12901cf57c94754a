"""Which DDP constructor arguments the installed torch has: tests pass only those.

dptrain's DDP takes the installed torch's arguments (an argument torch lacks raises
TypeError, as with PyTorch's class), so a test that passes a newer argument (torch 2.13's
``forward_sync_buffers``, ``batched_grad_copy``, ``bucket_cap_mb_list``) runs only where
the installed torch has it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

__all__ = ["TORCH_DDP_ARGS", "torch_accepts", "needs_torch_args"]

TORCH_DDP_ARGS = frozenset(inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters)


def torch_accepts(kwargs: dict) -> bool:
    """Whether the installed torch's DDP takes every argument named in ``kwargs``."""
    return set(kwargs) <= TORCH_DDP_ARGS


def needs_torch_args(*names: str):
    """Skip a test, with the reason, where the installed torch's DDP lacks one of ``names``."""
    missing = [n for n in names if n not in TORCH_DDP_ARGS]
    return pytest.mark.skipif(
        bool(missing), reason=f"the installed torch {torch.__version__}'s DistributedDataParallel lacks {missing}"
    )
