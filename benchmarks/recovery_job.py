"""The Trainer job of ``benchmarks/recovery.py``: an MLP on random data, checkpoints every K steps.

Runs under ``torchrun``, ``dptrain run`` (either recovery mode) or alone. Each process writes a
line-buffered log ``OUT/proc-rank<r>-pid<pid>.log`` (one ``write`` per line, so a SIGKILLed
process loses nothing it logged):

    start {"rank": r, "pid": p, "gen": g, "restart": n, "t0": <time.time() at the first line>, ...}
    init <time.time()>              dptrain.init() returned
    step <global_step> <time.time()> after every optimizer step (on_step_end)
    read <path> <bytes>             every torch.load of a file (size at the time of the read)
    resumed <path or -> <step>      what the Trainer resumed from (before fit)
    fit <time.time()>               fit started (on_fit_start; a replacement: after it joined, if the Trainer calls it)
    kill <phase> <step> <time.time()>  just before the process SIGKILLs itself
    done <time.time()>              fit returned and the final weights were saved

and, at the end, ``OUT/final-rank<r>.pt`` (the model's state_dict on that rank).

``--kill RANK:PHASE:STEP``: the first process of that rank (DPTRAIN_GENERATION and
TORCHELASTIC_RESTART_COUNT both 0: not a restarted job, not an in-place replacement) SIGKILLs
itself during optimizer step STEP (counted from 1), at PHASE:
  forward     before the model's forward of that step
  all_reduce  right after DDP started the all-reduce of a gradient bucket (the others are in it)
  optimizer   right after optimizer.step() of that step, before the Trainer finished the step
"""

import time

T0 = time.time()  # before torch is imported: the process start, as near as a script can see it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import dptrain  # noqa: E402
from dptrain.train import Callback  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--steps", type=int, default=40, help="optimizer steps per epoch")
p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
p.add_argument("--width", type=int, default=1024)
p.add_argument("--depth", type=int, default=3, help="hidden layers of --width")
p.add_argument("--kill", default="", help="RANK:PHASE:STEP")
p.add_argument("--ballast-mb", type=int, default=0,
               help="MiB a rank's first process holds (written, so resident) besides the model: a larger process "
                    "takes the kernel longer to end when it is killed (a replacement holds none, to start as fast)")
args = p.parse_args()

GEN = int(os.environ.get("DPTRAIN_GENERATION") or 0)
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
torch.set_num_threads(1)
BALLAST = torch.ones(args.ballast_mb * 2**18) if args.ballast_mb and not GEN and not RESTART else None

os.makedirs(args.out, exist_ok=True)
_rank_env = int(os.environ.get("RANK", "0"))
LOG = open(os.path.join(args.out, f"proc-rank{_rank_env}-pid{os.getpid()}.log"), "a", buffering=1)


def log(line: str) -> None:
    LOG.write(line + "\n")


log("start " + json.dumps({"rank": _rank_env, "pid": os.getpid(), "gen": GEN, "restart": RESTART, "t0": T0,
                           "recovery": os.environ.get("DPTRAIN_RECOVERY", "")}))

_real_load = torch.load


def _load(f, *a, **kw):
    """Every torch.load of a file: its path and size (the benchmark sums those under the checkpoint dir)."""
    try:
        if isinstance(f, (str, os.PathLike)):
            path, size = os.path.abspath(os.fspath(f)), os.path.getsize(f)
        else:  # a file object; dptrain opens checkpoints by descriptor, so its name may be a number
            fd = f.fileno()
            path, size = os.path.realpath(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size
        log(f"read {path} {size}")
    except Exception:  # noqa: BLE001 - a buffer, not a file: nothing to count
        pass
    return _real_load(f, *a, **kw)


torch.load = _load

world = dptrain.init()
log(f"init {time.time()}")
dptrain.seed_everything(0)
g = torch.Generator().manual_seed(7)
n = args.steps * args.batch * world.world_size
IN, CLASSES = 256, 10
data = torch.utils.data.TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
loader = dptrain.prepare_dataloader(data, batch_size=args.batch, shuffle=True, seed=3)
layers, width = [nn.Linear(IN, args.width), nn.ReLU()], args.width
for _ in range(args.depth - 1):
    layers += [nn.Linear(width, width), nn.ReLU()]
layers += [nn.Dropout(0.1), nn.Linear(width, CLASSES)]  # dropout: the RNG state must be restored too
model = nn.Sequential(*layers)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class StepLog(Callback):
    def on_fit_start(self, trainer):
        log(f"fit {time.time()}")

    def on_step_end(self, trainer, step):
        log(f"step {trainer.global_step} {time.time()}")


config = dptrain.TrainerConfig(checkpoint_dir=args.ckpt, save_every_steps=args.every, keep_last=2,
                               verbose=False, progress=False)
trainer = dptrain.Trainer(model, opt, loader, nn.CrossEntropyLoss(), config, callbacks=[StepLog()])
log(f"resumed {trainer.resumed_from or '-'} {trainer.global_step}")


def die(phase: str) -> None:
    log(f"kill {phase} {trainer.global_step + 1} {time.time()}")
    os.kill(os.getpid(), signal.SIGKILL)


if args.kill and GEN == 0 and RESTART == 0:
    k_rank, phase, at = args.kill.split(":")
    at = int(at)
    if int(k_rank) == world.rank:
        if phase == "forward":
            def pre(module, inputs):
                if module.training and trainer.global_step + 1 == at:
                    die(phase)
            (trainer.model.module if hasattr(trainer.model, "module") else trainer.model).register_forward_pre_hook(pre)
        elif phase == "all_reduce":
            from dptrain.parallel.ddp._reducer import Reducer

            real_all_reduce = Reducer._all_reduce

            def all_reduce(self, flat, index):
                work = real_all_reduce(self, flat, index)
                if trainer.global_step + 1 == at:
                    die(phase)
                return work
            Reducer._all_reduce = all_reduce
        elif phase == "optimizer":
            def post(optimizer, a, kw):
                if trainer.global_step + 1 == at:
                    die(phase)
            trainer.optimizer.register_step_post_hook(post)
        else:
            raise SystemExit(f"--kill: unknown phase {phase!r} (forward, all_reduce, optimizer)")

trainer.fit(args.epochs)
weights = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
torch.save({k: v.detach().clone() for k, v in weights.state_dict().items()},
           os.path.join(args.out, f"final-rank{world.rank}.pt"))
log(f"done {time.time()}")
dptrain.shutdown()
