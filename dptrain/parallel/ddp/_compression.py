"""``DistributedDataParallel(compression=...)``: a fixed gradient compression, or ``"auto"``.

[Note: when compression pays]
Compression trades CPU work -- casts, matrix products, error feedback, more collectives --
for bytes on the wire. It pays only where bytes are expensive: across nodes on a network
much slower than memory. Among the ranks of one node (shared memory, loopback, NVLink)
moving a byte costs about what casting it costs, and compression loses (bf16 over loopback
measured 1.16-1.21x slower than fp32 on the MLP of ``benchmarks/ddp_step.py``). Across nodes
what it saves depends on the model as much as on the link: PowerSGD sends almost nothing
for large matrices but costs a few small operations per matrix and two round trips per
bucket, so for a model of many small convolutions bf16 can win even where PowerSGD sends
a hundredth of the bytes. ``"auto"`` therefore measures, on the job itself:

1. The first synced backwards run uncompressed (in shared memory on one node). The first
   two are not timed (first-touch allocations, the bucket rebuild); in the next three each
   rank times backward's *window* (first bucket launched to last bucket launched: the time
   communication can hide behind computation), the *exposed* communication (last bucket
   launched to all buckets reduced) and the whole backward.
2. After them (a collective: every rank is at the same backward) the ranks agree on where
   they run and on the timings (the maximum over ranks: a step is as slow as its slowest
   rank). All on one node: fp32, for good. Exposed communication under 10 % of the
   backward (or 2 ms): fp32, for good -- there is nothing to win.
3. Otherwise it tries bf16 (with 4 MiB buckets when the user chose no bucket size) and then
   PowerSGD of rank 4 for a few backwards each, timing the whole backward, and keeps the
   fastest; compression must beat fp32 by 5 % to be kept.
4. Rank 0 prints one line saying what was chosen and why; ``ddp.compression_choice`` says it
   too. Every rank takes the same decision from the same (reduced) numbers.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain._shm import node_identity  # the node test of shared memory
from dptrain.parallel.ddp import comm_hooks
from dptrain.parallel.ddp._overlap import check_optimizer
from dptrain.parallel.ddp._powersgd import PowerSGDState

__all__ = ["CHOICES", "check_compression", "check_extensions", "default_bucket_mb", "install", "AutoCompression",
           "decide"]

CHOICES = ("auto", "bf16", "fp16", "powersgd")
# Rank of compression="powersgd" and of "auto"'s PowerSGD. Rank 2 cost 1.7 points of held-out
# accuracy on ResNet-18 (width 32) on the digits, rank 4 none (benchmarks/time_to_accuracy.py,
# 3 seeds); the bytes stay negligible either way.
POWERSGD_RANK = 4
POWERSGD_START_ITER = 10  # compression="powersgd": plain all-reduces first, as PyTorch advises
# 16-bit all-reduces move the bytes fp32 would, halved: the link stays the bottleneck, and
# smaller buckets start it earlier in backward (measured over 1 Gbit/s: 0.61x of PyTorch's
# fp32 step with 4 MiB buckets, 0.73x with the default 25 MiB). The optimizer overlap wants
# them too: only the last bucket's update is left after communication. PowerSGD keeps the
# default: its messages are tiny, and every bucket costs two more round trips.
SMALL_BUCKETS_MB = [1, 4]
SMALL_BUCKET_LIMITS = [1024 * 1024, 4 * 1024 * 1024]
# (option, backwards not timed, backwards timed): fp32 first, then the trials.
_PHASES = (("fp32", 2, 3), ("bf16", 1, 3), ("powersgd", 1, 3))
_MIN_EXPOSED_SHARE, _MIN_EXPOSED_S = 0.10, 0.002
_MIN_GAIN = 0.05


def default_bucket_mb(bucket_cap_mb: float | None, compression: str | None, overlap: bool) -> list[int] | None:
    """Bucket sizes (MiB) for a DDP whose user gave none: smaller for 16-bit compression and for
    the optimizer overlap, else None (PyTorch's default)."""
    if bucket_cap_mb is None and (compression in ("bf16", "fp16") or overlap):
        return list(SMALL_BUCKETS_MB)
    return None


def check_compression(value: Any) -> str | None:
    """The normalised ``compression`` argument (None for none).

    Raises:
        ValueError: not one of None, "none", "auto", "bf16", "fp16", "powersgd".
    """
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in CHOICES + ("none",):
        return None if value.lower() == "none" else value.lower()
    raise ValueError(
        f"compression={value!r} is not a gradient compression; use None (fp32, the default), \"auto\" (measure "
        "and decide during the first steps), \"bf16\", \"fp16\" or \"powersgd\" -- or register_comm_hook(state, hook) "
        "for your own settings"
    )


def check_extensions(mixed_precision: Any, compression: str | None, overlap_optimizer: Any) -> None:
    """DDP's checks of ``compression`` / ``overlap_optimizer`` against the other arguments."""
    if overlap_optimizer is not None:
        check_optimizer(overlap_optimizer)
    if mixed_precision is not None and (compression or overlap_optimizer is not None):
        raise ValueError(
            "mixed_precision cannot be combined with compression= or overlap_optimizer=: mixed precision already "
            "replaces the all-reduce of every bucket (it reduces in reduce_dtype and upcasts); drop one of them"
        )


def _use(reducer: Any, choice: str, resize: bool, start_iter: int = POWERSGD_START_ITER) -> None:
    """Switch ``reducer`` to ``choice`` ("fp32" included) from its next backward on."""
    group = reducer.process_group
    if resize:
        limits = SMALL_BUCKET_LIMITS if choice in ("bf16", "fp16") else reducer.initial_bucket_limits
        if limits != reducer.bucket_limits:
            reducer.set_bucket_limits(limits)
    if choice == "fp32":
        reducer.comm_hook_state, reducer.comm_hook = None, None
    elif choice == "powersgd":
        if not isinstance(reducer.comm_hook_state, PowerSGDState):
            state = PowerSGDState(group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=start_iter)
            reducer.comm_hook_state = state
        reducer.comm_hook = comm_hooks.powerSGD_hook
    else:
        reducer.comm_hook_state = group
        reducer.comm_hook = comm_hooks.bf16_compress_hook if choice == "bf16" else comm_hooks.fp16_compress_hook


def install(reducer: Any, compression: str | None, uses_shm: bool, resize: bool) -> "AutoCompression | None":
    """Set ``reducer`` up for ``compression``; returns the observer of ``"auto"`` (else None).

    ``resize``: the user gave no bucket size, so 16-bit compression may use smaller buckets.
    """
    if compression is None:
        return None
    if compression != "auto":
        _use(reducer, compression, resize)
        return None
    auto = AutoCompression(reducer, uses_shm, resize)
    reducer.observer = auto
    return auto


class AutoCompression:
    """The observer behind ``compression="auto"``; see [Note: when compression pays]."""

    def __init__(self, reducer: Any, uses_shm: bool, resize: bool) -> None:
        self.reducer = reducer
        self.uses_shm = uses_shm
        self.resize = resize
        self.choice: str | None = None  # set once decided
        self.message = ""
        self._phase = 0
        self._seen = 0  # backwards seen in the current phase
        self._t_start = self._t_first = self._t_last = 0.0
        self._samples: list[tuple[float, float, float]] = []  # (window, exposed, backward) per timed backward
        self._fp32: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._timings: dict[str, float] = {}  # option -> median backward (max over ranks)
        self._nodes = 1

    # ---- the reducer's observer protocol (see the reducer's [Note: observers of a backward])
    def backward_started(self) -> None:
        self._t_start = time.perf_counter()
        self._t_first = 0.0

    def bucket_launched(self, index: int) -> None:
        now = time.perf_counter()
        if not self._t_first:
            self._t_first = now
        self._t_last = now

    def backward_finished(self, joined: bool) -> None:
        option, skip, timed = _PHASES[self._phase]
        self._seen += 1
        if self._seen > skip and not joined and self._t_first:
            done = time.perf_counter()
            self._samples.append((self._t_last - self._t_first, done - self._t_last, done - self._t_start))
        if self._seen == skip + timed:
            self._end_phase(option)

    # ---- phases and the decision (collectives: every rank is here after the same backward)
    def _end_phase(self, option: str) -> None:
        reducer, group = self.reducer, self.reducer.process_group
        medians = [statistics.median(s[k] for s in self._samples) if self._samples else 0.0 for k in range(3)]
        numbers = torch.tensor(medians, dtype=torch.float64, device=reducer.buckets[0].flat.device)
        with comm.guarded("DDP compression='auto' (agreeing on the measurements)", group):
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
        window, exposed, backward = numbers.tolist()
        self._timings[option] = backward
        self._samples, self._seen = [], 0
        if option == "fp32":
            self._fp32 = (window, exposed, backward)
            self._nodes = len({tuple(n) for n in comm.all_gather_object(node_identity(), group=group)})
        nbytes = sum(b.numel * b.flat.element_size() for b in reducer.buckets)
        choice, why = decide(self._nodes, self.uses_shm, *self._fp32, nbytes, self._timings)
        if choice is None:  # try the next option
            self._phase += 1
            _use(reducer, _PHASES[self._phase][0], self.resize, start_iter=0)
            return
        self.choice = choice
        self.message = f'dptrain: DDP compression="auto" chose {why}'
        _use(reducer, choice, self.resize, start_iter=0)
        reducer.observer = None
        if dist.get_rank(group) == 0:
            print(self.message, flush=True)


def decide(nodes: int, uses_shm: bool, window: float, exposed: float, backward: float, nbytes: int,
           trials: dict[str, float]) -> tuple[str | None, str]:
    """(choice, explanation) from the agreed measurements, or (None, "") to try the next option.

    ``window``/``exposed``/``backward``: fp32's median times (s); ``trials``: the median
    backward of every option measured so far, fp32 included. Pure, so tests check the rule.
    """
    mb = nbytes / 1e6
    fp32 = (f"{mb:.1f} MB of gradients, {exposed * 1e3:.0f} ms of communication after {window * 1e3:.0f} ms "
            f"of backward")
    if nodes == 1:
        where = "in shared memory" if uses_shm else "(loopback)"
        return "fp32", f"fp32 {where}: all ranks on one node, where compression costs as much as it saves ({fp32})"
    if exposed < max(_MIN_EXPOSED_SHARE * backward, _MIN_EXPOSED_S):
        return "fp32", f"fp32 ({nodes} nodes; {fp32}: communication is already hidden behind backward)"
    if len(trials) < len(_PHASES):
        return None, ""
    best = min((o for o in trials if o != "fp32"), key=trials.get)
    measured = ", ".join(f"{o} {t * 1e3:.0f} ms" for o, t in trials.items())
    if trials[best] > (1 - _MIN_GAIN) * trials["fp32"]:
        return "fp32", f"fp32 ({nodes} nodes; {fp32}; backward with communication: {measured})"
    label = f"PowerSGD rank {POWERSGD_RANK}" if best == "powersgd" else best
    return best, f"{label} ({nodes} nodes; {fp32}; backward with communication: {measured})"
