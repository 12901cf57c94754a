"""Sending a nested state as one buffer (dptrain.runtime.tensors): what in-place recovery's state transfer
relies on -- every tensor comes back bit for bit with its dtype, shape and place in the structure."""

from __future__ import annotations

import collections

import torch

from dptrain.runtime import tensors as _tensors


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_sparse:
            return b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def _through_a_buffer(state):
    skeleton, tensors = _tensors.split_tensors(state)
    buffer, meta = _tensors.pack(tensors, torch.device("cpu"))
    received = _tensors.empty_for(meta, torch.device("cpu"))
    received.copy_(buffer)  # what the broadcast does
    return _tensors.join_tensors(skeleton, _tensors.unpack(received, meta)), tensors


def test_a_state_of_every_dtype_and_shape_comes_back_bit_for_bit():
    tied = torch.randn(3, 4)
    Pair = collections.namedtuple("Pair", "x y")
    state = {
        "model": collections.OrderedDict(w=tied, also_w=tied, n=torch.arange(5), flag=torch.tensor(True)),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "m": torch.randn(7, dtype=torch.bfloat16),
                                    "v": torch.randn(2, 3, dtype=torch.float64).t()}},  # not contiguous
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "odd": [torch.empty(0), torch.randn(3, dtype=torch.complex64), torch.tensor(7, dtype=torch.int8),
                torch.randn(5, dtype=torch.float16)],
        "pair": Pair(1, torch.ones(1)),
        "sparse": torch.randn(4).to_sparse(),
        "text": "seq", "number": 12, "nothing": None,
    }
    back, tensors = _through_a_buffer(state)
    assert _same(state, back)
    assert len(tensors) == 11  # the tied weight once, the sparse tensor not at all (it stays in the structure)
    assert back["model"]["w"].data_ptr() == back["model"]["also_w"].data_ptr()


def test_every_tensor_of_a_packed_buffer_starts_aligned():
    _, tensors = _tensors.split_tensors([torch.ones(3, dtype=torch.int8), torch.ones(3, dtype=torch.float64)])
    buffer, meta = _tensors.pack(tensors, torch.device("cpu"))
    out = _tensors.unpack(buffer, meta)
    assert [t.dtype for t in out] == [torch.int8, torch.float64] and all(t.storage_offset() * t.element_size() % 16 == 0 for t in out)
