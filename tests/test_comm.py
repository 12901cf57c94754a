"""Each collective against its definition on 1, 2, 3 and 4 ranks, plus timeouts and the debug cross-check."""

import pytest
import torch

import dptrain
from dptrain import comm
from dptrain.comm import CollectiveError
from dptrain.runtime.diagnostics import CollectiveMismatchError
from tests._dist import run_ranks, set_event, wait_event


def _value(rank):
    # Distinct, exactly representable values per rank and position.
    return torch.arange(4, dtype=torch.float64) + 10 * (rank + 1)


def _every_collective(rank):
    n = dptrain.world_size()
    out = {}
    t = _value(rank).clone()
    comm.broadcast(t, src=n - 1)
    out["broadcast"] = t
    for op in ("sum", "avg", "max", "min", "product"):
        t = _value(rank).clone()
        comm.all_reduce(t, op=op)
        out[f"all_reduce_{op}"] = t
    t = _value(rank).clone()
    work = comm.all_reduce(t, op="avg", async_op=True)
    if work is not None:
        work.wait()
    out["all_reduce_avg_async"] = t
    t = _value(rank).clone()
    comm.reduce(t, dst=0, op="sum")
    out["reduce"] = t if rank == 0 else None
    recv = torch.empty(4, dtype=torch.float64)
    parts = [_value(r) * 2 for r in range(n)] if rank == 0 else None
    comm.scatter(recv, parts, src=0)
    out["scatter"] = recv
    got = [torch.empty(4, dtype=torch.float64) for _ in range(n)] if rank == n - 1 else None
    comm.gather(_value(rank), got, dst=n - 1)
    out["gather"] = got
    lst = [torch.empty(4, dtype=torch.float64) for _ in range(n)]
    comm.all_gather(lst, _value(rank))
    out["all_gather"] = lst
    comm.barrier()
    out["all_gather_object"] = comm.all_gather_object({"rank": rank, "tag": "x" * rank})
    out["broadcast_object"] = comm.broadcast_object({"from": rank} if rank == 0 else None, src=0)
    uneven = torch.full((rank + 1, 2), float(rank))
    out["all_gather_uneven"] = comm.all_gather_uneven(uneven)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_matches_its_definition(n):
    results = run_ranks(_every_collective, n)
    values = [_value(r) for r in range(n)]
    total = sum(values)
    prod = values[0].clone()
    for v in values[1:]:
        prod = prod * v
    for rank, out in enumerate(results):
        assert torch.equal(out["broadcast"], values[n - 1])
        assert torch.equal(out["all_reduce_sum"], total)
        assert torch.equal(out["all_reduce_avg"], total / n)
        assert torch.equal(out["all_reduce_avg_async"], total / n)
        assert torch.equal(out["all_reduce_max"], values[-1])
        assert torch.equal(out["all_reduce_min"], values[0])
        assert torch.equal(out["all_reduce_product"], prod)
        assert torch.equal(out["scatter"], values[rank] * 2)
        assert torch.equal(torch.stack(out["all_gather"]), torch.stack(values))
        assert out["all_gather_object"] == [{"rank": r, "tag": "x" * r} for r in range(n)]
        assert out["broadcast_object"] == {"from": 0}
        assert [t.tolist() for t in out["all_gather_uneven"]] == [[[float(r)] * 2] * (r + 1) for r in range(n)]
    assert torch.equal(results[0]["reduce"], total)
    assert torch.equal(torch.stack(results[n - 1]["gather"]), torch.stack(values))


