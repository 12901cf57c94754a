"""The six steps of a data-parallel training script, with dptrain's parts and no Trainer.

The shortest complete data-parallel script: every step is a line or two.

    dptrain run --nproc-per-node 2 examples/six_steps.py
    torchrun --standalone --nproc-per-node 2 examples/six_steps.py
    python examples/six_steps.py        # one process: the same code, no process group
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain


def make_dataset(n: int, seed: int) -> TensorDataset:
    # Two Gaussian blobs in 16 dimensions; the same on every rank (same seed).
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 16, generator=g) + 0.4 * (2 * y[:, None] - 1).float()
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num_epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=0.05)
    p.add_argument("--random_seed", type=int, default=0)
    p.add_argument("--model_dir", default="runs/six_steps")
    p.add_argument("--model_filename", default="model.pt")
    p.add_argument("--resume", action="store_true", help="continue from the saved model, optimizer and epoch")
    args = p.parse_args()
    path = os.path.join(args.model_dir, args.model_filename)

    # 1. Set up the process group (from dptrain run / torchrun / srun; none when alone).
    world = dptrain.init()
    device = dptrain.device()
    dptrain.seed_everything(args.random_seed)

    # 2. Split the data: each rank reads its own shard of every epoch.
    train_set, test_set = make_dataset(2000, seed=1), make_dataset(501, seed=2)
    sampler = dptrain.DistributedSampler(train_set, shuffle=True, seed=args.random_seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    # 3. Wrap the model with DDP: same initial weights everywhere, gradients averaged.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    ddp_model = dptrain.DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # 4. Train exactly as on one device.
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.learning_rate, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    start = 0
    if args.resume:  # every rank reads the file onto its own device; never unpickles code
        state = dptrain.checkpoint.load(path, map_location=device)
        dptrain.checkpoint.load_model_state(ddp_model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, args.num_epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp_model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        if dptrain.is_main_process():  # one writer, atomic, weights without "module."
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            dptrain.checkpoint.save(state, path)
            print(f"epoch {epoch + 1}: last batch loss {loss.item():.4f}", flush=True)

    # 6. Gather results: each rank predicts its uneven shard (no padding, no repeats)...
    eval_sampler = dptrain.DistributedSampler(test_set, shuffle=False, pad=False)
    indices = list(eval_sampler)
    model.eval()
    with torch.no_grad():
        x, y = test_set[indices]
        correct = (model(x.to(device)).argmax(1) == y.to(device)).float()
    # ...and every sample's result comes back exactly once, in dataset order.
    every = dptrain.gather_results(correct, torch.tensor(indices))
    if dptrain.is_main_process():
        print(f"test accuracy over {every.numel()} samples on {world.world_size} ranks: {every.mean().item():.4f}")

    # 5. Clean up the process group.
    dptrain.shutdown()


if __name__ == "__main__":
    main()
