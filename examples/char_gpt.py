"""A small GPT trained on a character stream: how language models are trained now, data-parallel.

A decoder-only transformer (``dptrain.models.GPT``, which computes its own loss, as Hugging Face
models do) learns generated short stories one byte at a time. The text is read as a *stream*
(an ``IterableDataset`` without ``__len__``, split among the ranks and loader workers by dptrain,
resumable mid-epoch), trained for a budget of optimizer steps with AdamW, linear warmup and
cosine decay, bf16 autocast on CPU, evaluated and checkpointed every k steps. The settings come
from dataclasses, a YAML file and command-line overrides; a tracker is one flag away. The guide:
docs/language-models.md.

    dptrain run --nproc-per-node 2 examples/char_gpt.py
    dptrain run --nproc-per-node 2 examples/char_gpt.py --config examples/char_gpt.yaml --trainer.max_steps 400
    torchrun --standalone --nproc-per-node 2 examples/char_gpt.py --trainer.max_steps 100
    dptrain run --recovery in-place --max-restarts 3 --nproc-per-node 2 examples/char_gpt.py
    dptrain run --nproc-per-node 2 examples/char_gpt.py --trainer.loggers csv      # or wandb, mlflow
    python examples/char_gpt.py --help                                            # every setting
    python examples/char_gpt.py --trainer.max_steps 50                            # one process
    dptrain run --nproc-per-node 2 examples/char_gpt.py --num_epochs 1 --batch_size 16 --model_dir runs/gpt

The examples' common flags (``--num_epochs --batch_size --learning_rate --random_seed --model_dir
--model_filename --resume``) are taken too: ``--num_epochs`` trains whole epochs instead of a step
budget (no cosine schedule then), ``--model_dir`` is the checkpoint directory.

The last lines printed are the validation loss and a sample of generated text. Run it again
with the same ``--trainer.checkpoint_dir`` and ``--trainer.resume auto`` (or under
``--max-restarts``) and it continues where it stopped; with a larger ``--trainer.max_steps`` it
continues the cosine schedule planned for the new length.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from typing import Iterator

import torch
from torch.utils.data import IterableDataset

import dptrain
from dptrain.models import GPT
from dptrain.train import Trainer, TrainerConfig, parse_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import tiny_stories  # noqa: E402  (examples/_data.py)


class CharStream(IterableDataset):
    """Windows of ``block_size + 1`` bytes of a text, streamed: ``{"input_ids", "labels"}`` per sample.

    Sample ``i`` of an epoch is the ``i``-th window in an order shuffled per epoch (``set_epoch``).
    It follows dptrain's stream protocol (see ``dptrain.data.stream``): ``shard(num_shards, index)``
    gives a part that reads nothing of the others, and ``iter_from(start)`` seeks, so a resumed
    run starts each reader where it stopped instead of reading the epoch again.
    """

    def __init__(self, text: bytes, block_size: int, seed: int = 0, num_shards: int = 64,
                 part: tuple[int, int] = (0, 1)) -> None:
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.block_size, self.seed, self.num_shards, self.part = block_size, seed, num_shards, part
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shard(self, num_shards: int, index: int) -> "CharStream":
        part = copy.copy(self)  # the same text (not copied), this part's windows only
        part.part = (index, num_shards)
        return part

    def _order(self) -> torch.Tensor:
        windows = (len(self.data) - 1) // self.block_size
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        index, parts = self.part
        return torch.randperm(windows, generator=g)[index::parts]  # this part's windows, this epoch

    def iter_from(self, start: int) -> Iterator[dict[str, torch.Tensor]]:
        for w in self._order()[start:].tolist():
            chunk = self.data[w * self.block_size: w * self.block_size + self.block_size + 1].long()
            yield {"input_ids": chunk[:-1], "labels": chunk[1:]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.iter_from(0)


@dataclasses.dataclass
class ModelArgs:
    """The GPT's shape."""

    depth: int = 4
    """transformer blocks"""
    dim: int = 128
    """model width"""
    heads: int = 4
    """attention heads"""
    block_size: int = 64
    """context length in characters"""
    dropout: float = 0.0
    """dropout in the blocks"""


@dataclasses.dataclass
class DataArgs:
    """The text and how it is read."""

    text: str | None = None
    """a UTF-8 text file to train on; default: generated stories (the same on every machine)"""
    num_stories: int = 4000
    """how many stories to generate when no text file is given"""
    valid_fraction: float = 0.05
    """the share of the text held out for validation"""
    batch_size: int = 32
    """sequences per rank per step"""
    num_workers: int = 0
    """loader workers per rank"""
    seed: int = 0
    """the shuffle of the windows"""


@dataclasses.dataclass
class OptimArgs:
    """AdamW."""

    lr: float = 3e-3
    """peak learning rate (after warmup)"""
    weight_decay: float = 0.1
    """decoupled weight decay on the matrices"""
    beta2: float = 0.99
    """AdamW's second-moment decay"""


