"""Make a CPU-only torch claim one CUDA device, in every process that puts this folder on
its path (``PYTHONPATH=tests/fake_cuda``): ``torch.cuda.is_available()`` is True and
``device_count()`` is 1, while every real CUDA call still fails ("Torch not compiled with
CUDA enabled").

Used by ``tests/test_cuda_present.py``: on a GPU machine, code that picks CUDA just because
it exists moves CPU tensors to a GPU, and the suite fails there (as it did on the first H100
that ran it). Here the same choice fails at once, on any CPU machine.
"""
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
# Choosing a device is allowed (it works on a GPU machine); putting a tensor there is not.
_current = [0]
torch.cuda.set_device = lambda device: _current.__setitem__(0, torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index or 0)
torch.cuda.current_device = lambda: _current[0]
