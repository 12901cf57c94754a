"""Why is my job slow? A per-rank step report: where each rank's step time goes.

With ``TrainerConfig(profile=True)`` (or ``dptrain run --profile``, which sets
``DPTRAIN_PROFILE=1``) every rank times each optimizer step in five parts:

* **data** -- waiting for the next batch from the loader;
* **forward** -- the model and the loss;
* **backward** -- gradient computation (the part of ``backward()`` not spent waiting);
* **comm** -- time blocked in collectives: gradient buckets whose all-reduce did not finish
  under the backward computation (DDP's *exposed* communication), FSDP gathers, the
  per-step checks -- everything that waits through :func:`dptrain.comm.guarded`;
* **optimizer** -- clipping, the step and ``zero_grad``.

Every ``profile_every_steps`` steps and at the end of ``fit``, the ranks' averages are
gathered and rank 0 prints one row per rank, names the slowest rank (the one with the most
time *not* spent waiting -- in a data-parallel job the others wait for it) and how much of
the step is exposed communication, and writes ``profile.png``: a stacked bar per rank and
the step time over the run. On CUDA the phases are separated with ``synchronize``, which
costs a little; on CPU the only cost is a few clock reads per step (measured in
``benchmarks/RESULTS.md``). Off, nothing is timed at all.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

from dptrain import comm

__all__ = ["StepProfiler", "PHASES", "format_table", "slowest_rank"]

PHASES = ("data", "forward", "backward", "comm", "optimizer")


class StepProfiler:
    """Per-step phase times on this rank; reports through rank 0.

    Args:
        device: the training device (CUDA phases are separated by ``synchronize``).
        rank: this rank.
        every: report every this many steps (and at the end).
        out_dir: where ``profile.png`` goes (None: no plot).
    """

    def __init__(self, device: torch.device, rank: int, every: int, out_dir: str | None) -> None:
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.every = every
        self.out_dir = out_dir
        self.steps: list[dict[str, float]] = []  # every step of the run on this rank
        self._window_start = 0
        self._current = dict.fromkeys(PHASES, 0.0)
        self._t = 0.0
        self._waited = 0.0
        comm.count_waiting(True)

    def close(self) -> None:
        comm.count_waiting(False)

    # -- timing -------------------------------------------------------------------------
    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        """Mark the start of waiting for the next batch."""
        self._t = self._now()
        self._waited = comm.waited_seconds()

    def lap(self, phase: str) -> None:
        """The time since the last mark belongs to ``phase``, minus what was spent waiting in collectives."""
        now = self._now()
        waited = comm.waited_seconds()
        blocked = waited - self._waited
        self._current[phase] += (now - self._t) - blocked
        self._current["comm"] += blocked
        self._t, self._waited = now, waited

    def end_step(self) -> None:
        record = dict(self._current)
        record["step"] = sum(self._current.values())
        self.steps.append(record)
        self._current = dict.fromkeys(PHASES, 0.0)

    @property
    def due(self) -> bool:
        return len(self.steps) - self._window_start >= self.every

    # -- reporting ----------------------------------------------------------------------
    def report(self, final: bool = False) -> str | None:
        """Gather every rank's averages over the window; rank 0 prints the table (collective)."""
        window = self.steps[self._window_start :] if not final else self.steps
        first = (self._window_start if not final else 0) + 1
        self._window_start = len(self.steps)
        mine = {p: statistics.fmean(s[p] for s in window) if window else 0.0 for p in (*PHASES, "step")}
        everyone = comm.all_gather_object({"mean": mine, "steps": [s["step"] for s in self.steps] if final else None,
                                           "count": len(window)})
        if self.rank != 0:
            return None
        text = format_table([e["mean"] for e in everyone], first, first + len(window) - 1, final)
        print(text, file=sys.stderr, flush=True)
        if final and self.out_dir:
            print(_plot([e["mean"] for e in everyone], [e["steps"] for e in everyone], self.out_dir),
                  file=sys.stderr, flush=True)
        return text


def slowest_rank(means: list[dict[str, float]]) -> tuple[int, float]:
    """The rank with the most time not spent waiting, and how much more that is than the fastest rank's."""
    busy = [m["step"] - m["comm"] for m in means]
    worst = max(range(len(busy)), key=busy.__getitem__)
    fastest = min(busy)
    return worst, (busy[worst] / fastest - 1.0) if fastest > 0 else 0.0


def format_table(means: list[dict[str, float]], first: int, last: int, final: bool = False) -> str:
    """The per-rank table (milliseconds per step) with the slowest rank and the exposed communication named."""
    head = f"profile: {'whole run, ' if final else ''}steps {first}-{last}, mean per step in ms"
    cols = (*PHASES, "step")
    lines = [head, "rank " + "".join(f"{c:>11}" for c in cols)]
    for r, m in enumerate(means):
        lines.append(f"{r:>4} " + "".join(f"{1000 * m[c]:>11.1f}" for c in cols))
    worst, excess = slowest_rank(means)
    comm_share = [m["comm"] / m["step"] if m["step"] > 0 else 0.0 for m in means]
    waiter = max(range(len(means)), key=comm_share.__getitem__)
    lines.append(
        f"slowest rank: {worst} ({1000 * (means[worst]['step'] - means[worst]['comm']):.1f} ms of work per step, "
        f"{100 * excess:+.0f}% against the fastest rank); exposed communication: "
        f"{100 * comm_share[waiter]:.0f}% of rank {waiter}'s step"
        + (" -- the other ranks wait for the slowest one" if len(means) > 1 and excess > 0.1 else "")
    )
    return "\n".join(lines)


def _plot(means: list[dict[str, float]], steps: list[list[float]], out_dir: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "profile: no plot (pip install matplotlib to get profile.png)"
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(11, 4))
    ranks = list(range(len(means)))
    bottom = [0.0] * len(ranks)
    for phase in PHASES:
        heights = [1000 * m[phase] for m in means]
        bars.bar(ranks, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    bars.set_xlabel("rank")
    bars.set_ylabel("ms per step")
    bars.set_xticks(ranks)
    bars.set_title("where each rank's step goes")
    bars.legend(fontsize=8)
    for r, series in enumerate(steps):
        lines.plot(range(1, len(series) + 1), [1000 * t for t in series], label=f"rank {r}", linewidth=1)
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms)")
    lines.set_title("step time over the run")
    lines.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "profile.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"profile: plot written to {path}"
