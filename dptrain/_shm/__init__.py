"""Shared memory for the ranks of one node (CPU tensors): the one door of this package.

Everything outside the package imports from here:

* :class:`ShmGroup`, :class:`Work`, :class:`ShmPeerError` -- a group's collectives
  (``group.py``: the worker thread, the all-reduce, all-gather and reduce-scatter in place);
* :func:`for_reducer` -- DDP's choice: one segment on one node, one per node across nodes
  (``nodes.py``), or none; :func:`ahead_for_parameters` / :func:`discard_ahead` -- a segment
  made ahead while in-place recovery waits for a replacement, and its removal;
* :func:`close_all` -- end every group's worker thread (``dptrain.shutdown`` and exit);
  :func:`abort_all` -- the same without waiting for peers (in-place recovery);
* :func:`node_identity`, :func:`shm_disabled_by_env`, :data:`SEGMENT_PREFIX`,
  :func:`in_shared_memory`, :func:`memory_file` -- which node this is, whether ``DPTRAIN_SHM=0``
  turned sharing off, how segments are named, whether a folder is in /dev/shm, and a new file
  there, reserved and mapped (a segment made ahead; in-place recovery's state)
  (``segment.py``: the file, its mapping, the protocol, a dead peer's detection).
"""

from __future__ import annotations

from dptrain._shm.group import ShmGroup, Work, abort_all, ahead_for_parameters, close_all, for_parameters
from dptrain._shm.nodes import for_reducer
from dptrain._shm.segment import (SEGMENT_PREFIX, ShmPeerError, discard_ahead, in_shared_memory, memory_file,
                                  shm_disabled_by_env)
from dptrain._shm.segment import _node_identity as node_identity

__all__ = [
    "SEGMENT_PREFIX",
    "ShmGroup",
    "ShmPeerError",
    "Work",
    "abort_all",
    "ahead_for_parameters",
    "close_all",
    "discard_ahead",
    "for_parameters",
    "for_reducer",
    "in_shared_memory",
    "memory_file",
    "node_identity",
    "shm_disabled_by_env",
]
