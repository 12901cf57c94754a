"""Exact distributed evaluation, and the batch conventions the Trainer shares with it.

Each rank runs its shard of the evaluation data (a ``mode="eval"`` loader partitions without
padding, so a rank may have no sample at all), keeps its outputs, and the outputs and
targets are gathered once, in dataset order, with :func:`dptrain.gather_results`: the loss
and the metrics are computed on the whole set, identically on every rank, and equal a single
process's. When every forward communicates (FSDP gathers the shards), the ranks run the
same number of forwards: a rank with fewer batches repeats one -- a stand-in built from the
dataset's first sample when it has none -- and drops the result.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from dptrain import comm
from dptrain._tensors import move_to_device
from dptrain.data import gather_results

__all__ = ["split_batch", "forward", "num_samples", "evaluate"]


def split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping) and "target" in batch:
        inputs = {k: v for k, v in batch.items() if k != "target"}
        return inputs, batch["target"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"the Trainer expects batches of (inputs, targets) or dicts with a 'target' key, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
    )


def forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def num_samples(targets: Any) -> int:
    t = targets
    while isinstance(t, (list, tuple)):
        t = t[0]
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else 1


def evaluate(net: nn.Module, loader: Any, *, device: torch.device, lockstep: bool, autocast: Callable[[], Any],
             loss_fn: Callable[[Any, Any], torch.Tensor], metric_fn: Callable | None, rank: int) -> dict[str, float]:
    """Evaluate ``net`` on ``loader``, every sample exactly once; collective; ``{"loss", **metrics}``."""
    indices = eval_indices(loader)
    was_training = net.training
    net.eval()
    try:
        outs, tgts = _outputs(net, loader, device, lockstep, autocast)
    finally:
        net.train(was_training)
    count = sum(o.shape[0] for o in outs)
    if count != len(indices):
        raise RuntimeError(f"rank {rank}: the eval loader yielded {count} samples but its sampler lists {len(indices)}")
    idx = torch.as_tensor(indices, dtype=torch.int64)
    all_out = gather_results(outs, idx)
    all_tgt = gather_results(tgts, idx)
    metrics: dict[str, float] = {"loss": float(loss_fn(all_out, all_tgt.to(all_out.device)))}
    if metric_fn is not None:
        extra = metric_fn(all_out, all_tgt)
        if isinstance(extra, Mapping):
            metrics.update({str(k): float(v) for k, v in extra.items()})
        else:
            metrics["metric"] = float(extra)
    return metrics


def _outputs(net: nn.Module, loader: Any, device: torch.device, lockstep: bool, autocast) -> tuple[list, list]:
    num_batches = steps = len(loader)
    if lockstep:
        count = torch.tensor([num_batches], device=device)
        comm.all_reduce(count, op="max")
        steps = int(count.item())
    outs, tgts = [], []
    with torch.no_grad():
        batches, batch = iter(loader), None
        for i in range(steps):
            if i < num_batches:
                batch = next(batches)
            elif batch is None:
                batch = _stand_in_batch(loader)
            inputs, targets = split_batch(move_to_device(batch, device))
            with autocast():
                out = forward(net, inputs)
            if i < num_batches:
                outs.append(out.float())
                tgts.append(targets)
    return outs, tgts


def eval_indices(loader: Any) -> torch.Tensor:
    """The dataset indices of this rank's evaluation shard, in the order the loader yields them (int64)."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None:
        raise ValueError("evaluation needs a DataLoader whose sampler lists the dataset indices (dptrain.prepare_dataloader(mode='eval'))")
    # sampler.indices() lists the shard without starting an iteration (which would
    # discard a restored position); any other sampler is simply iterated.
    # A tensor, not a list of Python ints: ~36 bytes an index less on a large dev set.
    listed = sampler.indices() if hasattr(sampler, "indices") else [int(i) for i in sampler]
    return torch.as_tensor(listed, dtype=torch.int64).reshape(-1)


def _stand_in_batch(loader: Any) -> Any:
    """One batch made of the dataset's first sample, for a rank whose eval shard is empty."""
    collate = getattr(loader, "collate_fn", None) or torch.utils.data.default_collate
    return collate([loader.dataset[0]])

