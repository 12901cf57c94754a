"""Data for data-parallel training: PyTorch's sampler made resumable, and exact evaluation.

- :class:`DistributedSampler` -- ``torch.utils.data.DistributedSampler``'s indices, plus
  ``state_dict()``/``load_state_dict()`` (also onto another world size) and ``pad=False``
  for the exact-evaluation partition. Its position counts the indices it yielded: exact
  under a plain DataLoader with ``num_workers=0``. Rules: ``dptrain.data.sampler``.
- :func:`prepare_dataloader` -- the DataLoader with that sampler, seeded workers, pinned
  memory on CUDA, and a position counted from the batches it handed out (exact with
  workers too).
- :func:`gather_results` -- every sample's evaluation result once, in dataset order.
- :func:`main_process_first` -- let rank 0 download or preprocess before the others read.
"""

from dptrain.data.gather import gather_results
from dptrain.data.loader import DistributedDataLoader, main_process_first, prepare_dataloader
from dptrain.data.sampler import DistributedSampler

__all__ = [
    "DistributedSampler",
    "DistributedDataLoader",
    "prepare_dataloader",
    "gather_results",
    "main_process_first",
]
