"""The life of one rank process, from its first import to its exit.

Everything here is about *this process* inside a job -- not about a model, a sampler or the
launcher's view of the job. Read the modules in the order a rank lives them:

1. **Before anything else.** ``import dptrain`` asks :mod:`~dptrain.runtime.torch_version`
   whether the installed torch is one dptrain supports (read from its metadata, without
   importing torch). :mod:`~dptrain.runtime.settings` holds every ``DPTRAIN_*`` variable,
   its default and the values it takes; :mod:`~dptrain.runtime.errors` the error types.
   These three need no torch: the launcher stands on them too.
2. **Who am I.** :mod:`~dptrain.runtime.env` builds the :class:`~dptrain.runtime.env.World`
   (rank, world size, local rank, device, backend) from what the launcher set
   (``dptrain.environments`` reads torchrun's, Slurm's or a lone process's variables), and
   ``dptrain.init`` joins the process group; :mod:`~dptrain.runtime.join` says out loud what
   ``init`` waits for while it waits.
3. **Living in the job.** :mod:`~dptrain.runtime.heartbeat` publishes the rank's progress to
   the store (and holds the store's key layout and how an exit is put into words);
   :mod:`~dptrain.runtime.diagnostics` checks collectives against the other ranks' in debug
   mode and explains a failed one; :mod:`~dptrain.runtime.tensors` walks nested batches (to a
   device, to a dtype, packed for sending).
4. **When a peer fails.** :mod:`~dptrain.runtime.interrupt` stops the step being computed as
   soon as the launcher says a peer died; :mod:`~dptrain.runtime.proc` reads ``/proc`` to see
   whether a process lives or is already dying; :mod:`~dptrain.runtime.regroup` leaves the
   broken process group and forms the next generation's (in-place recovery);
   :mod:`~dptrain.runtime.abandon` ends a wait for a collective that the failure left hanging.
5. **The end.** :mod:`~dptrain.runtime.exit` lets gloo's worker threads finish before the
   interpreter does, so a rank that ran collectives exits without an abort.

This ``__init__`` imports nothing, on purpose: the launcher imports the torch-free modules
(settings, errors, heartbeat, proc, torch_version) without loading torch, and a rank loads
each module when it first needs it. Import a module by its name here::

    from dptrain.runtime import env, heartbeat
"""

__all__ = [
    "abandon", "diagnostics", "env", "errors", "exit", "heartbeat", "interrupt", "join", "proc", "regroup", "settings",
    "tensors", "torch_version",
]
