"""A plain training loop made recoverable with dptrain.RecoverableLoop (in-place recovery tests).

Environment: OUT (a directory for pids, kill markers and final weights) and KILLS, as in
train_inplace.py ("rank:generation:where:at", where = forward | all_reduce | optimizer, at the
optimizer step ``at`` counted from 1).
"""

import json
import os
import signal
import sys

import torch
from torch import nn

import dptrain

OUT = os.environ["OUT"]
GEN = int(os.environ.get("DPTRAIN_GENERATION") or 0)


def main() -> None:
    world = dptrain.init()
    with open(os.path.join(OUT, f"start-rank{world.rank}-pid{os.getpid()}.json"), "w") as fh:
        json.dump({"rank": world.rank, "pid": os.getpid(), "gen": GEN}, fh)
    dptrain.seed_everything(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    model = dptrain.DDP(net, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    loader = dptrain.prepare_dataloader(data, 4, seed=3)
    loop = dptrain.RecoverableLoop(model, opt, loader, scheduler=sched)

    def die(where):
        with open(os.path.join(OUT, f"killed-rank{world.rank}-gen{GEN}.json"), "w") as fh:
            json.dump({"rank": world.rank, "gen": GEN, "where": where, "pid": os.getpid(), "stack": []}, fh)
        os.kill(os.getpid(), signal.SIGKILL)

    for spec in filter(None, os.environ.get("KILLS", "").split(";")):
        rank, gen, where, at = spec.split(":")
        if int(rank) != world.rank or int(gen) != GEN:
            continue
        at = int(at)
        if where == "forward":
            net.register_forward_pre_hook(lambda m, a, at=at: die("forward") if loop.global_step + 1 == at else None)
        elif where == "optimizer":
            opt.register_step_post_hook(lambda o, a, k, at=at: die("optimizer") if loop.global_step + 1 == at else None)
        elif where == "all_reduce":
            from dptrain.parallel.ddp._reducer import Reducer

            real = Reducer._all_reduce

            def all_reduce(self, flat, index, at=at):
                work = real(self, flat, index)
                if loop.global_step + 1 == at:
                    die("all_reduce")
                return work
            Reducer._all_reduce = all_reduce

    loss_fn = nn.CrossEntropyLoss()
    for epoch in loop.epochs(2):
        model.train()
        for inputs, targets in loop.batches():
            with loop.step():
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                opt.step()
                opt.zero_grad()
        sched.step()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state": state, "pid": os.getpid(), "gen": GEN, "step": loop.global_step, "history": []},
               os.path.join(OUT, f"final-rank{world.rank}.pt"))
    print(f"rank {world.rank} done at step {loop.global_step}", file=sys.stderr)
    dptrain.shutdown()


if __name__ == "__main__":
    main()
