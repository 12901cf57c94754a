"""A Trainer job for in-place recovery tests, run under ``dptrain run --recovery in-place``.

Environment:
  OUT     a directory for what the ranks report (pids, kill markers, final weights, checkpoint reads)
  CKPT    checkpoint directory (unset: the job keeps no checkpoints at all)
  KILLS   ';'-separated kills "rank:generation:where:at": the process of that rank started for that
          generation (0: the job's own ranks; g: the replacement of generation g) SIGKILLs itself
          where = forward | all_reduce | optimizer | checkpoint | eval | stall | forget | sync  at optimizer step
          ``at`` (for eval: the epoch, counted from 1; stall: stops itself with SIGSTOP instead of dying;
          forget: dies in the forward after deleting its rank's step snapshots, so its replacement has none;
          sync: dies right after starting a DiLoCo outer exchange, its bytes perhaps half sent),
          or init: right after dptrain.init() (a replacement that dies while it joins), or after: once
          Trainer.fit has returned on this rank and on rank 0, or early: once it has returned on this rank
          (rank 0's may not have: see SLOW_FINISH)
  EPOCHS  epochs (default 2)
  FITS    ','-separated epoch counts: Trainer.fit to each in turn, in the one process (instead of EPOCHS)
  STRATEGY the Trainer's strategy (default: its own choice, "ddp")
  DILOCO  JSON of TrainerConfig(diloco_kwargs=...) for STRATEGY=diloco
  ACCUM, AMP, CLIP  gradient accumulation steps; bf16 autocast; clipping at norm 1 (default: none of them)
  WORKERS  the train loader's worker processes (default 0)
  SLOW    "rank:at:seconds": that rank's first process sleeps that long before the forward of each module,
          in its first forward of optimizer step ``at`` only, and writes how many of those sleeps it did
          to slow-rank<rank>.json once fit returns
  SLOW_FINISH "rank:seconds": that rank's first process sleeps that long at the end of its first fit, after
          the last step's collectives and before the fit says the training is over (recovery/finished)
  OWN_URG  set: the script handles SIGURG itself (dptrain then leaves that signal alone)
  STORM   a rank: its first process sends itself SIGURG (what dptrain run sends to stop a step) every
          millisecond while it trains
"""

import io
import json
import os
import signal
import sys
import threading
import time
import traceback

import torch
from torch import nn

import dptrain
from dptrain import Trainer, TrainerConfig, prepare_dataloader

OUT = os.environ["OUT"]
CKPT = os.environ.get("CKPT") or None
GEN = int(os.environ.get("DPTRAIN_GENERATION") or 0)


def note(name: str, **what) -> None:
    with open(os.path.join(OUT, name), "w") as fh:
        json.dump(what, fh)
        fh.flush()
        os.fsync(fh.fileno())


def die(trainer, where: str, **more) -> None:
    note(f"killed-rank{trainer.rank}-gen{GEN}.json", rank=trainer.rank, gen=GEN, where=where, pid=os.getpid(),
         step=trainer.global_step, stack=[f.name for f in traceback.extract_stack()], **more)
    if where == "forget":  # the step snapshots (DDP) or the round snapshots (DiLoCo) this rank wrote
        folder = os.environ["DPTRAIN_RECOVERY_DIR"]
        for name in os.listdir(folder):
            if name.startswith((f"rank{trainer.rank}.", f"round{trainer.rank}-")):
                os.remove(os.path.join(folder, name))
    os.kill(os.getpid(), signal.SIGSTOP if where == "stall" else signal.SIGKILL)


def bare(trainer):
    """The model without its DDP wrapper (DiLoCo's plain form trains the bare model)."""
    return getattr(trainer.model, "module", trainer.model)


