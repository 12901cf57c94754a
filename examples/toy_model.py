"""The ToyModel of PyTorch's DDP tutorial, trained with dptrain's DDP (the tutorial's spawn form).

Run as a plain script, it starts its own ranks with ``dptrain.spawn`` (the in-process
launcher, shaped like ``torch.multiprocessing.spawn``). Run under a launcher, each process
is already one rank and trains directly -- so the same file works both ways::

    python examples/toy_model.py --nprocs 2                       # spawns 2 ranks itself
    dptrain run --nproc-per-node 2 examples/toy_model.py          # the launcher starts them
    torchrun --standalone --nproc-per-node 2 examples/toy_model.py

Every rank draws different inputs; DDP averages the gradients, so the replicas stay equal,
which the script checks at the end (``replicas identical: True``).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import dptrain
from dptrain.models import ToyModel


def demo_basic(rank: int, args: argparse.Namespace) -> dict:
    """One rank: join the job, train the ToyModel, save it from rank 0, return a summary."""
    world = dptrain.init()
    print(f"Running basic DDP example on rank {world.rank} of {world.world_size}.", flush=True)
    dptrain.seed_everything(args.random_seed)
    device = dptrain.device()
    model = ToyModel().to(device)
    path = os.path.join(args.model_dir, args.model_filename)
    if args.resume:  # every rank loads, mapped to its own device; DDP then starts from these weights
        dptrain.checkpoint.load_model_state(model, dptrain.checkpoint.load(path, map_location=device))
    ddp_model = dptrain.DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.learning_rate)

    g = torch.Generator().manual_seed(args.random_seed + 1000 * (world.rank + 1))  # each rank its own data
    for _ in range(args.num_epochs * args.steps_per_epoch):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(args.batch_size, 10, generator=g).to(device))
        labels = torch.randn(args.batch_size, 5, generator=g).to(device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
    if world.rank == 0:  # one writer; weights without the "module." prefix
        dptrain.checkpoint.save(model.state_dict(), path)

    # Every rank's parameters, compared on every rank: DDP keeps the replicas equal.
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    everyone = dptrain.comm.all_gather_object(flat)
    identical = all(torch.equal(flat, other) for other in everyone)
    result = {"rank": world.rank, "loss": loss.item(), "identical": identical, "checksum": float(flat.double().sum())}
    if world.rank == 0:
        print(f"final loss on rank 0: {result['loss']:.4f}; replicas identical: {identical}", flush=True)
    dptrain.shutdown()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="ToyModel trained with dptrain's DDP")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not started by a launcher")
    p.add_argument("--num_epochs", type=int, default=5)
    p.add_argument("--steps_per_epoch", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=20, help="samples per step on each rank")
    p.add_argument("--learning_rate", type=float, default=0.001)
    p.add_argument("--random_seed", type=int, default=0)
    p.add_argument("--model_dir", default="runs/toy_model")
    p.add_argument("--model_filename", default="toy_model.pt")
    p.add_argument("--resume", action="store_true", help="start from the saved model")
    args = p.parse_args(argv)
    os.makedirs(args.model_dir, exist_ok=True)  # before any rank starts: no race between ranks
    world = dptrain.get_world()  # what the environment says, before joining
    if world.source != "single":
        # Started by dptrain run / torchrun / srun (even with one process): this process is one
        # rank of the launcher's world, never a launcher itself.
        demo_basic(world.rank, args)
    else:
        results = dptrain.spawn(demo_basic, nprocs=args.nprocs, args=(args,))
        print(f"spawned {len(results)} ranks; checksums {[round(r['checksum'], 6) for r in results]}", flush=True)


if __name__ == "__main__":
    main()