@dataclasses.dataclass
class RunArgs:
    """What the script does around fit()."""

    resume: str = "auto"
    """'auto': continue from the newest checkpoint when there is one; 'never': start fresh"""
    sample_chars: int = 200
    """characters generated at the end (0: none)"""
    model_filename: str = "char_gpt.pt"
    """the final weights, written into the checkpoint directory by rank 0"""


# The reference notes' flags, which every example takes, as this script's settings.
SEED_FLAGS = {"--num_epochs": ["--trainer.max_epochs", "{}", "--trainer.max_steps", "null", "--trainer.lr_schedule",
                               "null", "--trainer.eval_every_steps", "0"],
              "--batch_size": ["--data.batch_size", "{}"], "--learning_rate": ["--optim.lr", "{}"],
              "--random_seed": ["--data.seed", "{}"], "--model_dir": ["--trainer.checkpoint_dir", "{}"],
              "--model_filename": ["--run.model_filename", "{}"], "--resume": ["--run.resume", "auto"]}


def translate_seed_flags(argv: list[str]) -> list[str]:
    """``--num_epochs 2 --batch_size 16 ...`` (the examples' common flags) in this script's terms."""
    out, i = [], 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        if flag not in SEED_FLAGS:
            out.append(argv[i])
            i += 1
            continue
        takes = any("{}" in part for part in SEED_FLAGS[flag])
        value = inline or (argv[i + 1] if takes and not inline and i + 1 < len(argv) else "")
        out += [part.format(value) for part in SEED_FLAGS[flag]]
        i += 1 + (1 if takes and not inline else 0)
    return out


DEFAULTS = TrainerConfig(
    max_steps=300, lr_schedule="cosine", warmup_steps=30, min_lr_ratio=0.1, amp=True, amp_dtype="bfloat16",
    max_grad_norm=1.0, eval_every_steps=100, checkpoint_dir="runs/char_gpt", save_every_steps=100, keep_last=2,
    log_every_steps=10, nan_policy="stop",
)


def load_text(args: DataArgs) -> bytes:
    if args.text:
        with open(args.text, "rb") as fh:
            return fh.read()
    return tiny_stories(args.num_stories, seed=1234).encode()


def make_optimizer(model: torch.nn.Module, args: OptimArgs) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not on biases, norms and embeddings' positions), as nanoGPT does.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2))


@torch.no_grad()
def generate(model: GPT, prompt: bytes, num_chars: int, seed: int = 0) -> str:
    """Sample ``num_chars`` bytes after ``prompt`` (temperature 0.8), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    model.eval()
    for _ in range(num_chars):
        logits = model(ids[:, -model.max_len:]).logits[0, -1].float() / 0.8
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        ids = torch.cat([ids, nxt[None]], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def main() -> None:
    cfg = parse_config(trainer=DEFAULTS, model=ModelArgs, data=DataArgs, optim=OptimArgs, run=RunArgs,
                       args=translate_seed_flags(sys.argv[1:]), description=__doc__.split("\n\n")[0])
    dptrain.init()
    dptrain.seed_everything(cfg.data.seed)

    text = load_text(cfg.data)
    cut = int(len(text) * (1 - cfg.data.valid_fraction))
    train = CharStream(text[:cut], cfg.model.block_size, seed=cfg.data.seed)
    valid = CharStream(text[cut:], cfg.model.block_size, seed=cfg.data.seed, num_shards=8)
    model = GPT(vocab=256, dim=cfg.model.dim, depth=cfg.model.depth, heads=cfg.model.heads,
                max_len=cfg.model.block_size, dropout=cfg.model.dropout)
    trainer = Trainer(
        model, make_optimizer(model, cfg.optim),
        dptrain.prepare_dataloader(train, cfg.data.batch_size, num_workers=cfg.data.num_workers,
                                   uneven=cfg.trainer.uneven, seed=cfg.data.seed),
        config=cfg.trainer,   # loss_fn=None: the GPT returns its own loss
        dev_data=dptrain.prepare_dataloader(valid, 2 * cfg.data.batch_size),
        resume=cfg.run.resume == "auto",
    )
    summary = trainer.fit()
    weights = trainer.model_state_dict(rank0_only=True)  # collective under FSDP; {} on the other ranks there
    if dptrain.is_main_process():
        params = sum(p.numel() for p in model.parameters())
        best = summary["best"]
        print(f"{params / 1e6:.2f}M parameters, {summary['global_step']} steps"
              + (f", best validation loss {best['value']:.4f} at step {trainer.best_step}" if best else ""))
        if cfg.trainer.checkpoint_dir:
            path = os.path.join(cfg.trainer.checkpoint_dir, cfg.run.model_filename)
            dptrain.checkpoint.save(weights, path)
            print(f"final weights: {path}")
        if cfg.run.sample_chars:
            net = trainer.strategy.eval_module(trainer.model)
            print("sample: " + repr(generate(net, b"Ada had a", cfg.run.sample_chars)))
    dptrain.shutdown()


if __name__ == "__main__":
    main()
