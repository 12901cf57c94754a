"""DistributedDataParallel: one model replica per rank, gradients averaged by our own reducer.

How one gradient goes from autograd to an averaged ``.grad``:

1. *Forward* (``api.py``): the wrapper broadcasts rank 0's buffers, re-buckets once after the
   first backward (``_rebuild.py``), runs the module, arms the reducer and passes the outputs
   through the backward *sink* (``_sink.py``), whose backward tells the reducer that a
   training backward (one that accumulates into ``.grad``) has started.
2. *Hook* (``_reducer.py``): each parameter carries one post-accumulate-grad hook. Once
   autograd has accumulated the parameter's gradient, the hook marks it ready for its slot
   of a flat *bucket* (``_buckets.py``: which parameters share a bucket, in what order, and
   the buffers).
3. *Bucket -> all-reduce*: when the last gradient of a bucket is in, the bucket's gradients
   are copied in with one call and divided by the world size with one more (PyTorch's
   numbers, bit for bit: [Note: a bucket at a time] in ``_reducer.py``); once every earlier
   bucket has gone, the bucket is launched: an asynchronous all-reduce (gloo or NCCL, or shared
   memory on one node through :mod:`dptrain._shm`), or the registered communication hook
   (``comm_hooks.py``; PowerSGD in ``_powersgd.py``, its collectives issued in a fixed order
   by ``_hook_pipeline.py``). Buckets are launched in the same order on every rank, while the
   rest of backward runs.
4. *Copy back*: a callback queued on the autograd engine runs when backward is over: it waits
   for each bucket (a stalled peer is named at the timeout) and writes the averaged gradients
   into ``param.grad``, or leaves ``.grad`` a view of its bucket (``gradient_as_bucket_view``).
   A rank whose backward left parameters without a gradient says so through the last bucket,
   and every rank raises at its next forward (``_reducer_errors.py`` words the messages).

The modules:

- ``api.py`` -- the wrapper: construction, forward, ``no_sync``, ``join``, ``register_comm_hook``,
  pickling; ``_signature.py`` binds the installed torch's constructor arguments and
  ``_setup.py`` resolves them (group, ignored parameters, buffer sync, same model on every
  rank through :mod:`dptrain.parallel._verify`);
- ``_reducer.py`` -- buckets, per-parameter hooks, launches and the write-back, in the phases of
  :class:`~dptrain.parallel.ddp._reducer.BackwardPhase`; with ``_buckets.py``, ``_rebuild.py``,
  ``_sink.py``, ``_reducer_errors.py`` and ``_profiling.py`` (our shared-memory all-reduces in
  ``torch.profiler`` traces);
- ``comm_hooks.py`` -- the public communication hooks (also ``dptrain.parallel.comm_hooks``),
  with ``_powersgd.py`` and ``_hook_pipeline.py``; ``_compression.py`` -- the ``compression=``
  argument and its ``"auto"`` choice;
- ``_recovery.py`` -- in-place recovery: ``_recovery_layout``, ``_rejoin`` and ``joining_job``
  (a DDP follows its job onto a re-formed process group; a replacement builds one without
  collectives);
- the other arguments, one module each: ``_mixed_precision.py`` (``mixed_precision``),
  ``_delayed.py`` (``delay_all_reduce_named_params``), ``_overlap.py`` (``overlap_optimizer``),
  ``_optim_in_backward.py`` (PyTorch's ``_apply_optimizer_in_backward``) and ``_join.py``
  (what a rank that ran out of data does inside ``join()``).

Shared with the other wrappers, outside this folder: ``dptrain.parallel._verify`` (FSDP's
check too), ``dptrain.parallel.dp`` (scatter and gather), :mod:`dptrain.comm` and
:mod:`dptrain._shm`.
"""

import sys

from dptrain.parallel.ddp import _delayed, _mixed_precision, _powersgd, comm_hooks
from dptrain.parallel.ddp.api import DDP, DDPSetupError, DistributedDataParallel, joining_job

__all__ = ["DistributedDataParallel", "DDP", "DDPSetupError", "comm_hooks", "joining_job"]

# [Note: pickles from before the folder]
# A pickled DDP names the classes and hooks it holds by module. Before DDP had this folder
# three of them lived at dptrain.parallel._ddp_delayed, _ddp_mixed_precision and _powersgd
# (the class itself at dptrain.parallel.ddp, and the hooks at dptrain.parallel.comm_hooks,
# which both still answer); those old names stay importable so that such pickles load.
for _old, _module in (("_ddp_delayed", _delayed), ("_ddp_mixed_precision", _mixed_precision), ("_powersgd", _powersgd)):
    sys.modules.setdefault(f"dptrain.parallel.{_old}", _module)
del _old, _module
