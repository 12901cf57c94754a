"""Per-rank memory of model state and step time: DDP vs our FSDP (each strategy) vs PyTorch FSDP2.

Model: ``TinyTransformer`` sized to ~34 M parameters (vocab 8192, dim 512, depth 8), trained
with fp32 Adam on random tokens; FSDP units are the transformer blocks plus the root.

What is measured, per rank, after ``optimizer.step()`` (the point where parameters,
gradients and both Adam moments are all alive):

- **model state**: bytes of the distinct storages behind the parameters the optimizer
  steps, their gradients and the optimizer state (local shards for DTensors);
- **peak RSS during training** of the rank's process (Linux ``VmHWM``, reset with
  ``/proc/self/clear_refs`` once the model and optimizer are built) and that peak minus the
  RSS right after the model was built unwrapped (so activations, gathered parameters and
  communication buffers are included, and the freed unwrapped parameters count as saved).
  glibc keeps freed heap memory by default, which hides what a sharded model gives back;
  every rank therefore sets a fixed ``M_MMAP_THRESHOLD`` of 64 KiB (same for every config)
  so large tensors are returned to the OS when freed;
- **step time**: median of the timed steps (forward + backward + step). Every timed step
  starts after a barrier, so no rank's time includes waiting for a peer still busy with the
  previous step (or, paired, with another configuration).

The paired table builds ddp, our full_shard and FSDP2 side by side in the same ranks and
alternates them step by step; a step's time is its slowest rank's, and "ours / FSDP2" is the
median of the per-step ratios (ours and FSDP2 of the same step, the same data), printed with
both raw medians. Raw times drift with the machine's load: ``--fsdp2-baseline S`` (FSDP2's
median from an earlier run) makes the script say when the baseline moved, in which case only
ratios compare across runs.

Theory (fp32 Adam, ZeRO paper notation, Psi parameters, N ranks): 4 bytes parameter + 4
bytes gradient + 8 bytes Adam moments = 16 Psi per rank for DDP; ZeRO-3 (full_shard,
shard_grad_op: everything sharded) 16 Psi / N; no_shard = DDP.

Run (the numbers in RESULTS.md come from the first line)::

    python benchmarks/fsdp_memory.py               # 2 and 4 ranks, ~34 M params
    python benchmarks/fsdp_memory.py --quick       # small model, 2 ranks, a few seconds
    python benchmarks/fsdp_memory.py --worlds 2 --configs ddp --steps 1 --paired-steps 12 --fsdp2-baseline 0.923
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import dptrain  # noqa: E402
from dptrain.models import TinyTransformer, TransformerBlock  # noqa: E402
from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy  # noqa: E402

CONFIGS = ["ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:no_shard", "fsdp:full_shard+offload", "fsdp2"]


def _fix_malloc() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; also stops its auto-raise
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    except OSError:
        pass


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_bytes(params, optimizer) -> dict[str, int]:
    """Bytes of distinct storages: parameters, gradients, optimizer state."""
    seen: set[int] = set()

    def nbytes(ts) -> int:
        total = 0
        for t in ts:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            s = _local(t).untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
        return total

    params = list(params)
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "optim": nbytes(v for st in optimizer.state.values() for v in st.values()),
    }


def _build(cfg: str, sizes: dict):
    torch.manual_seed(0)
    model = TinyTransformer(**sizes)
    psi = sum(p.numel() for p in model.parameters())
    base_rss = _current_rss_mb()
    if cfg == "ddp":
        wrapped = dptrain.DistributedDataParallel(model)
    elif cfg == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        strategy = cfg.split(":")[1]
        offload = strategy.endswith("+offload")
        strategy = strategy.replace("+offload", "")
        wrapped = FSDP(model, auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), sharding_strategy=strategy, cpu_offload=offload)
    gc.collect()
    return wrapped, psi, base_rss


def _rank(rank: int, cfg: str, sizes: dict, batch: int, seq: int, steps: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    _fix_malloc()
    model, psi, base_rss = _build(cfg, sizes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gc.collect()
    _reset_peak_rss()
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 1):  # the first step (allocations, lazy init) is not timed
        x = torch.randint(0, sizes["vocab"], (batch, seq), generator=gen)
        dptrain.comm.barrier()  # every rank starts the step together
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
    state = model_state_bytes(model.parameters(), opt)
    return {
        "psi": psi,
        "state": state,
        "peak_rss_mb": _rss_mb(),
        "rss_growth_mb": _rss_mb() - base_rss,
        "step_s": statistics.median(times),
    }


def _paired_rank(rank: int, cfgs: list, sizes: dict, batch: int, seq: int, steps: int) -> dict:
    """Step time with the configs built side by side in one process, alternating steps."""
    import warnings

    warnings.filterwarnings("ignore")
    built = [_build(cfg, sizes)[0] for cfg in cfgs]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-4) for m in built]
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {cfg: [] for cfg in cfgs}
    for step in range(steps + 1):
        x = torch.randint(0, sizes["vocab"], (batch, seq), generator=gen)
        order = list(zip(cfgs, built, opts))
        if step % 2:
            order.reverse()  # alternate who goes first: neither always runs on a warm cache
        for cfg, model, opt in order:
            dptrain.comm.barrier()  # no rank's time includes a peer still in the previous config
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).logsumexp(-1).mean().backward()
            opt.step()
            if step:
                times[cfg].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 2 ranks, 2 steps")
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--paired-steps", type=int, default=None, help="alternating timed steps of ddp / fsdp:full_shard / fsdp2")
    ap.add_argument("--fsdp2-baseline", type=float, default=None,
                    help="FSDP2's paired median step (s) of an earlier run: say whether the baseline moved")
    args = ap.parse_args()
    if args.quick:
        sizes, worlds, steps, batch, seq, paired = dict(vocab=512, dim=64, depth=4, heads=4, max_len=32), [2], 2, 2, 16, 4
    else:
        sizes, worlds, steps, batch, seq, paired = dict(vocab=8192, dim=512, depth=8, heads=8, max_len=128), [2, 4], 3, 2, 64, 8
    paired = args.paired_steps if args.paired_steps is not None else paired
    worlds = args.worlds or worlds
    steps = args.steps or steps
    from tests._dist import run_ranks

    rows = []
    for world in worlds:
        for cfg in args.configs:
            res = run_ranks(_rank, world, cfg, sizes, batch, seq, steps, timeout=1800)
            psi = res[0]["psi"]
            state = max(sum(r["state"].values()) for r in res)
            theory = 16 * psi if cfg in ("ddp", "fsdp:no_shard") else 16 * psi / world
            rows.append(
                (world, cfg, psi, state, theory, max(r["peak_rss_mb"] for r in res),
                 max(r["rss_growth_mb"] for r in res), statistics.median(r["step_s"] for r in res), res[0]["state"])
            )  # fmt: skip
            print(_fmt(rows[-1]), flush=True)
    print()
    print("| ranks | config | model state / rank (MB) | theory (MB) | ratio | vs ZeRO-3 16Ψ/N | peak RSS in training (MB) | peak RSS - unwrapped model (MB) | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, cfg, psi, state, theory, rss, growth, step, _ in rows:
        z3 = 16 * psi / world
        print(f"| {world} | {cfg} | {state / 1e6:.1f} | {theory / 1e6:.1f} | {state / theory:.3f} | {state / z3:.2f}x | {rss:.0f} | {growth:.0f} | {step:.3f} |")
    if paired:
        cfgs = ["ddp", "fsdp:full_shard", "fsdp2"]
        print()
        print(f"Paired step time ({paired} alternating steps per config; a step takes its slowest rank's time; "
              f"medians over steps; the ratio is the median of per-step ratios):")
        print()
        print("| ranks | ddp (s) | ours full_shard (s) | FSDP2 (s) | ours / FSDP2 (paired) | ratio of the medians |")
        print("|---|---|---|---|---|---|")
        for world in worlds:
            res = run_ranks(_paired_rank, world, cfgs, sizes, batch, seq, paired, timeout=1800)
            per_step = {c: [max(r[c][i] for r in res) for i in range(paired)] for c in cfgs}
            med = {c: statistics.median(per_step[c]) for c in cfgs}
            ratio = statistics.median(o / f for o, f in zip(per_step["fsdp:full_shard"], per_step["fsdp2"]))
            print(f"| {world} | {med['ddp']:.3f} | {med['fsdp:full_shard']:.3f} | {med['fsdp2']:.3f} | {ratio:.2f} | "
                  f"{med['fsdp:full_shard'] / med['fsdp2']:.2f} |", flush=True)
            half = paired // 2
            if half:
                early, late = statistics.median(per_step["fsdp2"][:half]), statistics.median(per_step["fsdp2"][half:])
                print(f"  FSDP2 within this run: {early:.3f} s (first half) -> {late:.3f} s (second half)")
            if args.fsdp2_baseline:
                moved = med["fsdp2"] / args.fsdp2_baseline - 1
                verdict = "MOVED: compare ratios only, not raw times" if abs(moved) > 0.10 else "steady (within 10 %)"
                print(f"  FSDP2 baseline: {args.fsdp2_baseline:.3f} s earlier, {med['fsdp2']:.3f} s now "
                      f"({moved:+.0%}): {verdict}; ours against the earlier baseline: "
                      f"{med['fsdp:full_shard'] / args.fsdp2_baseline:.2f}x", flush=True)


def _fmt(row) -> str:
    world, cfg, psi, state, theory, rss, growth, step, parts = row
    detail = ", ".join(f"{k}={v / 1e6:.1f}MB" for k, v in parts.items())
    return f"world={world} {cfg:24s} psi={psi / 1e6:.1f}M state={state / 1e6:.1f}MB ({detail}) theory={theory / 1e6:.1f}MB ratio={state / theory:.3f} peakRSS={rss:.0f}MB peak-base={growth:.0f}MB step={step:.3f}s"


if __name__ == "__main__":
    main()
