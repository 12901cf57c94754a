"""Multi-stage communication hooks, advanced in a fixed order by the thread that calls them.

[Note: collectives in a fixed order]
gloo pairs the collectives of a group by the order in which each rank issues them. A hook
that issues its second collective from a future's callback -- PyTorch's PowerSGD issues the
Q all-reduce when the P all-reduce completes, on gloo's thread -- lets completion times
decide the issue order, and those differ between ranks: while one rank's callback issues
bucket 0's Q, its backward thread may issue bucket 1's P, and the other rank may do the
two the other way round. gloo then pairs a Q with a P ("Received data size doesn't match
expected size") or waits forever.

Here the work of one bucket is a generator (a *job*) that issues a collective and yields it,
computes with the result when resumed, issues the next, and finally returns the bucket's
averaged tensor. Jobs are resumed only from the hook calls themselves, in an order fixed by
bucket index and stage, never by completion time:

- ``hook(bucket k)``: run bucket k's job up to its first collective, then move every earlier
  job that is still running on by one stage (wait for the collective it yielded, compute,
  issue its next one), oldest first;
- the last bucket's hook drains: round after round, every running job one stage on, oldest
  first, until all are done and their futures hold the averaged buckets.

Every rank calls the hook for the same buckets in the same order, so every rank issues the
same collectives in the same order. A stage waits for a collective issued one bucket
earlier, which has usually finished meanwhile, so the pipeline keeps backward, the
computation of later buckets and the network busy together without a thread of its own.
A reducer that skips the last bucket (``skip_all_reduce_unused_params``) calls
:meth:`HookPipeline.drain` itself before waiting.
"""

from __future__ import annotations

from typing import Any, Generator

import torch
import torch.distributed as dist

from dptrain import comm

__all__ = ["HookPipeline", "Job", "allreduce_mean_future", "flush_hook_state", "future_of", "issue_all_reduce"]

#: What a job yields: an async collective's work handle and what to call it in errors.
Pending = tuple[Any, str]
Job = Generator[Pending, None, torch.Tensor]


class _Running:
    __slots__ = ("job", "future", "pending", "index")

    def __init__(self, job: Job, future: torch.futures.Future, index: int) -> None:
        self.job, self.future, self.pending, self.index = job, future, None, index


class HookPipeline:
    """The running jobs of one hook state; see [Note: collectives in a fixed order].

    Args:
        group: the process group the jobs' collectives run on (for failure messages).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._running: list[_Running] = []
        self._last_index = -1

    def __len__(self) -> int:
        return len(self._running)

    def submit(self, job: Job, index: int, is_last: bool) -> torch.futures.Future:
        """Start ``job`` (bucket ``index``), move the earlier ones on; drain after the last bucket.

        Returns a future that holds the job's result once the job has finished.
        """
        if index <= self._last_index and self._running:
            # A new iteration while jobs of the previous one still run: the previous backward
            # stopped early (an error) or its reducer never drained. Finish them first, so the
            # order of collectives stays the same on every rank.
            self.drain()
        self._last_index = index
        running = _Running(job, torch.futures.Future(), index)
        earlier = list(self._running)
        self._running.append(running)
        self._step(running)
        for r in earlier:
            self._step(r)
        if is_last:
            self.drain()
        return running.future

    def drain(self) -> None:
        """Run every job to its end, one stage per job per round, oldest first."""
        while self._running:
            for r in list(self._running):
                self._step(r)
        self._last_index = -1

    def _step(self, r: _Running) -> None:
        try:
            if r.pending is not None:
                work, name = r.pending
                comm.wait(work, f"{name} (bucket {r.index})", self.group)
            r.pending = next(r.job)
        except StopIteration as done:
            self._running.remove(r)
            r.future.set_result(done.value)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        # Nobody may wait forever on a bucket whose job can no longer finish.
        for r in self._running:
            r.job.close()
            if not r.future.done():
                r.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
        self._running = []
        self._last_index = -1


def issue_all_reduce(tensor: torch.Tensor, group: Any) -> Any:
    """Start a SUM all-reduce of ``tensor`` in place; its work handle (None in a group of one).

    Through :func:`dptrain.comm.all_reduce`, so ``DPTRAIN_DEBUG=1`` cross-checks the hooks'
    collectives between ranks like any other.
    """
    return comm.all_reduce(tensor, group=group, async_op=True)


def future_of(work: Any, tensor: torch.Tensor) -> torch.futures.Future:
    """A future that completes with ``tensor`` when ``work`` is done (at once without work)."""
    if work is None:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    return work.get_future().then(lambda _fut: tensor)


def allreduce_mean_future(process_group: Any, tensor: torch.Tensor) -> torch.futures.Future:
    """Divide ``tensor`` by the group size, then all-reduce it (SUM) asynchronously, in place.

    PyTorch's order of operations for a hook's plain average (``_allreduce_fut``).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    tensor.div_(dist.get_world_size(group))
    return future_of(issue_all_reduce(tensor, group), tensor)


def flush_hook_state(state: Any) -> None:
    """Finish the buckets a pipelined hook still has in flight (nothing for other hooks).

    The last bucket's hook drains its pipeline; a reducer that skipped that bucket, or that
    is about to issue a collective of its own, calls this first so no job is left waiting.
    """
    pipeline = getattr(state, "_pipeline", None)
    if isinstance(pipeline, HookPipeline):
        pipeline.drain()
