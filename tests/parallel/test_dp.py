"""DataParallel on CPU "devices": outputs and gradients equal the unwrapped module on the full batch."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import dptrain
from dptrain.models import MLP
from dptrain.parallel.dp import DataParallel, gather, scatter


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class _Recorder(nn.Module):
    """Records which thread ran each replica and returns a dict with a tuple inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.threads: list[str] = []

    def forward(self, x, scale=1.0, *, extra=None):
        self.threads.append(threading.current_thread().name)
        y = self.lin(x) * scale
        return {"y": y, "pair": (y.sum(-1), extra + 0)}


@pytest.mark.parametrize("replicas", [2, 3])
def test_outputs_and_grads_match_full_batch(replicas):
    torch.manual_seed(0)
    plain = MLP([6, 16, 16, 3])
    dp = DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * replicas)
    x = torch.randn(7, 6)  # 7 does not divide by 2 or 3: uneven chunks, like torch.chunk
    out_dp, out = dp(x), plain(x)
    torch.testing.assert_close(out_dp, out, rtol=0, atol=1e-6)
    (out_dp**2).mean().backward()
    (out**2).mean().backward()
    for (name, p_dp), p in zip(dp.module.named_parameters(), plain.parameters()):
        assert p_dp.grad is not None, name
        torch.testing.assert_close(p_dp.grad, p.grad, rtol=1e-5, atol=1e-6)
    assert list(dp.state_dict()) == ["module." + k for k in plain.state_dict()]


@pytest.mark.parametrize("replicas", [2, 3])
def test_batchnorm_semantics(replicas):
    torch.manual_seed(0)
    plain = _ConvBN()
    dp = DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * replicas)
    x = torch.randn(6, 3, 5, 5)
    chunks = x.chunk(replicas)

    # Eval mode: running statistics are used, so the full-batch result is exact.
    plain.eval(), dp.eval()
    torch.testing.assert_close(dp(x), plain(x), rtol=0, atol=1e-6)

    # Training mode: each replica normalises its own chunk (as torch.nn.DataParallel does),
    # gradients still sum into the original parameters, and the running statistics come
    # from replica 0's chunk only.
    plain.train(), dp.train()
    per_chunk = [copy.deepcopy(plain) for _ in chunks]
    ref_out = torch.cat([m(c) for m, c in zip(per_chunk, chunks)])
    out = dp(x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    ref_out.pow(2).mean().backward()
    out.pow(2).mean().backward()
    for name, p in dp.module.named_parameters():
        ref_grad = sum(dict(m.named_parameters())[name].grad for m in per_chunk)
        torch.testing.assert_close(p.grad, ref_grad, rtol=1e-5, atol=1e-6)
    bn, bn0 = dp.module.bn, per_chunk[0].bn
    torch.testing.assert_close(bn.running_mean, bn0.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, bn0.running_var, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 1
    # ...and not from the whole batch
    full = copy.deepcopy(plain)
    full(x)
    assert not torch.allclose(bn.running_mean, full.bn.running_mean)


def test_replicas_run_in_threads_and_structures_round_trip():
    torch.manual_seed(0)
    plain = _Recorder()
    dp = DataParallel(copy.deepcopy(plain), device_ids=["cpu", "cpu", "cpu"])
    x, extra = torch.randn(6, 6), torch.arange(6.0)
    out = dp(x, 2.0, extra=extra)
    ref = plain(x, 2.0, extra=extra)
    torch.testing.assert_close(out["y"], ref["y"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["pair"][0], ref["pair"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["pair"][1], extra)  # kwargs are scattered too
    names = dp.module.threads
    assert len(names) == 3 and len(set(names)) == 3  # three replicas, three threads
    with torch.no_grad():
        assert not dp(x, extra=extra)["y"].requires_grad  # grad mode reaches the threads


def test_scatter_gather_helpers_and_small_batch():
    devices = [torch.device("cpu")] * 3
    parts = scatter((torch.arange(5), "tag", [torch.ones(5, 2)]), devices)
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert all(p[1] == "tag" for p in parts)
    assert gather([torch.tensor(1.0), torch.tensor(2.0)], torch.device("cpu")).tolist() == [1.0, 2.0]
    dp = DataParallel(MLP([6, 3]), device_ids=["cpu"] * 3)
    assert dp(torch.randn(2, 6)).shape == (2, 3)  # fewer samples than replicas: two replicas


def test_errors_and_exports():
    with pytest.raises(ValueError, match="at least one device"):
        DataParallel(MLP([2, 2]), device_ids=[])

    class Boom(nn.Module):
        def forward(self, x):
            if x.shape[0] < 3:
                raise KeyError("small chunk")
            return x

    with pytest.raises(RuntimeError, match=r"replica 1 on cpu failed: KeyError"):
        DataParallel(Boom(), device_ids=["cpu", "cpu"])(torch.randn(5, 2))
    assert dptrain.DataParallel is DataParallel


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_two_devices_match_full_batch():
    torch.manual_seed(0)
    plain = _ConvBN().cuda().eval()
    dp = DataParallel(copy.deepcopy(plain), device_ids=[0, 1])
    x = torch.randn(6, 3, 5, 5, device="cuda")
    out_dp, out = dp(x), plain(x)
    assert out_dp.device == torch.device("cuda", 0)
    torch.testing.assert_close(out_dp, out, rtol=1e-5, atol=1e-5)
    out_dp.sum().backward()
    out.sum().backward()
    for p_dp, p in zip(dp.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p_dp.grad, p.grad, rtol=1e-4, atol=1e-5)
