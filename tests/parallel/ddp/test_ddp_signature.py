"""Our DDP takes the installed torch's constructor arguments: what torch has works, the rest
raises TypeError as PyTorch's class does (issue 20: torch 2.11 lacks 2.13's newer arguments).

An older torch is simulated by giving torch's ``DistributedDataParallel.__init__`` an older
signature; single process (no process group: our DDP is then a plain wrapper).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import dptrain

TorchDDP = nn.parallel.distributed.DistributedDataParallel
NEWER = ("bucket_cap_mb_list", "batched_grad_copy", "forward_sync_buffers")  # not in torch 2.11


@pytest.fixture
def torch_2_11(monkeypatch):
    """torch's DDP constructor without 2.13's newer arguments, ``broadcast_buffers=True`` by default."""
    params = []
    for p in inspect.signature(TorchDDP.__init__).parameters.values():
        if p.name in NEWER:
            continue
        params.append(p.replace(default=True) if p.name == "broadcast_buffers" else p)

    def older_init(self, *args, **kwargs):  # never called: only its signature is read
        raise AssertionError("not called")

    older_init.__signature__ = inspect.Signature(params)
    monkeypatch.setattr(TorchDDP, "__init__", older_init)


@pytest.mark.parametrize("name, value", [("forward_sync_buffers", False), ("batched_grad_copy", True),
                                         ("bucket_cap_mb_list", [1, 2])])
def test_an_argument_the_installed_torch_lacks_raises_its_type_error(torch_2_11, name, value):
    with pytest.raises(TypeError) as caught:
        dptrain.DDP(nn.Linear(3, 3), **{name: value})
    msg = str(caught.value)
    assert msg.startswith(f"DistributedDataParallel.__init__() got an unexpected keyword argument '{name}'")
    assert "upgrade torch" in msg and torch.__version__ in msg


def test_the_arguments_the_installed_torch_has_work(torch_2_11):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.11 does not deprecate broadcast_buffers: no warning
        ddp = dptrain.DDP(nn.Linear(3, 3), None, None, 0, False, bucket_cap_mb=2, find_unused_parameters=True,
                          gradient_as_bucket_view=True, shm=False)
    assert ddp.broadcast_buffers is False and ddp.bucket_cap_mb == 2 and ddp.bucket_bytes_cap_list == []
    assert "forward_sync_buffers" not in inspect.signature(TorchDDP.__init__).parameters


def test_a_misspelt_argument_names_the_valid_ones():
    with pytest.raises(TypeError, match="unexpected keyword argument 'find_unused_params'.*find_unused_parameters"):
        dptrain.DDP(nn.Linear(3, 3), find_unused_params=True)


def test_too_many_positional_arguments_raise_type_error_like_torch():
    n = len(inspect.signature(TorchDDP.__init__).parameters)  # self included: one too many
    with pytest.raises(TypeError, match="too many positional arguments"):
        dptrain.DDP(nn.Linear(3, 3), *([None] * n))


def test_installed_torch_2_13_takes_its_newer_arguments():
    if not set(NEWER) <= set(inspect.signature(TorchDDP.__init__).parameters):
        pytest.skip(f"the installed torch {torch.__version__} lacks some of {NEWER}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = dptrain.DDP(nn.Linear(3, 3), bucket_cap_mb_list=[1, 2], batched_grad_copy=True,
                          forward_sync_buffers=False)
    assert ddp.forward_sync_buffers is False and ddp.batched_grad_copy


def test_bucket_cap_mb_list_attributes_like_torch():
    """PyTorch's ``bucket_bytes_cap_list`` / ``bucket_bytes_cap`` / ``bucket_bytes_cap_default``."""
    if "bucket_cap_mb_list" not in inspect.signature(TorchDDP.__init__).parameters:
        pytest.skip(f"the installed torch {torch.__version__} has no bucket_cap_mb_list")
    mib = 1024 * 1024
    ddp = dptrain.DDP(nn.Linear(3, 3), bucket_cap_mb_list=[1, 2])
    assert ddp.bucket_bytes_cap_list == [mib, 2 * mib] and ddp.bucket_bytes_cap == 2 * mib
    assert ddp.bucket_bytes_cap_default is False
    plain = dptrain.DDP(nn.Linear(3, 3))
    assert plain.bucket_bytes_cap_list == [] and plain.bucket_bytes_cap == 25 * mib and plain.bucket_bytes_cap_default
    assert dptrain.DDP(nn.Linear(3, 3), bucket_cap_mb=25).bucket_bytes_cap_default is False


def test_bucket_cap_mb_as_a_list_raises_type_error_pointing_at_the_list_argument():
    if "bucket_cap_mb_list" not in inspect.signature(TorchDDP.__init__).parameters:
        pytest.skip(f"the installed torch {torch.__version__} has no bucket_cap_mb_list")
    with pytest.raises(TypeError, match=r"bucket_cap_mb takes one size in MiB, got \[1, 2\]: pass bucket_cap_mb_list"):
        dptrain.DDP(nn.Linear(3, 3), bucket_cap_mb=[1, 2])


def test_bucket_cap_mb_as_a_list_on_a_torch_without_lists(torch_2_11):
    with pytest.raises(TypeError, match="has no per-bucket sizes"):
        dptrain.DDP(nn.Linear(3, 3), bucket_cap_mb=[1, 2])


def test_broadcast_bucket_size_attribute_like_torch():
    """PyTorch's tests and libraries read it (e.g. to call torch's ``_sync_module_states``)."""
    assert dptrain.DDP(nn.Linear(3, 3)).broadcast_bucket_size == 250 * 1024 * 1024


def test_an_argument_of_a_newer_torch_that_we_lack_is_named(monkeypatch):
    params = list(inspect.signature(TorchDDP.__init__).parameters.values())
    params.append(inspect.Parameter("future_flag", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False))

    def newer_init(self, *args, **kwargs):
        raise AssertionError("not called")

    newer_init.__signature__ = inspect.Signature(params)
    monkeypatch.setattr(TorchDDP, "__init__", newer_init)
    dptrain.DDP(nn.Linear(3, 3))  # not passed: fine
    with pytest.raises(NotImplementedError, match=r"\['future_flag'\], which dptrain's DDP does not implement"):
        dptrain.DDP(nn.Linear(3, 3), future_flag=True)
