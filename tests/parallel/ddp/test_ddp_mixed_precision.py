"""DDP's ``mixed_precision=`` against PyTorch's DDP as it ships, also with ``gradient_as_bucket_view``.

PyTorch's DDP mixed precision records CUDA-style events and waits on the accelerator's
stream, which a CPU-only torch refuses ("cpu backend doesn't support events"). On CPU every
copy is done when it returns, so in the reference ranks those calls are made no-ops and
PyTorch's code runs otherwise unchanged. Run that way, PyTorch's very first backward leaves
uninitialised memory in some ``.grad`` (with and without bucket views); from the second
backward on its gradients are right. So both DDPs warm up with one backward and no step, and
are compared from there; the first step is covered against the hand-written recipe in
``test_ddp_dropin.py``.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel.distributed import _MixedPrecision

import dptrain
from tests._dist import run_ranks
from tests.parallel.ddp._ddp_models import BNNet, make_batch

TorchDDP = nn.parallel.DistributedDataParallel


class _NoEvent:
    """torch.Event on CPU: nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


class _NoStream:
    def wait_stream(self, stream):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _let_torch_mixed_precision_run_on_cpu() -> None:
    torch.Event = _NoEvent
    # A CUDA build of torch without a usable GPU raises on torch.Stream() (its accelerator is
    # still "cuda"); a CPU build gives a CPU stream, which does nothing either.
    torch.Stream = lambda *args, **kwargs: _NoStream()
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_stream = lambda *args, **kwargs: _NoStream()
    # torch 2.4's DDP mixed precision is written against torch.cuda's streams and events.
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda stream: stream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    importlib.import_module("torch.distributed._functional_collectives")  # torch 2.4's _free_storage uses it unimported


def _train(rank, set_to_none, reduce_dtype):
    _let_torch_mixed_precision_run_on_cpu()
    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, buffer_dtype=torch.bfloat16)
    out = {}
    for name, cls, view in (("ours", dptrain.DDP, True), ("ours", dptrain.DDP, False),
                            ("torch", TorchDDP, True), ("torch", TorchDDP, False)):
        torch.manual_seed(4)
        kwargs = {"shm": False} if cls is dptrain.DDP else {}
        ddp = cls(BNNet(), mixed_precision=copy.copy(config), gradient_as_bucket_view=view, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        F.cross_entropy(ddp(make_batch("mlp", rank, 99, batch=6)[0]).float(), torch.zeros(6, dtype=torch.long)).backward()
        opt.zero_grad(set_to_none=set_to_none)  # the warm-up (see the module's docstring): no step
        dtypes, grads = [], []
        for step in range(4):
            x, y = make_batch("mlp", rank, step, batch=6)
            F.cross_entropy(ddp(x).float(), y).backward()
            dtypes.append([(p.dtype, p.grad.dtype) for p in ddp.parameters()])
            grads.append({n: p.grad.clone() for n, p in ddp.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        state = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        out[(name, view)] = (state, dtypes, grads)
    return out


def _same(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys(), label
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{label}: {k}"


@pytest.mark.parametrize("set_to_none, reduce_dtype", [
    (True, torch.float32),
    (False, torch.float32),
    (False, torch.bfloat16),
])
def test_mixed_precision_with_bucket_views_like_torch(set_to_none, reduce_dtype):
    for out in run_ranks(_train, 2, set_to_none, reduce_dtype):
        reference = out[("torch", False)]
        for key in (("ours", True), ("ours", False)):
            state, dtypes, grads = out[key]
            _same(state, reference[0], str(key))
            for step, (g, ref) in enumerate(zip(grads, reference[2])):
                _same(g, ref, f"{key} step {step}")
            assert dtypes == reference[1] and {g for d in dtypes for _, g in d} == {torch.float32}
        # [Note: PyTorch's bucket views under mixed precision] PyTorch's DDP with both options
        # agrees for the first synced backward, then keeps handing out that backward's .grad
        # (its hook replaces .grad's data by an fp32 copy, which later reductions never reach):
        # so from the second step on the reference is PyTorch without bucket views.
        _same(out[("torch", True)][2][0], reference[2][0], "torch with bucket views, first step")
