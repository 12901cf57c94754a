"""What named DDP's modules before it had its own folder still answers: the public import
paths, and the module paths that pickles of a DDP written then name (see the door's
[Note: pickles from before the folder])."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (module, name) as a pickled DDP wrote them before dptrain/parallel/ddp/ (the class, its
# delayed all-reduce, mixed precision state, and a registered hook with its state).
PICKLED_BEFORE = [
    ("dptrain.parallel.ddp", "DistributedDataParallel"),
    ("dptrain.parallel._ddp_delayed", "DelayedAllReduce"),
    ("dptrain.parallel._ddp_mixed_precision", "MixedPrecisionState"),
    ("dptrain.parallel._powersgd", "PowerSGDState"),
    ("dptrain.parallel._powersgd", "powerSGD_hook"),
    ("dptrain.parallel.comm_hooks", "allreduce_hook"),
    ("dptrain.parallel.comm_hooks", "fp16_compress_hook"),
    ("dptrain.parallel.comm_hooks", "bf16_compress_hook"),
]


def test_old_import_paths_name_the_same_objects():
    import dptrain
    from dptrain.parallel import DistributedDataParallel, comm_hooks
    from dptrain.parallel.ddp import DDP, DDPSetupError, api
    from dptrain.parallel.ddp import comm_hooks as home

    assert dptrain.DDP is DDP is DistributedDataParallel is api.DistributedDataParallel
    assert DDPSetupError is api.DDPSetupError
    assert all(getattr(comm_hooks, name) is getattr(home, name) for name in home.__all__)
    assert comm_hooks.__all__ == home.__all__


def test_pickles_written_before_the_folder_find_their_globals():
    # A bare GLOBAL opcode is how a pickle names a class or function; a fresh interpreter, so
    # nothing of dptrain is imported before the unpickler asks for the old module.
    probe = (
        "import pickle\n"
        f"for module, name in {PICKLED_BEFORE!r}:\n"
        "    found = pickle.loads(f'c{module}\\n{name}\\n.'.encode())\n"
        "    print(module, name, found.__module__ + '.' + found.__qualname__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    found = [line.split()[2] for line in done.stdout.splitlines()]
    assert len(found) == len(PICKLED_BEFORE)
    for where, (_, name) in zip(found, PICKLED_BEFORE):
        assert where.startswith("dptrain.parallel.ddp.") and where.endswith("." + name), where
