"""Data sets for the examples, with no download: loaders for the real files when you have
them, and small embedded stand-ins when you do not.

- :func:`load_digits_split` -- scikit-learn's bundled handwritten digits (1797 images, 8x8,
  10 classes), split into train / dev / held-out test (:func:`stratified_split`), read
  without importing scikit-learn.
- :func:`roc_auc` -- the area under the ROC curve, for the SMILES classifier.
- :func:`load_cifar10` -- the real CIFAR-10 "python version" batches
  (``data_batch_1`` .. ``data_batch_5``, ``test_batch``), read with a restricted unpickler.
- :func:`read_bbbp_csv` -- a BBBP-format CSV (columns ``name``, ``p_np``, ``smiles``).
- :func:`synthetic_smiles` -- generated SMILES with a label from a stated chemical rule.

Every rank calls these with the same seed and gets the same split, so no rank has to
send data to another.
"""

from __future__ import annotations

import csv
import os
import pickle
import random
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import TensorDataset

# ----------------------------------------------------------------------------- digits --


def _digits_file() -> str:
    """Where scikit-learn keeps its bundled digits (``sklearn/datasets/data/digits.csv.gz``),
    found without importing scikit-learn: the import costs each rank 1-2 s of CPU, more than
    a short run's training on this data."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        "the embedded digits come with scikit-learn, which is not installed here: "
        "pip install scikit-learn (or pip install 'dptrain[examples]'), or train on CIFAR-10 files with --data-dir"
    )


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as (images (1797, 8, 8) float32 with values 0..16, labels (1797,) int64)."""
    table = np.loadtxt(_digits_file(), delimiter=",", dtype=np.float32)  # 64 pixels, then the label
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def stratified_split(indices: Sequence[int], labels: Sequence[int], test_fraction: float,
                     seed: int) -> tuple[list[int], list[int]]:
    """Split ``indices`` into (rest, test), shuffled by ``seed``, each label in both parts in
    about its overall proportion. ``test`` holds ceil(test_fraction * n) of the n indices (as
    scikit-learn's ``train_test_split`` sizes it); ``labels[k]`` is the label of ``indices[k]``.
    The same on every rank for the same arguments.
    """
    indices, labels = np.asarray(indices), np.asarray(labels)
    n = len(indices)
    n_test = int(np.ceil(test_fraction * n))
    if not 0 < n_test < n:
        raise ValueError(f"test_fraction={test_fraction} leaves no sample on one side of {n}")
    classes, counts = np.unique(labels, return_counts=True)
    # Each class's share of the test part, rounded down; what rounding left goes one each to
    # the classes with the largest remainders (the first such class first).
    exact = counts * n_test / n
    take = np.floor(exact).astype(np.int64)
    for k in np.argsort(-(exact - take), kind="stable")[: n_test - int(take.sum())]:
        take[k] += 1
    rng = np.random.RandomState(seed)
    rest, test = [], []
    for c, t in zip(classes, take):
        members = indices[labels == c]
        members = members[rng.permutation(len(members))]
        test.extend(members[:t].tolist())
        rest.extend(members[t:].tolist())
    return [rest[i] for i in rng.permutation(len(rest))], [test[i] for i in rng.permutation(len(test))]


def roc_auc(labels: Sequence[float], scores: Sequence[float]) -> float:
    """Area under the ROC curve of ``scores`` for the binary ``labels`` (0/1): the chance that a
    random positive scores above a random negative, ties counted half (Mann-Whitney U). NaN
    when one class is missing."""
    labels, scores = np.asarray(labels, dtype=np.float64) > 0.5, np.asarray(scores, dtype=np.float64)
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + b + 1) / 2.0
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def load_digits_split(seed: int, test_fraction: float = 0.2, dev_fraction: float = 0.1):
    """scikit-learn's 8x8 digits as (train, dev, test) TensorDatasets of (1x8x8 float image, label).

    The split is stratified and depends only on ``seed``. Pixels (0..16) are scaled to
    mean 0 and standard deviation 1 with the training set's statistics.
    """
    x, y = load_digits()
    rest, test = stratified_split(np.arange(len(y)), y, test_fraction, seed)
    train, dev = stratified_split(rest, y[rest], dev_fraction, seed)
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std

    def subset(ix):
        return TensorDataset(torch.from_numpy(x[ix]).unsqueeze(1), torch.from_numpy(y[ix]))

    return subset(train), subset(dev), subset(test)


