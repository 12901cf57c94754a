"""``DistributedDataParallel(compression=...)``: a fixed gradient compression, or ``"auto"``.

[Note: when compression pays]
Compression trades CPU work -- casts, matrix products, error feedback: a few passes over the
gradients -- for bytes on the wire. It pays only where bytes are expensive: across nodes on
a network much slower than memory. Among the ranks of one node (shared memory, loopback,
NVLink) moving a byte costs about what casting it costs, and compression loses (bf16 over
loopback measured 1.16-1.21x slower than fp32 on the MLP of ``benchmarks/ddp_step.py``).

``"auto"`` therefore decides from measurements of the job itself:

1. The first synced backwards run uncompressed (in shared memory on one node). The first
   two are not timed (first-touch allocations, the bucket rebuild); in the next three each
   rank times backward's *window* (first bucket launched to last bucket launched: the
   time communication can hide behind computation) and the *exposed* communication (last
   bucket launched to all buckets reduced).
2. After them every rank contributes its timings (the maximum over ranks is used, the step
   being as slow as its slowest rank), where it runs, and the group's latency (a few tiny
   all-reduces) and this rank's cost of copying the gradients once.
3. One node: fp32, always. Several nodes: with ``S = window + exposed`` the time fp32
   communication took, ``c`` the copy cost and ``L`` the latency, the exposed time of
   bf16 is predicted as ``max(0, S/2 - window) + 2c`` and that of PowerSGD (which sends a
   fraction ``f`` of the bytes) as ``max(0, f*S - window) + 2L + 4.5c``. The fastest
   prediction is taken if it saves at least 10 % of (window + exposed) and 2 ms; otherwise
   fp32 stays.
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
from dptrain._shm_segment import _node_identity  # the node test of shared memory
from dptrain.parallel import comm_hooks
from dptrain.parallel._overlap import check_optimizer
from dptrain.parallel._powersgd import PowerSGDState

__all__ = ["CHOICES", "check_compression", "check_extensions", "install", "AutoCompression", "decide"]

CHOICES = ("auto", "bf16", "fp16", "powersgd")
POWERSGD_RANK = 2  # rank of compression="powersgd" and of "auto"'s PowerSGD
POWERSGD_START_ITER = 10  # compression="powersgd": plain all-reduces first, as PyTorch advises
# 16-bit all-reduces move the bytes fp32 would, halved: the link stays the bottleneck, and
# smaller buckets start it earlier in backward (measured over 1 Gbit/s: 0.61x of PyTorch's
# fp32 step with 4 MiB buckets, 0.73x with the default 25 MiB). PowerSGD keeps the default:
# its messages are tiny, and every bucket costs a few more round trips.
SMALL_BUCKET_LIMITS = [1024 * 1024, 4 * 1024 * 1024]
_SKIP_STEPS, _TIMED_STEPS = 2, 3
_MIN_SAVING_SHARE, _MIN_SAVING_S = 0.10, 0.002
# Passes over the gradients, in units of one copy (read + write of every byte).
_BF16_COPIES, _POWERSGD_COPIES = 2.0, 4.5


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


def _powersgd_state(group: Any, start_iter: int) -> PowerSGDState:
    return PowerSGDState(group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=start_iter)


def _use(reducer: Any, choice: str, resize: bool, start_iter: int = POWERSGD_START_ITER) -> None:
    group = reducer.process_group
    if resize and choice in ("bf16", "fp16"):
        reducer.set_bucket_limits(SMALL_BUCKET_LIMITS)
    if choice == "powersgd":
        reducer.comm_hook_state, reducer.comm_hook = _powersgd_state(group, start_iter), comm_hooks.powerSGD_hook
    elif choice in ("bf16", "fp16"):
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


def compressed_fraction(params: list[torch.Tensor], rank: int = POWERSGD_RANK) -> float:
    """Share of the gradient elements PowerSGD of ``rank`` sends (PyTorch's rule of what to compress)."""
    before = after = 0
    for p in params:
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // n if n else 0
        r = min(n, m, rank)
        before += p.numel()
        after += (n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else p.numel()
    return after / before if before else 1.0


class AutoCompression:
    """The observer behind ``compression="auto"``; see [Note: when compression pays]."""

    def __init__(self, reducer: Any, uses_shm: bool, resize: bool) -> None:
        self.reducer = reducer
        self.uses_shm = uses_shm
        self.resize = resize
        self.choice: str | None = None  # set once decided
        self.message = ""
        self._seen = 0
        self._t_start = self._t_first = self._t_last = 0.0
        self._samples: list[tuple[float, float]] = []  # (window, exposed) per timed backward

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
        self._seen += 1
        if self._seen > _SKIP_STEPS and not joined and self._t_first:
            done = time.perf_counter()
            self._samples.append((self._t_last - self._t_first, done - self._t_last))
        if self._seen == _SKIP_STEPS + _TIMED_STEPS:
            self._decide()

    # ---- the decision (collective: every rank is here after the same backward)
    def _decide(self) -> None:
        reducer = self.reducer
        group = reducer.process_group
        device = reducer.buckets[0].flat.device
        window = statistics.median(s[0] for s in self._samples) if self._samples else 0.0
        exposed = statistics.median(s[1] for s in self._samples) if self._samples else 0.0
        nodes = len({tuple(n) for n in comm.all_gather_object(_node_identity(), group=group)})
        latency = self._latency(group, device)
        copy_s = self._copy_seconds()
        numbers = torch.tensor([window, exposed, latency, copy_s], dtype=torch.float64, device=device)
        with comm.guarded("DDP compression='auto' (agreeing on the measurements)", group):
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
        window, exposed, latency, copy_s = numbers.tolist()
        nbytes = sum(b.numel * b.flat.element_size() for b in reducer.buckets)
        self.choice, why = decide(nodes, self.uses_shm, window, exposed, latency, copy_s, nbytes,
                                  compressed_fraction(reducer.params))
        self.message = f'dptrain: DDP compression="auto" chose {why}'
        if self.choice != "fp32":
            _use(reducer, self.choice, self.resize, start_iter=0)
        reducer.observer = None
        if dist.get_rank(group) == 0:
            print(self.message, flush=True)

    @staticmethod
    def _latency(group: Any, device: torch.device) -> float:
        probe = torch.zeros(1, device=device)
        times = []
        with comm.guarded("DDP compression='auto' (latency probe)", group):
            for _ in range(3):
                t0 = time.perf_counter()
                dist.all_reduce(probe, group=group)
                if probe.is_cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
        return min(times)

    def _copy_seconds(self) -> float:
        # One copy of every gradient byte, extrapolated from the largest bucket (warm pages).
        largest = max(self.reducer.buckets, key=lambda b: b.numel).buffer
        scratch = torch.empty_like(largest)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            scratch.copy_(largest)
            if scratch.is_cuda:
                torch.cuda.synchronize(scratch.device)
            times.append(time.perf_counter() - t0)
        total = sum(b.numel for b in self.reducer.buckets)
        return min(times[1:]) * total / max(1, largest.numel())


def decide(nodes: int, uses_shm: bool, window: float, exposed: float, latency: float, copy_s: float,
           nbytes: int, fraction: float) -> tuple[str, str]:
    """(choice, explanation) from the reduced measurements; pure, so tests can check the rule."""
    mb = nbytes / 1e6
    span = window + exposed
    if nodes == 1:
        where = "in shared memory" if uses_shm else "(loopback)"
        return "fp32", (f"fp32 {where}: all ranks on one node, where compression costs as much as the bytes "
                        f"it saves ({mb:.1f} MB of gradients, {exposed * 1e3:.0f} ms of communication after backward)")
    rate = nbytes / span / 1e6 if span > 0 else float("inf")
    predicted = {
        "bf16": max(0.0, span / 2 - window) + _BF16_COPIES * copy_s,
        "powersgd": max(0.0, fraction * span - window) + 2 * latency + _POWERSGD_COPIES * copy_s,
    }
    best = min(predicted, key=predicted.get)
    saving = exposed - predicted[best]
    measured = (f"{nodes} nodes, {mb:.1f} MB of gradients in {span * 1e3:.0f} ms (~{rate:.0f} MB/s), "
                f"{exposed * 1e3:.0f} ms of it after {window * 1e3:.0f} ms of backward")
    options = ", ".join(f"{k} ~{v * 1e3:.0f} ms" for k, v in sorted(predicted.items()))
    if saving < max(_MIN_SAVING_SHARE * span, _MIN_SAVING_S):
        return "fp32", f"fp32 ({measured}; compression would not save enough: {options})"
    label = f"PowerSGD rank {POWERSGD_RANK}" if best == "powersgd" else best
    return best, f"{label} ({measured}; predicted after backward: {options})"
