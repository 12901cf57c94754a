"""Blood-brain-barrier penetration from SMILES strings: a bidirectional LSTM over
characters, trained on every rank by dptrain's Trainer (a molecular property workshop, distributed).

Data: a BBBP-format CSV (columns ``name``, ``p_np``, ``smiles``; e.g. MoleculeNet's
BBBP.csv) given with ``--data-path``. Without it the script uses a SYNTHETIC set of
generated molecules whose label follows a stated rule (see ``examples/_data.py``:
``p_np = 1`` when the molecule has at most 3 nitrogen + oxygen atoms) -- a stand-in to run
the program anywhere, not real chemistry.

The molecules are split once, stratified by label, into train / dev / held-out (seed
001's 10 % held-out, then 20 % of the rest as dev). The dev ROC AUC picks the best epoch;
the held-out ROC AUC of that model is computed over every rank's predictions, each
molecule counted exactly once (``dptrain.gather_results``). Rank 0 writes TensorBoard
scalars and the hparams table to ``--log_dir``.

Launch (paste-able)::

    dptrain run --nproc-per-node 2 examples/smiles_classifier.py
    dptrain run --nproc-per-node 2 examples/smiles_classifier.py --data-path dataset/BBBP.csv --num_epochs 20
    torchrun --standalone --nproc-per-node 2 examples/smiles_classifier.py
    tensorboard --logdir runs/smiles
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import dptrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import SYNTHETIC_RULE, read_bbbp_csv, stratified_split, synthetic_smiles  # noqa: E402
from _data import roc_auc as _roc_auc  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num_epochs", type=int, default=8, help="number of training epochs")
    p.add_argument("--batch_size", type=int, default=32, help="training batch size of one process")
    p.add_argument("--learning_rate", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--random_seed", type=int, default=0, help="seed of the split, the model and the shuffling")
    p.add_argument("--model_dir", default="runs/smiles", help="where checkpoints and the final model go")
    p.add_argument("--model_filename", default="smiles_lstm.pth", help="final model file (weights without 'module.')")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --model_dir")
    p.add_argument("--data-path", dest="data_path", default=None, help="BBBP-format CSV; default: synthetic molecules")
    p.add_argument("--num_molecules", type=int, default=1200, help="size of the synthetic set")
    p.add_argument("--embedding_dim", type=int, default=32)
    p.add_argument("--hidden_dim", type=int, default=48)
    p.add_argument("--num_layers", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--log_dir", default="runs/smiles/tb", help="TensorBoard directory ('' to disable)")
    p.add_argument("--strategy", default=None, choices=["ddp", "torch-ddp", "none"], help="default: ddp if > 1 rank")
    return p.parse_args(argv)


class CharTokenizer:
    """Characters of the training SMILES -> ids; 0 pads, 1 stands for characters never seen."""

    def __init__(self, smiles: list[str]) -> None:
        chars = sorted({c for s in smiles for c in s})
        self.vocab = {c: i + 2 for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.vocab) + 2

    def encode(self, smiles: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(smiles), max_len, dtype=torch.int64)
        lengths = torch.zeros(len(smiles), dtype=torch.int64)
        for row, s in enumerate(smiles):
            s = s[:max_len]
            ids[row, : len(s)] = torch.tensor([self.vocab.get(c, 1) for c in s], dtype=torch.int64)
            lengths[row] = max(len(s), 1)
        return ids, lengths


class SmilesDataset(torch.utils.data.Dataset):
    """Items are ``((token ids, length), label)``; the Trainer calls ``model(ids, lengths)``."""

    def __init__(self, ids: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids, self.lengths, self.labels = ids, lengths, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return (self.ids[i], self.lengths[i]), self.labels[i]


class RNNPredictor(nn.Module):
    """Embedding -> bidirectional LSTM (packed, so padding is never read) -> linear logit."""

    def __init__(self, vocab_size: int, embedding_dim: int, hidden_dim: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.lstm = nn.LSTM(
            embedding_dim, hidden_dim, num_layers=num_layers, bidirectional=True, batch_first=True,
            dropout=dropout if num_layers > 1 else 0.0,
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * hidden_dim, 1)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embedding(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        final = torch.cat([h[-2], h[-1]], dim=1)  # last layer, forward and backward directions
        return self.head(self.dropout(final)).squeeze(1)


def roc_auc(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    y = targets.cpu().numpy()
    p = torch.sigmoid(outputs).cpu().numpy()
    acc = float(((p > 0.5) == (y > 0.5)).mean())
    return {"roc_auc": _roc_auc(y, p), "accuracy": acc, "molecules": len(y)}


def main(argv=None) -> float:
    args = parse_args(argv)
    world = dptrain.init()

    if args.data_path:
        smiles, labels = read_bbbp_csv(args.data_path)
        source = args.data_path
    else:
        smiles, labels = synthetic_smiles(args.num_molecules, seed=args.random_seed)
        source = f"synthetic ({SYNTHETIC_RULE})"
    if dptrain.is_main_process():
        print(f"data: {len(smiles)} molecules, {sum(labels)} positive; {source}", flush=True)

    # The workshop's split (10 % held out, then 20 % of the rest as dev), stratified by label;
    # identical on every rank (same seed).
    idx = list(range(len(smiles)))
    visible, heldout = stratified_split(idx, labels, 0.1, args.random_seed)
    train_ix, dev_ix = stratified_split(visible, [labels[i] for i in visible], 0.2, args.random_seed)
    tokenizer = CharTokenizer([smiles[i] for i in train_ix])
    max_len = min(max(len(s) for s in smiles), 200)
    ids, lengths = tokenizer.encode(smiles, max_len)
    y = torch.tensor(labels, dtype=torch.float32)

    def subset(ix):
        ix = torch.tensor(ix)
        return SmilesDataset(ids[ix], lengths[ix], y[ix])

    dptrain.seed_everything(args.random_seed)
    hparams = dict(embedding_dim=args.embedding_dim, hidden_dim=args.hidden_dim, num_layers=args.num_layers,
                   dropout=args.dropout, learning_rate=args.learning_rate, weight_decay=1e-4, batch_size=args.batch_size)
    model = RNNPredictor(len(tokenizer), args.embedding_dim, args.hidden_dim, args.num_layers, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=1e-4)
    config = dptrain.TrainerConfig(
        strategy=args.strategy,
        checkpoint_dir=os.path.join(args.model_dir, "checkpoints"),
        keep_last=2,
        best_metric="roc_auc",
        best_mode="max",
        max_grad_norm=1.0,
        log_dir=args.log_dir or None,
    )
    trainer = dptrain.Trainer(
        model, optimizer,
        dptrain.prepare_dataloader(subset(train_ix), args.batch_size, seed=args.random_seed),
        nn.BCEWithLogitsLoss(), config,
        dev_data=dptrain.prepare_dataloader(subset(dev_ix), 128, mode="eval"),
        test_data=dptrain.prepare_dataloader(subset(heldout), 128, mode="eval"),
        metric_fn=roc_auc, resume="auto" if args.resume else None, hparams=hparams,
    )
    summary = trainer.fit(args.num_epochs)
    if dptrain.is_main_process():
        dptrain.checkpoint.save(trainer.best_state, os.path.join(args.model_dir, args.model_filename))
        best = summary["best"]
        print(f"best dev ROC AUC {best['value']:.4f} at epoch {best['epoch']}", flush=True)
        print(f"held-out ROC AUC: {summary['test']['roc_auc']:.4f} over {summary['test']['molecules']:.0f} molecules "
              f"(world size {world.world_size})", flush=True)
    dptrain.shutdown()
    return summary["test"]["roc_auc"]


if __name__ == "__main__":
    main()
