"""Our collectives in ``torch.profiler`` traces, named as PyTorch's are.

A gloo or NCCL collective records itself (``gloo:all_reduce``, an asynchronous event from
launch to completion). The shared-memory all-reduce of a DDP bucket does not go through
torch.distributed, so while a profiler is running the reducer records it under the same
name (``<backend>:all_reduce``): a trace, and a test that counts all-reduce events, sees
one event per bucket as with PyTorch's DDP. The event ends on another thread when the
collective completes, so it is asynchronous as PyTorch's is.

[Note: the event ends before the wait returns]
The event starts before the collective is queued and the shared-memory worker ends it as the
collective completes, before any ``wait`` on it returns (``Work.then``), as gloo ends its own
(on its worker thread: the profiler marks the event asynchronous). Ending it later -- on a thread
that waited for the collective, as this module once did -- raced with the caller: the
profiler could be stopped and its results taken before the event ended, and ending it then
corrupted the profiler's memory, which crashed the process (SIGSEGV in libkineto) when a
garbage collection freed those results later (1 run in 3 of 15 profiled jobs in a row).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["profiling", "collective_event", "record_span"]


def profiling() -> bool:
    """Whether a torch profiler (``torch.profiler`` or ``torch.autograd.profiler``) is recording."""
    return torch.autograd._profiler_enabled()


def collective_event(name: str) -> Callable[[], None]:
    """Start ``name`` as an asynchronous profiler event; returns what ends it, for the shared-memory
    collective's ``then`` (see [Note: the event ends before the wait returns])."""
    done = torch.futures.Future()
    handle = torch.ops.profiler._record_function_enter_new(name, None)
    torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, done)
    return lambda: done.set_result(None)


def record_span(name: str) -> Any:
    """``torch.autograd.profiler.record_function(name)``: a span of this thread's work."""
    return torch.autograd.profiler.record_function(name)
