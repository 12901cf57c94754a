"""FSDP when a peer stalls: its collectives fail by the timeout and name the missing rank,
as every other collective does (they all wait through dptrain.comm.wait)."""

from __future__ import annotations

import pytest
import torch

from dptrain.comm import CollectiveError
from dptrain.models import MLP
from dptrain.parallel.fsdp import FSDP, ParamCountPolicy
from tests._dist import run_ranks, set_event, wait_event


def _fsdp_with_a_stalled_peer(rank, phase, events):
    torch.manual_seed(0)
    model = FSDP(MLP([8, 16, 16, 4]), auto_wrap_policy=ParamCountPolicy(100))
    model(torch.randn(3, 8)).sum().backward()  # one healthy step
    if rank == 1:
        if phase == "backward":
            out = model(torch.randn(3, 8)).sum()  # forward together, then stall before backward
        wait_event(events / "0")  # stuck outside any collective until rank 0 has failed
        return None
    reached = {"forward done": False}
    with pytest.raises(CollectiveError) as info:
        out = model(torch.randn(3, 8)).sum()
        reached["forward done"] = True
        out.backward()
    set_event(events / "0")
    return str(info.value), reached["forward done"]


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_stalled_peer_fails_fsdp_by_the_timeout_and_is_named(tmp_path, phase):
    msg, forward_done = run_ranks(_fsdp_with_a_stalled_peer, 2, phase, tmp_path,
                                  env={"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2"}, timeout=60)[0]
    assert msg.startswith("rank 0: FSDP "), msg
    # it failed in the phase where rank 1 stopped coming
    assert forward_done == (phase == "backward"), msg
    assert ("all-gather of unit" in msg) if phase == "forward" else ("gradient reduction of unit" in msg or "all-gather of unit" in msg), msg
    assert "rank 1 did not arrive" in msg, msg
    assert "the 2s timeout" in msg, msg
