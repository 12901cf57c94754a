"""The reducer's bucket assignment and bucket views."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP, ResNet18
from dptrain.parallel.ddp._reducer import DEFAULT_FIRST_BUCKET_BYTES, compute_bucket_assignment
from tests._dist import run_ranks, set_event, wait_event


@pytest.mark.parametrize("limits", [[DEFAULT_FIRST_BUCKET_BYTES, 25 << 20], [1000], [100_000]])
@pytest.mark.parametrize("make", [lambda: ResNet18(width=8), lambda: MLP([256] * 5)])
def test_bucket_assignment_matches_torch(make, limits):
    params = list(make().parameters())
    ours = compute_bucket_assignment([p.numel() * p.element_size() for p in params], [p.dtype for p in params], limits)
    # PyTorch's C++ assignment, fed the parameters in reverse (gradient-ready) order.
    n = len(params)
    theirs, _ = dist._compute_bucket_assignment_by_size(params[::-1], limits, [False] * n, list(range(n - 1, -1, -1)))
    assert ours == theirs
    assert sorted(i for b in ours for i in b) == list(range(n))


def test_bucket_assignment_first_bucket_small_and_dtypes_apart():
    sizes = [400, 400, 400, 400, 400]
    keys = ["f32", "f16", "f32", "f16", "f32"]
    buckets = compute_bucket_assignment(sizes, keys, [500, 2000])
    assert buckets == [[4, 2], [3, 1], [0]]
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
    with pytest.raises(ValueError, match="positive"):
        compute_bucket_assignment(sizes, keys, [0])


def _views(rank):
    torch.manual_seed(0)
    model = dptrain.DDP(MLP([6, 16, 16, 3]), gradient_as_bucket_view=True, bucket_cap_mb=0.0004)
    buffers = [b.buffer for b in model.reducer.buckets]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = []
    for step, set_to_none in enumerate((True, False, False)):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        F.mse_loss(model(x), torch.zeros(4, 3)).backward()
        inside = []
        for p in model.parameters():
            ptr = p.grad.data_ptr()
            inside.append(
                any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in buffers)
            )
        checks.append(all(inside))
        opt.step()
    return checks, len(buffers), [p.grad.clone() for p in model.parameters()]


def test_gradient_as_bucket_view_grads_live_in_buckets():
    (c0, nb, g0), (c1, _, g1) = run_ranks(_views, 2)
    assert c0 == c1 == [True, True, True]
    assert nb > 1
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def _ddp_with_a_stalled_peer(rank, events):
    from dptrain.comm import CollectiveError

    model = dptrain.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()  # one healthy step
    if rank == 1:
        wait_event(events / "0")  # stuck outside any collective until rank 0's backward has failed
        return None
    with pytest.raises(CollectiveError) as info:
        model(torch.randn(3, 4)).sum().backward()
    set_event(events / "0")
    return str(info.value)


def test_a_stalled_peer_fails_backward_by_the_timeout_and_is_named(tmp_path):
    msg = run_ranks(_ddp_with_a_stalled_peer, 2, tmp_path, env={"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2"},
                    timeout=60)[0]
    assert msg.startswith("rank 0: DDP gradient all-reduce (bucket 0)"), msg
    assert "rank 1 did not arrive" in msg and "outside any collective" in msg, msg
    assert "the 2s timeout" in msg, msg
