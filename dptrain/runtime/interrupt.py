"""A survivor stops the step it is computing as soon as its launcher says that a peer died.

[Note: stopping a step at once]
Under ``dptrain run --recovery in-place`` a rank that dies costs its peers the step in
flight: they redo it once the group is whole again. Until this module, a survivor learnt of
the death only at its next collective -- the first gradient bucket's all-reduce, a forward
and part of a backward after the kill (up to a step's compute; on a small CPU job 40-60 ms,
on a large model seconds). All that compute was thrown away, it kept a core busy that the
replacement needed to start, and the group could not be re-formed before it ended.

The launcher sees the death within a few ms (see [Note: a process that is dying] in
:mod:`dptrain.runtime.proc`). As soon as it has announced the new generation -- before it starts the
replacement, so that the survivors re-form the group while it starts -- it sends
:data:`SIGNAL` (``SIGURG``) to the other ranks of its node. ``SIGURG`` is ignored by default,
so a process that never installed a handler (not a Trainer, not yet started, a shell in
between) is unaffected: the reason it was chosen. A rank whose Trainer (or
:class:`dptrain.RecoverableLoop`) recovers in place installs :func:`install`'s handler,
which does one thing: it notes that a signal came. Nothing is raised from the handler,
since it runs between any two bytecodes of the main thread, in the middle of torch's own
context managers (autocast, ``no_grad``, saved-tensor hooks) as readily as anywhere.

The note is acted on only at points where an exception is an ordinary one: a forward
pre-hook of the model and its blocks (:func:`watch_modules`) and DDP's gradient hook,
and only while the Trainer has :func:`arm`\\ ed them -- from the start of a training step's
forward to the end of its backward (every micro-batch of an accumulated step), never in the
optimizer step, an evaluation or a callback; ``RecoverableLoop`` arms its ``step()`` block
until the optimizer's step begins. There :func:`check` asks the store whether a generation
newer than this rank's is announced: a stray ``SIGURG`` (sent by anyone, or left over from a
recovery this rank joined through its collective already) is then forgotten at the cost of
one store read, and a real one raises :class:`PeerLost`, a :class:`~dptrain.CollectiveError`
that the Trainer recovers from exactly as from a collective that failed. The step's gradients are discarded and the
buffers and RNG streams a partial forward touched are restored from the last commit, as
they are after a failure in the backward.

The handler is installed with ``SA_RESTART`` (``signal.siginterrupt(SIGNAL, False)``), so a
system call that the signal interrupts is restarted by the kernel where it can be; those
that cannot (``poll``, timed waits) return ``EINTR``, which Python (PEP 475), c10d's sockets
and dptrain's futex waits all retry.

Survivors on other nodes are not signalled (their launcher learns of the death later, from
the store): they notice at their next collective, as before.
"""

from __future__ import annotations

import collections
import signal
import threading
from typing import Any

from torch import nn

from dptrain.runtime import heartbeat as _heartbeat, regroup as _regroup
from dptrain.runtime.errors import CollectiveError

__all__ = ["SIGNAL", "PeerLost", "install", "installed", "arm", "disarm", "check", "watch_modules", "PENDING"]

#: What ``dptrain run`` sends to the survivors of its node when it replaces a rank in place.
SIGNAL = _heartbeat.STEP_STOP_SIGNAL

#: ``PENDING[0]``: a signal came and was not checked yet (a list: read from hot paths without a
#: function call, and written by the handler without a ``global`` statement).
PENDING = [False]
_ARMED = [False]
_INSTALLED = [False]


class PeerLost(CollectiveError):
    """The launcher announced that a peer of this rank died: the step in flight is abandoned."""


def _on_signal(signum: int, frame: Any) -> None:
    PENDING[0] = True


def install() -> bool:
    """Note :data:`SIGNAL` from now on (see [Note: stopping a step at once]); True when it is noted.

    Only from the main thread (where Python runs signal handlers), and only where nobody else
    handles the signal: a handler of the script's own is left alone (False), and the rank then
    notices a death at its next collective. Idempotent; the handler stays for the process's life
    (it does nothing but set a flag).
    """
    if _INSTALLED[0]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return False
    signal.signal(SIGNAL, _on_signal)
    signal.siginterrupt(SIGNAL, False)
    _INSTALLED[0] = True
    return True


def installed() -> bool:
    return _INSTALLED[0]


def arm() -> None:
    """From here to :func:`disarm`, a noted signal may stop the step (a training step's forward and backward)."""
    _ARMED[0] = True


def disarm() -> None:
    _ARMED[0] = False


def check() -> None:
    """Raise :class:`PeerLost` when a signal came, the step is armed and a newer generation is announced.

    Called where ``PENDING[0]`` is set (a hook's one test costs nothing otherwise). Unarmed, the
    note is kept for the next armed point. A note without a newer generation is forgotten, and
    so is one for a node let into the job (its ranks join at a step boundary, not mid-step).
    """
    if not (PENDING[0] and _ARMED[0]):
        return
    PENDING[0] = False
    from dptrain.runtime import env

    keys, current = env._STATE.store, env._STATE.generation
    if keys is None:
        return
    try:
        failure = _regroup.failure_after(keys, current)
    except Exception:  # noqa: BLE001 - a store that cannot answer: the next collective tells
        return
    if failure is None:
        return
    newest, said = failure[0], [entry for entry in failure[1] if not entry.get("joining")][-1]
    rank = said.get("rank")
    who = f"rank {rank}" if isinstance(rank, int) else "a peer"
    raise PeerLost(f"{who} {said.get('why') or 'failed'}: dptrain run announced generation {newest} "
                   f"(in-place recovery); this rank's step in flight is abandoned and redone")


def _forward_pre_hook(module: Any, args: Any) -> None:
    if PENDING[0]:
        check()


#: How many of a model's modules get the check: a module with a forward pre-hook leaves torch's fast
#: path, about 3 us more per call on CPU, so the check stops at the model's blocks.
MAX_WATCHED = 32


def watch_modules(model: Any) -> list:
    """Check for a noted signal before the forward of ``model`` and of its modules, breadth first up to
    :data:`MAX_WATCHED` of them (the blocks that a forward goes through: stopping within one is soon
    enough); the hooks' handles.

    None (an empty list) where dynamo compiled a part of it: a hook that reads a flag would be traced
    and guarded, and the flag's change would make it compile again.
    """
    if any(type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod") for m in model.modules()):
        return []
    watched, seen, queue = [], {id(model)}, collections.deque([model])
    while queue and len(watched) < MAX_WATCHED:
        module = queue.popleft()
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers that are never called
            watched.append(module)
        for child in module.children():  # (a module shared by two parents is watched once)
            if id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
    return [m.register_forward_pre_hook(_forward_pre_hook) for m in watched]
