"""The launcher: everything that starts, watches and stops ranks. It never imports torch.

How ``dptrain run --nproc-per-node N train.py`` becomes N rank processes on this node:

1. ``dptrain.cli`` parses the flags; ``rendezvous.node_rank`` numbers this node (``--node-rank``,
   Slurm's node id, or the order of arrival at a ``--rdzv-backend c10d`` endpoint), and
   ``job.LaunchConfig`` checks what was asked.
2. ``job.run_job`` runs the attempts. Node 0's launcher binds the rendezvous store
   (``rendezvous.RendezvousServer``, served by ``store``: torch's TCPStore protocol in plain
   Python); the other nodes wait for it. A job across nodes with a secret (``auth``) keeps the
   store on 127.0.0.1 behind a gate that lets in only connections that prove the secret, and
   the other nodes' ranks reach it through their launcher's forwarder (``tunnel``). With
   ``--nnodes MIN:MAX``, ``membership`` decides in the store which nodes take part in each attempt.
3. ``workers`` starts each rank with torchrun's variables (``RANK``, ``WORLD_SIZE``, ...), in a
   process group of its own that dies with the launcher (``janitor``: also when the launcher is
   killed), its output relayed live under a ``[rankN]`` prefix (``relay``) and optionally
   written to torchrun's per-rank log files.
4. ``watch`` polls the ranks: their exits (published in the store, for the ranks' own error
   messages), ranks whose heartbeat stands still, ranks that exited early, and a failure that
   another node's launcher reported.
5. When a rank fails, every rank of every node is stopped (TERM, then KILL) and the failure is
   reported with its traceback; ``--max-restarts`` starts the next attempt on every node. With
   ``--recovery in-place`` (``inplace``) only the failed (or stalled) rank is replaced, by a hot
   spare that imported torch ahead (``spare``), a child forked from the node's warm template
   (``template``) or a new process, and the others keep running.
   When all ranks are done, node 0 keeps the store up until every node's are
   (``rendezvous.exit_barrier``).

``spawn`` is the same in one Python process (notebooks, tests): ``dptrain.spawn(fn, nprocs)``.
``sbatch`` writes the file of ``dptrain slurm-script``.

The ranks import torch; the launcher does not (see [Note: why the launcher does not import
torch] in ``store``): its modules import only the standard library and the lower floors of
dptrain that need no torch (``_errors``, ``_heartbeat``, ``_join``, ``_torch_version``,
``environments``). ``import dptrain`` loads none of it; the names below are imported when
first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "LaunchConfig": "dptrain.launcher.job",
    "run_job": "dptrain.launcher.job",
    "RankFailedError": "dptrain.runtime.errors",
    "rank_environ": "dptrain.launcher.workers",
    "free_port": "dptrain.launcher.rendezvous",
    "node_rank": "dptrain.launcher.rendezvous",
    "render_sbatch": "dptrain.launcher.sbatch",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'dptrain.launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dptrain.runtime.errors import RankFailedError
    from dptrain.launcher.job import LaunchConfig, run_job
    from dptrain.launcher.rendezvous import free_port, node_rank
    from dptrain.launcher.sbatch import render_sbatch
    from dptrain.launcher.workers import rank_environ
