"""The collectives DDP and FSDP issue outside their gradient buckets are guarded too: when a
peer stalls there, the rank that waits fails at the timeout with dptrain's message -- this
rank, the operation, the rank that did not come -- not gloo's bare error.

The six: DDP's buffer broadcast at each forward, the reducer's all-reduce of the used
parameters (``find_unused_parameters``), the join's all-reduce for the last rank to join,
the delayed all-reduce (``delay_all_reduce_named_params``), and FSDP's two broadcasts of ``sync_module_states`` (the buffers, then each unit). Rank 1
stalls until rank 0 has failed (an event file), so the 2 s timeout must fire while it is away:
outside any collective on DDP's paths (and is then named as the rank that did not arrive),
inside its own broadcast on FSDP's, which run within the constructor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dptrain
from dptrain.comm import CollectiveError
from tests._dist import run_ranks, set_event, wait_event

ENV = {"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2", "DPTRAIN_SHM": "0"}


class _Stalled(Exception):
    """Rank 1's broadcast, once rank 0 has failed without it."""


def _with_buffers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _run_path(path: str, rank: int, events) -> None:
    """Build on every rank (the constructors' collectives run together); then the path itself."""
    x = torch.randn(6, 4)
    if path == "ddp_buffers":
        model = dptrain.DDP(_with_buffers())
        if rank == 0:
            model(x)
    elif path == "used_parameters":
        torch.manual_seed(0)
        model = dptrain.DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), find_unused_parameters=True)
        if rank == 0:
            model(x).sum().backward()
    elif path == "delayed":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        model = dptrain.DDP(net, delay_all_reduce_named_params=list(net.named_parameters()),
                            param_to_hook_all_reduce=net[0].weight)
        if rank == 0:
            model(x).sum().backward()
    elif path == "join":
        model = dptrain.DDP(_with_buffers())
        if rank == 0:
            with model.join():
                model(x)
    else:  # the FSDP broadcasts run inside the constructor: rank 1 stalls in its own broadcast
        from dptrain.parallel.fsdp import FSDP

        if rank == 1:
            def stalled_broadcast(*args, **kwargs):
                wait_event(events / "0")
                raise _Stalled  # and leave: rank 0 is gone
            dist.broadcast = stalled_broadcast
        model = _with_buffers() if path == "fsdp_buffers" else nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        FSDP(model, sync_module_states=True)


def _stall_rank_1(rank, path, events):
    if rank == 1 and not path.startswith("fsdp"):
        _run_path(path, rank, events)  # construction, with rank 0
        wait_event(events / "0")  # away, outside any collective, until rank 0 has failed
        return "stalled"
    if rank == 1:
        with pytest.raises(CollectiveError, match="_Stalled"):
            _run_path(path, rank, events)
        return "stalled"
    with pytest.raises(CollectiveError) as info:
        _run_path(path, rank, events)
    set_event(events / "0")
    return str(info.value)


@pytest.mark.parametrize("path, operation", [
    ("ddp_buffers", "DDP buffer broadcast (forward) from rank 0"),
    ("used_parameters", "DDP used-parameter all-reduce"),
    ("join", "DDP join (the last rank to join)"),
    ("delayed", "DDP delayed all-reduce (delay_all_reduce_named_params)"),
    ("fsdp_buffers", "FSDP broadcast of the buffers (sync_module_states) from rank 0"),
    ("fsdp_unit", "FSDP broadcast of unit"),
])
def test_a_stalled_peer_is_named_on_every_path_outside_the_buckets(tmp_path, path, operation):
    out = run_ranks(_stall_rank_1, 2, path, tmp_path, env=ENV, timeout=90)
    assert out[1] == "stalled"
    msg = out[0]
    assert msg.startswith("rank 0: " + operation), msg
    if not path.startswith("fsdp"):  # (in FSDP's case rank 1 is inside the same broadcast: not missing)
        assert "rank 1 did not arrive" in msg, msg  # the peer it waited for is named
    # The 2 s timeout fired (gloo's words for it), while rank 1 was still away.
    assert "Timed out" in msg or "Application timeout" in msg, msg
