"""The ToyModel of PyTorch's DDP tutorial, trained with dptrain's DDP (seed 004's form).

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

import torch
from torch import nn

import dptrain
from dptrain.models import ToyModel


def demo_basic(rank: int, steps: int, learning_rate: float, seed: int) -> dict:
    """One rank: join the job, train the ToyModel for ``steps`` steps, return a summary."""
    world = dptrain.init()
    print(f"Running basic DDP example on rank {world.rank} of {world.world_size}.", flush=True)
    dptrain.seed_everything(seed)
    device = dptrain.device()
    model = ToyModel().to(device)
    ddp_model = dptrain.DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=learning_rate)

    g = torch.Generator().manual_seed(seed + 1000 * (world.rank + 1))  # each rank its own data
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=g).to(device))
        labels = torch.randn(20, 5, generator=g).to(device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()

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
    p.add_argument("--num_steps", type=int, default=20)
    p.add_argument("--learning_rate", type=float, default=0.001)
    p.add_argument("--random_seed", type=int, default=0)
    args = p.parse_args(argv)
    work = (args.num_steps, args.learning_rate, args.random_seed)
    world = dptrain.get_world()  # what the environment says, before joining
    if world.world_size > 1:
        demo_basic(world.rank, *work)  # started by dptrain run / torchrun: this process is one rank
    else:
        results = dptrain.spawn(demo_basic, nprocs=args.nprocs, args=work)
        print(f"spawned {len(results)} ranks; checksums {[round(r['checksum'], 6) for r in results]}", flush=True)


if __name__ == "__main__":
    main()
