"""Time to accuracy with gradient compression: ResNet-18 on the embedded digits (the `make demo` task).

Every variant trains the demo's model and recipe -- ResNet-18 (width 16), SGD with Nesterov
momentum and weight decay, one-cycle LR, 8 epochs, batch 32 per rank -- from the same seed,
and the held-out test accuracy is measured after every epoch with the training clock
stopped. Variants take turns within each seed (PyTorch's DDP fp32 first, then dptrain's
bf16, PowerSGD and "auto"), so they see the same machine and link. Rank 0 writes the curves
as JSON and, with ``--plot``, a PNG of accuracy against training wall time.

    # across a 1 Gbit/s link (root; see benchmarks/netlink.py)
    python benchmarks/netlink.py --rate 1gbit -- benchmarks/time_to_accuracy.py --seeds 0,1,2 \\
        --out benchmarks/time_to_accuracy.json --plot benchmarks/time_to_accuracy.png
    # on one node
    dptrain run --nproc-per-node 2 benchmarks/time_to_accuracy.py --seeds 0 --epochs 2

``--plot-only JSON`` redraws the PNG from a saved JSON without training (matplotlib needed:
``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import dptrain  # noqa: E402
from dptrain.models import ResNet18  # noqa: E402
from dptrain.parallel import comm_hooks  # noqa: E402
from dptrain.parallel.ddp._compression import POWERSGD_RANK, POWERSGD_START_ITER  # noqa: E402

VARIANTS = {
    "torch_fp32": "PyTorch DDP fp32",
    "bf16": 'dptrain compression="bf16"',
    "powersgd": 'dptrain compression="powersgd"',
    "auto": 'dptrain compression="auto"',
}


def _wrap(variant: str, model: nn.Module, args) -> nn.Module:
    if variant == "torch_fp32":
        return nn.parallel.DistributedDataParallel(model)
    if variant == "powersgd" and (args.powersgd_rank or args.powersgd_start is not None):
        ddp = dptrain.DDP(model)
        state = comm_hooks.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank or POWERSGD_RANK,
                                         start_powerSGD_iter=POWERSGD_START_ITER if args.powersgd_start is None
                                         else args.powersgd_start)
        ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)
        return ddp
    return dptrain.DDP(model, compression=variant)


def _accuracy(model: nn.Module, test_set) -> float:
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return 100.0 * correct / len(y)


def train(variant: str, seed: int, args, data) -> dict:
    """One run; returns the per-epoch (training seconds, test accuracy) and the final numbers."""
    train_set, _, test_set = data
    dptrain.seed_everything(seed)
    net = ResNet18(num_classes=10, in_channels=1, width=args.width)
    model = _wrap(variant, net, args)
    loader = dptrain.prepare_dataloader(train_set, args.batch_size, shuffle=True, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.25)
    clock, curve = 0.0, []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the slower rank's clock
        clock += t.item()
        curve.append((clock, _accuracy(model.module, test_set)))
    choice = getattr(model, "compression_choice", None) if variant != "torch_fp32" else None
    return {"variant": variant, "seed": seed, "curve": curve, "seconds": clock, "accuracy": curve[-1][1],
            "choice": choice, "steps_per_epoch": len(loader)}


def _mean_curve(runs: list[dict]) -> list[tuple[float, float]]:
    """Epoch by epoch: (mean training time, mean accuracy) over the seeds."""
    epochs = min(len(r["curve"]) for r in runs)
    return [(statistics.mean(r["curve"][e][0] for r in runs), statistics.mean(r["curve"][e][1] for r in runs))
            for e in range(epochs)]


def summarize(runs: list[dict]) -> list[str]:
    """Markdown rows: mean final accuracy, mean training time and the time the seed-averaged
    curve first reaches PyTorch fp32's mean final accuracy minus 0.5 points, with ratios."""
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    by = {v: rs for v, rs in by.items() if rs}
    ref = by["torch_fp32"]
    ref_acc = statistics.mean(r["accuracy"] for r in ref)
    ref_s = statistics.mean(r["seconds"] for r in ref)
    target = ref_acc - 0.5
    hits = {v: next((t for t, a in _mean_curve(rs) if a >= target), None) for v, rs in by.items()}
    rows = [f"target: PyTorch fp32's mean final accuracy {ref_acc:.2f} % minus 0.5 points = {target:.2f} %",
            "| variant | final accuracy, mean (per seed) | training time, mean (s) | vs PyTorch fp32 | "
            "mean curve reaches target at (s) | vs PyTorch fp32 |",
            "| --- | --- | --- | --- | --- | --- |"]
    for v, rs in by.items():
        accs = [r["accuracy"] for r in rs]
        secs = statistics.mean(r["seconds"] for r in rs)
        hit = hits[v]
        reached = (f"{hit:.1f} | {hit / hits['torch_fp32']:.2f}x" if hit is not None and hits["torch_fp32"]
                   else "not reached | -")
        choices = sorted({str(r["choice"] or "fp32") for r in rs})
        label = VARIANTS[v] + (f" (chose {', '.join(choices)})" if v == "auto" else "")
        rows.append(f"| {label} | {statistics.mean(accs):.2f} ({', '.join(f'{a:.1f}' for a in accs)}) | "
                    f"{secs:.1f} | {secs / ref_s:.2f}x | {reached} |")
    return rows


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"torch_fp32": "black", "bf16": "tab:blue", "powersgd": "tab:red", "auto": "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in VARIANTS:
        for i, r in enumerate(x for x in runs if x["variant"] == v):
            ts, accs = zip(*r["curve"])
            ax.plot(ts, accs, marker="o", ms=3, color=colors[v], alpha=0.8, label=VARIANTS[v] if i == 0 else None)
    ax.set_xlabel("training wall time (s), evaluation excluded")
    ax.set_ylabel("held-out test accuracy (%)")
    ax.set_ylim(80, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _title(args) -> str:
    return (f"ResNet-18 (width {args.width}) on digits, batch {args.batch_size}/rank, 2 ranks; "
            f"{len(args.seeds.split(','))} seeds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=32, help="per rank")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--powersgd-rank", type=int, default=None, help="the powersgd variant's rank (default: the library's)")
    ap.add_argument("--powersgd-start", type=int, default=None, help="its start_powerSGD_iter (default: the library's)")
    ap.add_argument("--out", default=None, help="JSON of every curve (rank 0)")
    ap.add_argument("--plot", default=None, help="PNG of accuracy against wall time (rank 0)")
    ap.add_argument("--title", default=None, help="plot title (default: model, width, link)")
    ap.add_argument("--plot-only", default=None, help="redraw --plot from this JSON; no training")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            runs = json.load(f)["runs"]
        plot(runs, args.plot, args.title or _title(args))
        print("\n".join(summarize(runs)))
        return
    from _data import load_digits_split

    torch.set_num_threads(1)
    world = dptrain.init(backend="gloo")
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        data = load_digits_split(seed=seed)
        for variant in args.variants.split(","):
            run = train(variant, seed, args, data)
            runs.append(run)
            if world.rank == 0:
                print(f"seed {seed} {VARIANTS[variant]}: {run['accuracy']:.2f} % in {run['seconds']:.1f} s", flush=True)
    if world.rank == 0:
        print("\n".join(summarize(runs)))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "world_size": world.world_size, "runs": runs}, f, indent=1)
        if args.plot:
            plot(runs, args.plot, args.title or _title(args))
    dptrain.shutdown()


if __name__ == "__main__":
    main()