def _objects_of_every_size(rank):
    import torch.distributed as dist

    n = dptrain.world_size()
    slot = comm._OBJECT_SLOT
    out = {}
    # Around the one-exchange slot: every pickle fits, one does not, all do not; and empty-ish ones.
    for name, size in (("tiny", 0), ("fits", slot - 200), ("edge", slot - 8 - 60), ("over", slot + 1),
                       ("large", 3 * slot)):
        mine = {"rank": rank, "pad": bytes([rank]) * (size if rank == n - 1 else size // 2)}
        out[f"all_gather_object/{name}"] = comm.all_gather_object(mine)
        out[f"broadcast_object/{name}"] = comm.broadcast_object(mine if rank == n - 1 else None, src=n - 1)
    out["tensor"] = comm.all_gather_object({"t": torch.arange(3.0) + rank})
    out["none"] = comm.broadcast_object(None, src=0)
    # A group of the odd ranks: ``src`` is a global rank, as in torch.
    odd = dist.new_group([r for r in range(n) if r % 2 == 1])
    if rank % 2 == 1:
        out["group"] = comm.all_gather_object(("odd", rank), group=odd)
        out["group_b"] = comm.broadcast_object("from 1" if rank == 1 else None, src=1, group=odd)
    return out


def test_the_one_exchange_slot_shrinks_on_large_groups():
    assert comm._slot_size(2) == comm._slot_size(64) == comm._OBJECT_SLOT
    assert comm._slot_size(128) == 2048 and comm._slot_size(4096) == 256  # 256 KiB in all, 256 bytes at least


@pytest.mark.parametrize("n", [2, 3])
def test_object_collectives_of_every_size_equal_torchs_definition(n):
    slot = comm._OBJECT_SLOT
    results = run_ranks(_objects_of_every_size, n)
    for rank, out in enumerate(results):
        for name, size in (("tiny", 0), ("fits", slot - 200), ("edge", slot - 8 - 60), ("over", slot + 1),
                           ("large", 3 * slot)):
            want = [{"rank": r, "pad": bytes([r]) * (size if r == n - 1 else size // 2)} for r in range(n)]
            assert out[f"all_gather_object/{name}"] == want, name
            assert out[f"broadcast_object/{name}"] == want[n - 1], name
        assert [d["t"].tolist() for d in out["tensor"]] == [[r, r + 1.0, r + 2.0] for r in range(n)]
        assert out["none"] is None
        if rank % 2 == 1:
            assert out["group"] == [("odd", r) for r in range(n) if r % 2 == 1]
            assert out["group_b"] == "from 1"


def test_collectives_without_process_group():
    assert not comm.is_distributed()
    t = torch.ones(3)
    comm.all_reduce(t, op="avg")
    comm.broadcast(t, src=0)
    comm.barrier()
    assert torch.equal(t, torch.ones(3))
    out = [torch.empty(3)]
    comm.all_gather(out, t)
    assert torch.equal(out[0], t)
    assert comm.all_gather_object(5) == [5]
    assert comm.broadcast_object("x") == "x"
    assert torch.equal(comm.all_gather_uneven(torch.ones(2, 3))[0], torch.ones(2, 3))


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="unknown reduce op 'median'"):
        comm.all_reduce(torch.ones(1), op="median")
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        comm.all_reduce([1.0])
    with pytest.raises(ValueError, match="scatter_list of 1 tensors"):
        comm.scatter(torch.ones(1), None, src=0)
    with pytest.raises(ValueError, match="tensor_list of 1 tensors"):
        comm.all_gather([], torch.ones(1))
    with pytest.raises(ValueError, match="1 to 8 dimensions"):
        comm.all_gather_uneven(torch.tensor(1.0))


def _uneven_trailing_mismatch(rank):
    with pytest.raises(ValueError) as info:
        comm.all_gather_uneven(torch.zeros(2, 3 + rank))
    return str(info.value)


def test_all_gather_uneven_rejects_different_trailing_shapes_on_every_rank():
    msgs = run_ranks(_uneven_trailing_mismatch, 2)
    for m in msgs:
        assert "rank 0: (2, 3), rank 1: (2, 4)" in m


def _stall_until_the_others_failed(rank, events):
    if rank == 1:
        # Stalled outside any collective until both peers' all_reduce has failed: the timeout
        # must fire while this rank is still away, never because it arrived.
        wait_event(events / "0")
        wait_event(events / "2")
        return "arrived after both peers had failed"
    with pytest.raises(CollectiveError) as info:
        comm.all_reduce(torch.ones(3))
    set_event(events / str(rank))
    return str(info.value)


def test_stalled_rank_fails_the_others_by_the_timeout_and_is_named(tmp_path):
    out = run_ranks(_stall_until_the_others_failed, 3, tmp_path,
                    env={"DPTRAIN_TIMEOUT": "2", "DPTRAIN_HEARTBEAT_S": "0.2"}, timeout=60)
    assert out[1] == "arrived after both peers had failed"
    for rank in (0, 2):
        msg = out[rank]
        assert msg.startswith(f"rank {rank}: all_reduce #1 failed ("), msg
        assert "rank 1 did not arrive" in msg and "outside any collective" in msg, msg
        assert "rank 0 did not arrive" not in msg and "rank 2 did not arrive" not in msg, msg
        assert "Timed out waiting 2000ms" in msg, msg  # gloo's own words: the 2 s timeout fired


def _mismatched_shapes(rank):
    with pytest.raises(CollectiveMismatchError) as info:
        comm.all_reduce(torch.ones(3 + rank))
    return str(info.value)


def _mismatched_ops(rank):
    with pytest.raises(CollectiveMismatchError) as info:
        if rank == 0:
            comm.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2))
        else:
            comm.barrier()
    return str(info.value)


def test_debug_mode_spells_out_shape_mismatch_on_every_rank():
    msgs = run_ranks(_mismatched_shapes, 2, env={"DPTRAIN_DEBUG": "1"})
    for rank, m in enumerate(msgs):
        assert m.startswith(f"rank {rank}: collective #0 differs between ranks")
        assert "rank 0: all_reduce((3,) float32); rank 1: all_reduce((4,) float32)" in m


def test_debug_mode_spells_out_different_collectives_on_every_rank():
    msgs = run_ranks(_mismatched_ops, 2, env={"DPTRAIN_DEBUG": "1"})
    for m in msgs:
        assert "rank 0: all_gather((2,) float32); rank 1: barrier(no tensors)" in m


def _debug_matching(rank):
    t = torch.ones(3)
    for _ in range(3):
        comm.all_reduce(t)
    return t


def test_debug_mode_passes_matching_collectives():
    assert all(torch.equal(t, torch.full((3,), 8.0)) for t in run_ranks(_debug_matching, 2, env={"DPTRAIN_DEBUG": "1"}))