def arm(trainer, where: str, at: int) -> None:
    if where in ("forward", "stall", "forget"):
        def pre(module, args):
            if module.training and trainer.global_step + 1 == at:
                die(trainer, where)
        bare(trainer).register_forward_pre_hook(pre)
    elif where == "all_reduce":
        from dptrain.parallel.ddp._reducer import Reducer

        real = Reducer._all_reduce

        def all_reduce(self, flat, index):
            work = real(self, flat, index)
            if trainer.global_step + 1 == at:
                die(trainer, where, bucket=index)
            return work
        Reducer._all_reduce = all_reduce
    elif where == "optimizer":
        def post(optimizer, args, kwargs):
            if trainer.global_step + 1 == at:
                die(trainer, where)
        trainer.optimizer.register_step_post_hook(post)
    elif where == "checkpoint":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            name = os.path.basename(getattr(f, "name", "") or "")
            if trainer.global_step == at and CKPT and ".tmp" in name and name.startswith(".ckpt-"):
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                die(trainer, where)
            return real_save(obj, f, *args, **kwargs)
        torch.save = save
    elif where == "eval":
        def pre(module, args):
            if not module.training and trainer.epoch + 1 == at:
                die(trainer, where)
        bare(trainer).register_forward_pre_hook(pre)
    elif where == "sync":
        diloco = trainer.strategy.diloco
        real_launch = diloco._launch

        def launch(f, apply_at):
            real_launch(f, apply_at)
            if trainer.global_step + 1 == at:  # inside optimizer step ``at`` (counted after DiLoCo's step)
                die(trainer, where, fragment=f)
        diloco._launch = launch
    else:
        raise SystemExit(f"unknown kill {where!r}")


def slow(trainer, rank: int):
    """SLOW: a forward of many slow modules, once; the list of the sleeps done (None: not this rank)."""
    if not os.environ.get("SLOW") or GEN:
        return None
    who, at, seconds = os.environ["SLOW"].split(":")
    if int(who) != rank:
        return None
    slept, entered = [], []

    def first(module, args):  # the model's own forward pre-hook, before any sleep: counts the attempts
        if module.training and trainer.global_step + 1 == int(at):
            entered.append(1)

    def pre(module, args):
        if module.training and trainer.global_step + 1 == int(at) and len(entered) == 1:
            slept.append(type(module).__name__)
            time.sleep(float(seconds))
    bare(trainer).register_forward_pre_hook(first)
    for module in bare(trainer).modules():
        module.register_forward_pre_hook(pre)
    return slept


def storm(rank: int) -> None:
    """STORM: SIGURG at this process every millisecond, from a thread, for the process's life."""
    if os.environ.get("STORM") != str(rank) or GEN:
        return

    def send():
        while True:
            os.kill(os.getpid(), signal.SIGURG)
            time.sleep(0.001)
    threading.Thread(target=send, daemon=True).start()


def watch_reads(rank: int) -> None:
    """Record every file torch.load reads inside the checkpoint directory (none may be read by a recovery)."""
    real = torch.load

    def load(f, *args, **kwargs):
        path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "?")
        if CKPT and str(path).startswith(os.path.abspath(CKPT)):
            with open(os.path.join(OUT, f"reads-rank{rank}-pid{os.getpid()}.txt"), "a") as fh:
                fh.write(f"{path}\n")
        return real(f, *args, **kwargs)
    torch.load = load