# ---------------------------------------------------------------------------- CIFAR-10 --

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles CIFAR's batch dicts (bytes, lists, numpy arrays) and nothing else."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch file")


def _read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as fh:
        batch = _ArrayUnpickler(fh, encoding="bytes").load()
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path} is not a CIFAR-10 python batch (no 'data'/'labels' entries)")
    data = np.asarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' has shape {data.shape}, expected (N, 3072)")
    return data.reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.int64)


def load_cifar10(data_dir: str, seed: int, dev_fraction: float = 0.1):
    """Read CIFAR-10's python batches into (train, dev, test) TensorDatasets.

    Args:
        data_dir: the folder holding ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``
            (``cifar-10-batches-py`` from https://www.cs.toronto.edu/~kriz/cifar.html), or
            its parent. Missing training batches are skipped (at least one is needed).
        seed: selects the dev split carved out of the training batches.
        dev_fraction: share of the training images used as dev set.

    Raises:
        FileNotFoundError: no training batch or no ``test_batch`` in ``data_dir``.
    """
    if os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py")):
        data_dir = os.path.join(data_dir, "cifar-10-batches-py")
    train_files = [os.path.join(data_dir, f"data_batch_{i}") for i in range(1, 6)]
    train_files = [f for f in train_files if os.path.exists(f)]
    test_file = os.path.join(data_dir, "test_batch")
    if not train_files or not os.path.exists(test_file):
        raise FileNotFoundError(
            f"{data_dir!r} holds no CIFAR-10 python batches (data_batch_1..5 and test_batch); download "
            f"cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and unpack it there"
        )
    parts = [_read_cifar_batch(f) for f in train_files]
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = _read_cifar_batch(test_file)
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)

    def to_tensor(x: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(x).float() / 255.0 - mean) / std

    perm = np.random.RandomState(seed).permutation(len(y_train))
    n_dev = int(round(dev_fraction * len(y_train)))
    dev, train = perm[:n_dev], perm[n_dev:]
    xt, yt = to_tensor(x_train), torch.from_numpy(y_train)
    return (
        TensorDataset(xt[train], yt[train]),
        TensorDataset(xt[dev], yt[dev]),
        TensorDataset(to_tensor(x_test), torch.from_numpy(y_test)),
    )


def write_cifar_batch(path: str, images: np.ndarray, labels: Sequence[int]) -> None:
    """Write images (N, 3, 32, 32) uint8 and labels in CIFAR-10's python batch format."""
    images = np.asarray(images, dtype=np.uint8)
    batch = {
        b"batch_label": b"written by dptrain examples",
        b"labels": [int(v) for v in labels],
        b"data": images.reshape(len(images), -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(images))],
    }
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=2)


# ------------------------------------------------------------------------------ SMILES --


