"""Step time and memory on GPUs (NCCL): our DDP against PyTorch's, our FSDP against FSDP2.

One rank per visible GPU, through ``dptrain.spawn``. Each wrapper trains its own identical
copy; steps alternate between the two in the same processes (ours, theirs, ours, ...) so
both see the same machine, and the table gives median step times (the slowest rank's, with
``torch.cuda.synchronize``), the ratio ours/theirs and the peak memory each allocated.

    .venv/bin/python benchmarks/gpu_step.py [--steps 30] [--width 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import dptrain


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _time_steps(models: dict, batch: torch.Tensor, steps: int) -> dict[str, list[float]]:
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for step in range(steps + 2):
        for name in names if step % 2 == 0 else names[::-1]:
            model, opt = models[name], opts[name]
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(batch).float().pow(2).mean().backward()
            opt.step()
            torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - t0], device=batch.device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= 2:
                times[name].append(float(took))
    return times


def _rank(rank: int, width: int, depth: int, steps: int) -> dict:
    dptrain.init(backend="nccl")
    device = dptrain.device()
    batch = torch.randn(64, width, device=device)
    out = {}
    ddp = {"ours": dptrain.DDP(_mlp(width, depth).to(device), device_ids=[device.index]),
           "torch": nn.parallel.DistributedDataParallel(_mlp(width, depth).to(device), device_ids=[device.index])}
    out["ddp"] = {k: statistics.median(v) for k, v in _time_steps(ddp, batch, steps).items()}
    del ddp
    from torch.distributed.fsdp import fully_shard

    from dptrain.parallel.fsdp import ParamCountPolicy

    peak = {}
    for name in ("ours", "fsdp2"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        if name == "ours":
            model = dptrain.FSDP(_mlp(width, depth), auto_wrap_policy=ParamCountPolicy(width * width // 2), device_id=device)
        else:
            model = _mlp(width, depth).to(device)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        t = _time_steps({name: model}, batch, steps)[name]
        peak[name] = (statistics.median(t), torch.cuda.max_memory_allocated(device) / 2**20)
        del model
    out["fsdp"] = peak
    dptrain.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    args = p.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 1:
        print("no CUDA device: nothing to measure")
        return
    res = dptrain.spawn(_rank, gpus, args=(args.width, args.depth, args.steps), timeout=1800)[0]
    print(f"{gpus} GPU(s) ({torch.cuda.get_device_name(0)}), MLP {args.depth}x{args.width}, batch 64/rank, AdamW, "
          f"{args.steps} alternating steps")
    print()
    print("| wrapper | median step (ms) | ours / theirs | peak memory (MiB) |")
    print("| --- | --- | --- | --- |")
    d = res["ddp"]
    print(f"| dptrain DDP | {1000 * d['ours']:.2f} | {d['ours'] / d['torch']:.3f} | |")
    print(f"| torch DDP | {1000 * d['torch']:.2f} | | |")
    f = res["fsdp"]
    print(f"| dptrain FSDP | {1000 * f['ours'][0]:.2f} | {f['ours'][0] / f['fsdp2'][0]:.3f} | {f['ours'][1]:.0f} |")
    print(f"| torch FSDP2 | {1000 * f['fsdp2'][0]:.2f} | | {f['fsdp2'][1]:.0f} |")


if __name__ == "__main__":
    main()
