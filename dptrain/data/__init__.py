"""Data for data-parallel training: PyTorch's sampler made resumable, and exact evaluation.

- :class:`DistributedSampler` -- ``torch.utils.data.DistributedSampler``'s indices, plus
  ``state_dict()``/``load_state_dict()`` (also onto another world size) and ``pad=False``
  for the exact-evaluation partition. Its position counts the indices it yielded: exact
  under a plain DataLoader with ``num_workers=0``. Rules: ``dptrain.data.sampler``.
- :func:`prepare_dataloader` -- the DataLoader with that sampler, seeded workers, pinned
  memory on CUDA, and a position counted from the batches it handed out (exact with
  workers too).
- :class:`StreamLoader` -- what ``prepare_dataloader`` gives for a stream (an
  ``IterableDataset``: Hugging Face streaming, webdataset, a generator): each sample read by
  one rank and one worker, the same number of items on every rank (:class:`ShadowBatch`
  stand-ins, or dropped), resumable mid-epoch; :func:`shard_stream_loader` rebuilds a plain
  ``DataLoader`` over a stream as one. Rules: ``dptrain.data.stream``.
- :func:`gather_results` -- every sample's evaluation result once, in dataset order.
- :func:`main_process_first` -- let rank 0 download or preprocess before the others read.
"""

from dptrain.data.gather import gather_results
from dptrain.data.loader import DistributedDataLoader, main_process_first, prepare_dataloader
from dptrain.data.sampler import DistributedSampler
from dptrain.data.stream import ShadowBatch, StreamLoader, shard_stream_loader

__all__ = [
    "DistributedSampler",
    "DistributedDataLoader",
    "prepare_dataloader",
    "StreamLoader",
    "ShadowBatch",
    "shard_stream_loader",
    "gather_results",
    "main_process_first",
]
