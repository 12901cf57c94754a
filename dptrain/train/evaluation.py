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
from dptrain.runtime.tensors import move_to_device
from dptrain.data import ShadowBatch, gather_results

__all__ = ["split_batch", "forward", "forward_batch", "loss_of", "batch_size_of", "num_samples", "evaluate", "evaluate_steps"]


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


def forward_batch(model: nn.Module, batch: Any) -> Any:
    """The model on a whole batch: ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or
    list, else ``model(batch)`` (how a model that computes its own loss is called).

    Raises:
        ValueError: the model does not take the batch that way, with the likely fix (a batch of
            ``(inputs, targets)`` for a model that does not compute its loss needs a ``loss_fn``).
    """
    try:
        return forward(model, batch)
    except TypeError as exc:
        how = ("model(**batch)" if isinstance(batch, Mapping) else
               "model(*batch)" if isinstance(batch, (list, tuple)) else "model(batch)")
        raise ValueError(
            f"with loss_fn=None the Trainer passes each batch to the model whole ({how}: the model computes its own "
            f"loss), and that failed: {exc}. For batches of (inputs, targets) pass a loss: Trainer(model, optimizer, "
            f"data, loss_fn=nn.CrossEntropyLoss()), or write the step: Trainer(..., training_step=lambda model, "
            f"batch: ...)"
        ) from exc


def loss_of(output: Any, where: str = "the model") -> torch.Tensor:
    """The loss in ``output``: a scalar tensor itself, ``output.loss``, ``output["loss"]``, or the first
    element of a tuple (Hugging Face's ``return_dict=False``).

    Raises:
        ValueError: no loss found, naming what came back and the ways to give one.
    """
    loss = output
    if not isinstance(loss, torch.Tensor):
        if isinstance(output, Mapping) and "loss" in output:
            loss = output["loss"]
        elif getattr(output, "loss", None) is not None:
            loss = output.loss
        elif isinstance(output, (list, tuple)) and output and isinstance(output[0], torch.Tensor):
            loss = output[0]
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    shown = type(output).__name__ + (f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else "")
    raise ValueError(
        f"{where} returned {shown}, which holds no loss; return a scalar tensor or an output with .loss or "
        f"['loss'] (a Hugging Face model does when the batch has 'labels'), or pass Trainer(loss_fn=...) for "
        f"batches of (inputs, targets), or Trainer(training_step=lambda model, batch: ...)"
    )


def batch_size_of(batch: Any) -> int:
    """Samples in a batch of any shape: the leading size of its first tensor (1 when it has none)."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() > 0 else 1
        if isinstance(item, Mapping):
            stack[:0] = list(item.values())
        elif isinstance(item, (list, tuple)):
            stack[:0] = list(item)
    return 1


def evaluate_steps(step: Callable[[nn.Module, Any], Any], net: nn.Module, loader: Any, *, device: torch.device,
                   lockstep: bool, autocast: Callable[[], Any]) -> dict[str, float]:
    """Average ``step(net, batch)``'s values over every sample of every rank; collective.

    ``step`` returns a loss (see :func:`loss_of`) or ``{name: scalar}``; each batch weighs by its
    size. The sums travel in one all-reduce. With ``lockstep`` (every forward communicates, as
    FSDP's does) the ranks agree before each batch whether any still has one, and a rank that has
    run out repeats its last batch (or a stand-in) and drops the values.
    """
    names: list[str] = []
    sums: dict[str, float] = {}
    count = 0
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            batches, last = iter(loader), None
            while True:
                batch = next(batches, None)
                # A stream's stand-in for a rank whose share ran out: counted for nothing.
                stand_in = batch.batch if isinstance(batch, ShadowBatch) else None
                real = batch is not None and stand_in is None
                if lockstep:
                    more = torch.tensor([1 if real else 0], device=device)
                    comm.all_reduce(more, op="max")
                    if not int(more.item()):
                        break
                    if not real:
                        batch = stand_in if stand_in is not None else last if last is not None else _stand_in_batch(loader)
                elif batch is None:
                    break
                elif not real:
                    continue  # nothing to count, and no forward the other ranks wait for
                moved = move_to_device(batch, device)
                with autocast():
                    values = step(net, moved)
                if not real:
                    continue
                last = batch
                n = batch_size_of(moved)
                if not _scalars(values):  # a loss, or a model's output holding one
                    values = {"loss": loss_of(values, "evaluation_step")}
                for k, v in values.items():
                    if k not in sums:
                        names.append(k)
                        sums[k] = 0.0
                    sums[k] += float(v) * n
                count += n
    finally:
        net.train(was_training)
    # Every rank must list the same names: a rank without a batch knows none.
    everyone = comm.all_gather_object(names) if comm.is_distributed() else [names]
    keys = sorted({k for ks in everyone for k in ks}, key=lambda k: (k != "loss", k))
    totals = torch.tensor([sums.get(k, 0.0) for k in keys] + [float(count)], dtype=torch.float64, device=device)
    if comm.is_distributed():
        comm.all_reduce(totals, op="sum")
    n_all = float(totals[-1])
    return {k: (float(totals[i]) / n_all if n_all else float("nan")) for i, k in enumerate(keys)}


def _scalars(values: Any) -> bool:
    """Whether ``values`` is a mapping of metric values (numbers or one-element tensors), not a model output."""
    return isinstance(values, Mapping) and all(
        isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in values.values())


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

