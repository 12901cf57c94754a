"""FSDP when a peer stalls: its collectives fail within the timeout and name the missing rank,
as every other collective does (they all wait through dptrain.comm.wait)."""

from __future__ import annotations

import time

import pytest
import torch

from dptrain.comm import CollectiveError
from dptrain.models import MLP
from dptrain.parallel.fsdp import FSDP, ParamCountPolicy
from tests._dist import run_ranks


def _fsdp_with_a_stalled_peer(rank, phase):
    torch.manual_seed(0)
    model = FSDP(MLP([8, 16, 16, 4]), auto_wrap_policy=ParamCountPolicy(100))
    model(torch.randn(3, 8)).sum().backward()  # one healthy step
    if rank == 1:
        if phase == "backward":
            out = model(torch.randn(3, 8)).sum()  # forward together, then stall before backward
        time.sleep(5)  # stuck outside any collective while rank 0 waits for it
        return None
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        model(torch.randn(3, 8)).sum().backward()
    return time.monotonic() - t0, str(info.value)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_stalled_peer_fails_fsdp_within_the_timeout_and_is_named(phase):
    waited, msg = run_ranks(_fsdp_with_a_stalled_peer, 2, phase,
                            env={"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2"}, timeout=40)[0]
    assert waited < 2 + 3, msg
    assert msg.startswith("rank 0: FSDP "), msg
    assert ("all-gather of unit" in msg) or ("gradient reduction of unit" in msg)
    assert "rank 1 did not arrive" in msg, msg
