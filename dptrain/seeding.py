"""Seeds and random-number-generator states: the same initial model on every rank, and
checkpoints that bring every rank's random streams back exactly.

The RNG states are kept in a form that ``torch.load(weights_only=True)`` accepts --
tensors, ints, floats and plain containers -- so that a checkpoint never needs to unpickle
arbitrary objects (``random.getstate()`` is a tuple of ints, fine; ``numpy``'s state holds
an ``ndarray``, which we turn into a tensor).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "get_rng_state", "set_rng_state"]


def seed_everything(seed: int, deterministic: bool = False) -> int:
    """Seed Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA device.

    Call it on every rank with the same seed before building the model, so that every rank
    starts from the same weights and draws the same random augmentations schedule (the
    samplers shuffle with their own seeded generator).

    Args:
        seed: any integer; NumPy gets ``seed % 2**32`` (its limit).
        deterministic: also ask torch for deterministic kernels
            (``torch.use_deterministic_algorithms(True)`` and cuDNN's deterministic mode).
            Default False: on CPU training is already deterministic.

    Returns:
        The seed, for logging.

    Raises:
        ValueError: ``seed`` is not an integer.

    Example:
        >>> dptrain.seed_everything(0)
        0
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed_everything needs an integer seed, got {seed!r} of type {type(seed).__name__}")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily, if CUDA is initialised later)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return seed


def get_rng_state() -> dict[str, Any]:
    """This process's random states (python, numpy, torch CPU, every CUDA device) as
    tensors and primitives, loadable with ``weights_only=True``.

    Example:
        >>> state = get_rng_state(); x = torch.rand(3); set_rng_state(state)
        >>> torch.equal(x, torch.rand(3))
        True
    """
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states that :func:`get_rng_state` returned (possibly after a save/load).

    CUDA states are restored for as many devices as both the state and this machine have.

    Raises:
        ValueError: ``state`` is not such a dict (names the missing key).
    """
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; pass a dict made by dptrain.seeding.get_rng_state()")
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["key"].cpu().numpy().astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu().to(torch.uint8), device=i)
