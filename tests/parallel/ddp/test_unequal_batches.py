"""Unequal batches in a plain loop: the failed collective says so, counts DDP's steps, and shows the fix.

Hand-made shards (``data[rank::2]`` of 19 samples) give rank 0 ten batches and rank 1 nine:
rank 1 leaves the loop after step 9 while rank 0 waits in step 10's gradient all-reduce.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

import dptrain
from dptrain.runtime.heartbeat import unequal_steps, where
from dptrain.comm import CollectiveError
from tests._dist import run_ranks, set_event, wait_event

#: A short collective timeout, and heartbeats often enough to be fresh within it.
FAST = {"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2"}
FIX = "shard the data with dptrain.DistributedSampler"


def _train_own_shard(rank: int) -> dptrain.DDP:
    """The issue's loop: no Trainer, no sampler; 10 batches on rank 0, 9 on rank 1."""
    data, target = torch.randn(19, 4), torch.randn(19, 1)
    model = dptrain.DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(rank, 19, 2):
        opt.zero_grad()
        F.mse_loss(model(data[i : i + 1]), target[i : i + 1]).backward()
        opt.step()
    return model


def _short_rank_idles(rank: int, events) -> str | None:
    if rank == 1:
        _train_own_shard(rank)
        wait_event(events / "failed")  # idle after its loop (evaluating, saving, sleeping) until rank 0 gave up
        return None
    try:
        _train_own_shard(rank)
    except CollectiveError as exc:
        return str(exc)
    finally:
        set_event(events / "failed")
    return "rank 0 finished its loop without an error"


def test_a_rank_that_ran_out_of_batches_is_named_with_its_ddp_steps_and_the_fix(tmp_path):
    msg = run_ranks(_short_rank_idles, 2, tmp_path, env=FAST, timeout=60)[0]
    assert msg.startswith("rank 0: DDP gradient all-reduce (bucket 0)"), msg
    assert "rank 1 did not arrive (last seen" in msg and "outside any collective after #" in msg, msg
    assert ", 9 DDP steps)" in msg, msg  # a plain loop's steps, not the Trainer's "0 steps"
    assert ("rank 1 is outside any collective after 9 DDP steps, while rank 0 waits in step 10's gradient "
            "all-reduce: if rank 1 has left the training loop, the ranks got unequal numbers of batches "
            "(else it is stalled in step 10 for more than the 2s timeout)") in msg, msg
    assert msg.endswith("shard the data with dptrain.DistributedSampler (or dptrain.prepare_dataloader), or wrap "
                        "the loop in `with model.join():`"), msg


def _short_rank_returns(rank: int) -> str | None:
    try:
        _train_own_shard(rank)
    except CollectiveError as exc:
        return str(exc)
    return None  # rank 1 returns: the harness shuts it down


def test_a_rank_that_returned_after_fewer_steps_is_the_cause_not_a_maybe():
    msg = run_ranks(_short_rank_returns, 2, env=FAST, timeout=60)[0]
    assert msg is not None and msg.startswith("rank 0: DDP gradient all-reduce (bucket 0)"), msg
    assert "rank 1 shut down " in msg, msg
    assert ("rank 1 shut down after 9 DDP steps, while rank 0 waits in step 10's gradient all-reduce: the ranks ran "
            "unequal numbers of steps, most likely because they got unequal numbers of batches. Give every rank "
            "the same number of batches") in msg, msg


# -- the words, from heartbeats (what a failed collective and the launcher both use) ----------
def _state(op: str = "", ddp_steps: int = 9, gone: str = "") -> dict:
    return {"op": op, "ddp_steps": ddp_steps, "gone": gone}


def test_a_rank_in_another_collective_has_left_the_loop():
    hint = unequal_steps({0: _state("DDP buffer broadcast (forward) from rank 0"), 1: _state("barrier"),
                          2: _state("barrier")})
    assert hint.startswith("ranks 1, 2 wait in barrier after 9 DDP steps, while rank 0 waits in step 10's buffer "
                           "broadcast: the ranks ran unequal numbers of steps"), hint
    assert FIX in hint and "stalled" not in hint, hint


def test_no_cause_is_claimed_where_the_heartbeats_do_not_show_one():
    grads = "DDP gradient all-reduce (bucket 0)"
    assert unequal_steps({0: _state(grads), 1: _state(grads)}) == ""  # both in step 10: waiting for each other
    assert unequal_steps({0: _state("barrier"), 1: _state()}) == ""  # nobody in a DDP step
    assert unequal_steps({0: _state(grads), 1: _state(ddp_steps=10)}) == ""  # rank 1 has done step 10
    # A joined rank shadows the others' all-reduce: that is model.join() at work, not a hang.
    assert unequal_steps({0: _state("DDP gradient all-reduce of a joined rank (bucket 0)"), 1: _state()}) == ""


def test_a_plain_loop_counts_ddp_steps_a_trainer_its_own():
    beat = {"op": "", "seq": 14, "ticks": 0, "ddp_steps": 9}
    assert where(beat) == "outside any collective after #14, 9 DDP steps"
    assert where(dict(beat, ddp_steps=1)) == "outside any collective after #14, 1 DDP step"
    assert where(dict(beat, ticks=3)) == "outside any collective after #14, 3 steps"
    assert where(dict(beat, ddp_steps=0)) == "outside any collective after #14, 0 steps"