def read_bbbp_csv(path: str) -> tuple[list[str], list[int]]:
    """Read a BBBP-format CSV: a header with ``p_np`` and ``smiles`` columns (``name`` is ignored).

    Raises:
        ValueError: a column is missing or a label is not 0/1 (names the line).
    """
    smiles, labels = [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"p_np", "smiles"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected a header like 'name,p_np,smiles'")
        for line, row in enumerate(reader, start=2):
            s = (row["smiles"] or "").strip()
            if not s:
                continue
            try:
                label = int(row["p_np"])
            except ValueError:
                raise ValueError(f"{path}, line {line}: p_np={row['p_np']!r} is not 0 or 1") from None
            if label not in (0, 1):
                raise ValueError(f"{path}, line {line}: p_np={label} is not 0 or 1")
            smiles.append(s)
            labels.append(label)
    if not smiles:
        raise ValueError(f"{path} holds no molecules")
    return smiles, labels


# Fragments joined into chain-like molecules; each contributes a known count of N and O atoms.
_FRAGMENTS = [
    ("C", 0), ("CC", 0), ("CCC", 0), ("c1ccccc1", 0), ("C1CCCCC1", 0), ("Cl", 0), ("F", 0), ("C(C)C", 0),
    ("O", 1), ("N", 1), ("C(=O)", 1), ("C(=O)O", 2), ("C(=O)N", 2), ("c1ccncc1", 1), ("OC", 1), ("NC", 1),
    ("S", 0), ("C#N", 1), ("[N+](=O)[O-]", 3), ("c1ccc(O)cc1", 1),
]

#: The rule behind the synthetic labels, stated where the data is made.
SYNTHETIC_RULE = (
    "p_np = 1 (crosses the blood-brain barrier) when the molecule has at most 3 nitrogen + oxygen atoms, "
    "a crude stand-in for the polar-surface-area rule of thumb for BBB penetration"
)


def count_n_o(smiles: str) -> int:
    """Nitrogen and oxygen atoms in a SMILES string (aromatic ``n``/``o`` included; ``Na`` etc. excluded)."""
    count, i = 0, 0
    while i < len(smiles):
        ch = smiles[i]
        if ch in "NOno" and not (ch == "N" and smiles[i + 1 : i + 2] in ("a", "i", "e", "b", "d", "o", "p")):
            count += 1
        i += 1
    return count


def synthetic_smiles(n: int, seed: int) -> tuple[list[str], list[int]]:
    """Generate ``n`` SMILES strings with labels from :data:`SYNTHETIC_RULE` (synthetic, not real BBBP data).

    Molecules are chains of 2-7 fragments; the label is computed from the string with
    :func:`count_n_o`, so the model must learn to count polar atoms over the whole sequence.
    """
    rng = random.Random(seed)
    smiles, labels = [], []
    for _ in range(n):
        parts = [rng.choice(_FRAGMENTS)[0] for _ in range(rng.randint(2, 7))]
        s = "".join(parts)
        smiles.append(s)
        labels.append(1 if count_n_o(s) <= 3 else 0)
    return smiles, labels


# ------------------------------------------------------------------------ tiny stories --

_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gus", "Hana", "Ivo", "Jun")
_ANIMALS = ("cat", "dog", "fox", "owl", "hen", "goat", "frog", "bear")
_PLACES = ("the park", "the river", "the hill", "the market", "the old barn", "the garden", "the woods")
_THINGS = ("a red ball", "a blue kite", "an apple", "a small boat", "a book", "a warm hat", "a lamp")
_FEELINGS = ("happy", "tired", "curious", "brave", "hungry", "sleepy", "proud")


def tiny_stories(num_stories: int, seed: int) -> str:
    """Short generated stories in plain English, the same for a given seed on every machine.

    A character-level language model finds a lot to learn here (words, a small grammar, names
    that come back later in a story) and its loss falls visibly in a few hundred steps: the
    stand-in text of ``examples/char_gpt.py``, no download needed.
    """
    rng = random.Random(seed)
    stories = []
    for _ in range(num_stories):
        who, pet = rng.choice(_NAMES), rng.choice(_ANIMALS)
        place, thing, feeling = rng.choice(_PLACES), rng.choice(_THINGS), rng.choice(_FEELINGS)
        friend = rng.choice([n for n in _NAMES if n != who])
        lines = [
            f"{who} had a {pet}.",
            f"One day {who} and the {pet} went to {place}.",
            rng.choice([f"There they found {thing}.", f"{friend} gave them {thing}.", f"They lost {thing} there."]),
            f"The {pet} was {feeling}, so {who} sat down with {friend}.",
            rng.choice([f"At night {who} said, \"Good night, {pet}.\"", "Then they all went home to eat.",
                        f"{friend} laughed and the {pet} ran to {place} again."]),
        ]
        stories.append(" ".join(lines))
    return "\n".join(stories) + "\n"