def main() -> None:
    import faulthandler
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a test that times out can ask where a rank is
    world = dptrain.init()
    note(f"start-rank{world.rank}-pid{os.getpid()}.json", rank=world.rank, pid=os.getpid(), gen=GEN)
    for spec in filter(None, os.environ.get("KILLS", "").split(";")):
        rank, gen, where, _ = spec.split(":")
        if where == "init" and int(rank) == world.rank and int(gen) == GEN:  # a replacement dies while it joins
            note(f"killed-rank{world.rank}-gen{GEN}.json", rank=world.rank, gen=GEN, where=where, pid=os.getpid(),
                 step=-1, stack=[])
            os.kill(os.getpid(), signal.SIGKILL)
    watch_reads(world.rank)
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16),
                          nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    dev = torch.utils.data.TensorDataset(torch.randn(30, 8, generator=g), torch.randint(0, 3, (30,), generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = TrainerConfig(checkpoint_dir=CKPT, save_every_steps=2 if CKPT else 0, keep_last=0, verbose=False,
                           strategy=os.environ.get("STRATEGY") or None,
                           gradient_accumulation_steps=int(os.environ.get("ACCUM") or 1),
                           amp=bool(os.environ.get("AMP")), amp_dtype="bfloat16",
                           max_grad_norm=1.0 if os.environ.get("CLIP") else None,
                           ddp_kwargs={} if os.environ.get("STRATEGY") == "diloco" else {"bucket_cap_mb": 0.001},
                           diloco_kwargs=json.loads(os.environ.get("DILOCO") or "{}"))
    # (ddp_kwargs: several buckets, so that a kill can land between them)
    trainer = Trainer(model, opt, prepare_dataloader(torch.utils.data.TensorDataset(x, y), 4, seed=3,
                                                        num_workers=int(os.environ.get("WORKERS") or 0)),
                      nn.CrossEntropyLoss(), config, dev_data=prepare_dataloader(dev, 8, mode="eval"),
                      scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    for spec in filter(None, os.environ.get("KILLS", "").split(";")):
        rank, gen, where, at = spec.split(":")
        if where not in ("init", "after", "early") and int(rank) == world.rank and int(gen) == GEN \
                and (GEN or not world.restart_count):
            arm(trainer, where, int(at))
    if os.environ.get("OWN_URG"):
        signal.signal(signal.SIGURG, lambda *args: None)
    slowed = slow(trainer, world.rank)
    if os.environ.get("SLOW_FINISH") and not GEN and not world.restart_count:
        who, seconds = os.environ["SLOW_FINISH"].split(":")
        if int(who) == world.rank:
            finish = trainer._recovery.finish
            trainer._recovery.finish = lambda: (time.sleep(float(seconds)), finish())[1]
    storm(world.rank)
    for epochs in os.environ.get("FITS", "").split(",") if os.environ.get("FITS") else [os.environ.get("EPOCHS", "2")]:
        summary = trainer.fit(int(epochs))  # FITS: one fit after the other, each to its number of epochs
    if slowed is not None:
        note(f"slow-rank{world.rank}.json", sleeps=len(slowed))
    for spec in filter(None, os.environ.get("KILLS", "").split(";")):
        rank, gen, where, _ = spec.split(":")
        if where == "after" and int(rank) == world.rank and int(gen) == GEN and not world.restart_count:
            # The case under test is a rank that fails once rank 0's fit has returned (and rank 0 may
            # be gone): wait until rank 0 has said so in the store, or this rank may die first and
            # its replacement meet a job that is finishing (a race of the two ranks' ends, not this case).
            from dptrain.runtime import env as _env, regroup as _regroup

            deadline = time.monotonic() + 60
            while not _env._STATE.store.check([_regroup.FINISHED]) and time.monotonic() < deadline:
                time.sleep(0.02)
            die(trainer, where)  # fit has returned on this rank and on rank 0
        if where == "early" and int(rank) == world.rank and int(gen) == GEN and not world.restart_count:
            die(trainer, where)  # fit has returned on this rank (rank 0's may be in SLOW_FINISH's sleep)
    state = {k: v.detach().clone() for k, v in bare(trainer).state_dict().items()}  # buffers too
    extra = {}
    if os.environ.get("STRATEGY") == "diloco":  # each rank's replica above; the replicas' common weights here
        extra["common"] = trainer.model_state_dict()
        rounds = getattr(trainer._recovery, "rounds", None)  # DiLoCo's round snapshots (in place only)
        extra["rounds"] = {"written": rounds.written, "write_s": rounds.write_s, "bytes": rounds.bytes} if rounds else None
    torch.save({"state": state, "pid": os.getpid(), "gen": GEN, "step": summary["global_step"], **extra,
                "history": [{k: v for k, v in h.items() if k not in ("time_s", "samples_per_s")}
                            for h in summary["history"]]},
               os.path.join(OUT, f"final-rank{world.rank}.pt"))
    print(f"rank {world.rank} done at step {summary['global_step']}", file=sys.stderr)
    dptrain.shutdown()


if __name__ == "__main__":
    main()
