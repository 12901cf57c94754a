"""One rank of a 2-rank job whose last gloo collectives are on tensors it drops at once,
with the process group still held when the script ends (as a model or optimizer holds it).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python gloo_exit.py {dptrain|torch|shutdown}

``dptrain``: the group comes from ``dptrain.init()`` and the script never calls shutdown.
``torch``: the group comes from ``init_process_group`` (PyTorch's style, in a script that
imports dptrain). Either way the interpreter's exit must not abort (see [Note: a gloo worker
at the interpreter's exit] in ``dptrain/runtime/exit.py``). ``shutdown``: ``dptrain.init()``, and
``dptrain.shutdown()`` at the end, which must not hang (see [Note: older torch] there).
"""
import sys

import torch
import torch.distributed as dist

import dptrain
import dptrain.comm  # noqa: F401 - what a script using dptrain's parts loads

if sys.argv[1] in ("dptrain", "shutdown"):
    dptrain.init(backend="gloo")
else:
    dist.init_process_group("gloo", init_method="env://")
# Held until the interpreter exits; not for "shutdown", whose destroy_process_group must be
# the one that lets go of the group (its destructor is what waited for the workers).
KEEP = dist.group.WORLD if sys.argv[1] != "shutdown" else None
for _ in range(50):
    dist.all_reduce(torch.ones(256))  # the tensor's Python object is gone when the call returns
    dist.all_reduce(torch.ones(8), async_op=True).wait()
if sys.argv[1] == "shutdown":
    dptrain.shutdown()
