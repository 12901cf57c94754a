"""DDP's communication hooks, at their old path: they live in :mod:`dptrain.parallel.ddp.comm_hooks`."""

from dptrain.parallel.ddp.comm_hooks import (PowerSGDState, allreduce_hook, bf16_compress_hook, fp16_compress_hook,
                                             powerSGD_hook)

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "PowerSGDState", "powerSGD_hook"]
