"""Image classification with ResNet-18 on every rank, trained by dptrain's Trainer.

The classic CIFAR-10 DDP tutorial program, completed: the same flags, plus a dev split for
model selection, checkpoints that resume exactly, and a held-out test accuracy at the end.
With no ``--data-dir`` it trains on scikit-learn's bundled handwritten digits (1797 8x8
images, no download) and finishes in about a minute on two CPU cores.

Launch (paste-able)::

    # two processes on this machine (CPU or one GPU each)
    dptrain run --nproc-per-node 2 examples/image_classification.py
    python -m dptrain run --nproc-per-node 2 examples/image_classification.py --num_epochs 12

    # the same script under PyTorch's launcher
    torchrun --standalone --nproc-per-node 2 examples/image_classification.py

    # real CIFAR-10 (the "python version" batches, unpacked), standard width
    dptrain run --nproc-per-node 4 examples/image_classification.py \\
        --data-dir data/cifar-10-batches-py --width 64 --num_epochs 30 --batch_size 128

    # crash-proof: checkpoint every 20 steps, restart up to 3 times, resume automatically
    dptrain run --nproc-per-node 2 --max-restarts 3 examples/image_classification.py --save_every_steps 20

    # continue a finished or interrupted run from its newest checkpoint, here for 4 more epochs
    # (the one-cycle schedule is re-planned for 12 epochs and fast-forwarded to where it was)
    dptrain run --nproc-per-node 2 examples/image_classification.py --num_epochs 12 --resume

    # bf16 mixed precision (CPU autocast, or CUDA), and a per-rank report of where step time goes
    dptrain run --nproc-per-node 2 examples/image_classification.py --amp bf16
    dptrain run --profile --nproc-per-node 2 examples/image_classification.py

The last line printed is ``test accuracy: X`` (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import dptrain
from dptrain.models import ResNet18

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_cifar10, load_digits_split  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num_epochs", type=int, default=8, help="number of training epochs")
    p.add_argument("--batch_size", type=int, default=32, help="training batch size of one process")
    p.add_argument("--learning_rate", type=float, default=0.1, help="peak learning rate (SGD with momentum, one-cycle)")
    p.add_argument("--random_seed", type=int, default=0, help="seed of the model, the split and the shuffling")
    p.add_argument("--model_dir", default="runs/image_classification", help="where checkpoints and the final model go")
    p.add_argument("--model_filename", default="resnet_distributed.pth", help="final model file (weights without 'module.')")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --model_dir")
    p.add_argument("--data-dir", dest="data_dir", default=None, help="CIFAR-10 python batches; default: embedded digits")
    p.add_argument("--width", type=int, default=None, help="ResNet-18 width (default 16 for digits, 64 for CIFAR-10)")
    p.add_argument("--strategy", default=None, choices=["ddp", "fsdp", "torch-ddp", "none"], help="default: ddp if > 1 rank")
    p.add_argument("--save_every_steps", type=int, default=0, help="also checkpoint every N optimizer steps")
    p.add_argument("--log_dir", default=None, help="TensorBoard directory (rank 0 writes)")
    p.add_argument("--num_workers", type=int, default=0, help="DataLoader workers per process")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"],
                   help="mixed precision: bf16 (CPU or CUDA autocast) or fp16 (CUDA, with a gradient scaler)")
    p.add_argument("--compression", default=None, choices=["auto", "bf16", "fp16", "powersgd"],
                   help="gradient compression of dptrain's DDP, for slow links between nodes; 'auto' measures "
                        "and keeps it only where it pays (default: none)")
    return p.parse_args(argv)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"accuracy": (outputs.argmax(1) == targets).float().mean().item()}


def main(argv=None) -> float:
    args = parse_args(argv)
    world = dptrain.init()
    dptrain.seed_everything(args.random_seed)  # same initial model on every rank

    if args.data_dir:
        with dptrain.main_process_first():  # one rank reads first (and warms the page cache)
            train_set, dev_set, test_set = load_cifar10(args.data_dir, seed=args.random_seed)
        in_channels, width = 3, args.width or 64
    else:
        train_set, dev_set, test_set = load_digits_split(seed=args.random_seed)
        in_channels, width = 1, args.width or 16
    model = ResNet18(num_classes=10, in_channels=in_channels, width=width)

    train_loader = dptrain.prepare_dataloader(
        train_set, args.batch_size, shuffle=True, seed=args.random_seed, num_workers=args.num_workers
    )
    dev_loader = dptrain.prepare_dataloader(dev_set, 256, mode="eval")
    test_loader = dptrain.prepare_dataloader(test_set, 256, mode="eval")

    # Functions, not objects: the Trainer builds both on the parameters it trains, which under
    # --strategy fsdp are the sharded flat parameters that exist only after wrapping.
    def optimizer(params):
        return torch.optim.SGD(params, lr=args.learning_rate, momentum=0.9, weight_decay=5e-4, nesterov=True)

    # One-cycle schedule stepped every optimizer step: fast, stable convergence in few epochs.
    def scheduler(opt):
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=args.learning_rate, total_steps=args.num_epochs * len(train_loader), pct_start=0.25
        )
    config = dptrain.TrainerConfig(
        strategy=args.strategy,
        checkpoint_dir=os.path.join(args.model_dir, "checkpoints"),
        save_every=1,
        save_every_steps=args.save_every_steps,
        keep_last=2,
        best_metric="accuracy",
        best_mode="max",
        scheduler_interval="step",
        log_dir=args.log_dir,
        amp=args.amp != "none",
        amp_dtype="bfloat16" if args.amp == "bf16" else "float16",
        compression=args.compression,
        export_safetensors=os.path.join(args.model_dir, os.path.splitext(args.model_filename)[0] + ".safetensors"),
    )
    trainer = dptrain.Trainer(
        model, optimizer, train_loader, nn.CrossEntropyLoss(), config,
        dev_data=dev_loader, test_data=test_loader, scheduler=scheduler, metric_fn=accuracy,
        resume="auto" if args.resume else None,
        hparams={"width": width, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
                 "world_size": world.world_size, "data": "cifar10" if args.data_dir else "digits"},
    )
    summary = trainer.fit(args.num_epochs)

    if dptrain.is_main_process():
        # The best weights, loadable into a plain ResNet18 (no 'module.' prefix).
        dptrain.checkpoint.save(trainer.best_state, os.path.join(args.model_dir, args.model_filename))
    test_acc = summary["test"]["accuracy"]
    if dptrain.is_main_process():
        print(f"test accuracy: {test_acc:.4f}", flush=True)
    dptrain.shutdown()
    return test_acc


if __name__ == "__main__":
    main()
