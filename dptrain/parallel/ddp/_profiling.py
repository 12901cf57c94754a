"""Our collectives in ``torch.profiler`` traces, named as PyTorch's are.

A gloo or NCCL collective records itself (``gloo:all_reduce``, an asynchronous event from
launch to completion). The shared-memory all-reduce of a DDP bucket does not go through
torch.distributed, so while a profiler is running the reducer records it under the same
name (``<backend>:all_reduce``): a trace, and a test that counts all-reduce events, sees
one event per bucket as with PyTorch's DDP. The event ends on another thread when the
collective completes, so it is asynchronous as PyTorch's is.

[Note: the waiter thread]
Only while profiling, each recorded collective gets a short-lived thread that waits for it
and closes its event; it waits on a Python event (never inside a torch call while it waits),
so a process that exits mid-collective is not held up by it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["profiling", "record_collective", "record_span"]


def profiling() -> bool:
    """Whether a torch profiler (``torch.profiler`` or ``torch.autograd.profiler``) is recording."""
    return torch.autograd._profiler_enabled()


def record_collective(name: str, work: Any) -> None:
    """Record ``name`` as an asynchronous profiler event from now until ``work.wait()`` returns."""
    done = torch.futures.Future()
    handle = torch.ops.profiler._record_function_enter_new(name, None)
    torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, done)

    def close() -> None:
        try:
            work.wait()
        except BaseException:  # noqa: BLE001 - the waiter in the reducer reports the failure
            pass
        done.set_result(None)

    threading.Thread(target=close, daemon=True, name="dptrain-profiler-event").start()


def record_span(name: str) -> Any:
    """``torch.autograd.profiler.record_function(name)``: a span of this thread's work."""
    return torch.autograd.profiler.record_function(name)
