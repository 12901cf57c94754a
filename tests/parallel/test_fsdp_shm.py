"""FSDP's all-gather and reduce-scatter in shared memory when its ranks share one node (CPU).

The primitives are checked bitwise against the documented order, FSDP with shared memory
against FSDP over gloo (bitwise on two ranks, where a sum of two is the same either way), and
turning it off (``DPTRAIN_SHM=0``) against turning it on.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import dptrain
from dptrain import _shm
from dptrain.models import TinyTransformer, TransformerBlock
from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy
from tests._dist import run_ranks

ON = {"DPTRAIN_SHM": "1"}


def _primitives(rank):
    n = dist.get_world_size()
    # A region of one page: every collective below passes in several pieces.
    g = _shm.ShmGroup.create(None, 4096, what="test FSDP collectives")
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n * 1000, generator=gen) * 10.0 ** (3 * r) for r in range(n)]  # order shows in the bits
    expected = xs[0] + xs[1]
    for x in xs[2:]:
        expected = expected + x
    out = torch.empty(1000)
    g.reduce_scatter_into(out, xs[rank]).wait()
    shards = [torch.arange(2500.0) + 10_000 * r for r in range(n)]
    gathered = torch.empty(n * 2500)
    g.all_gather_into(gathered, shards[rank]).wait()
    gloo = torch.empty(1000)
    if n == 2:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(gloo, xs[rank].clone())
    results = (torch.equal(out, expected.chunk(n)[rank]), torch.equal(gathered, torch.cat(shards)),
               torch.equal(gloo, out) if n == 2 else None)
    with pytest.raises(dptrain.runtime.diagnostics.CollectiveMismatchError) as info:
        k = 501 if rank == 1 else 500
        g.reduce_scatter_into(out[:k], xs[rank][: n * k]).wait()
    with pytest.raises(ValueError, match="do not split into"):
        g.reduce_scatter_into(out, xs[rank][:-1])
    return (*results, str(info.value))


@pytest.mark.parametrize("nprocs", [2, 3])
def test_reduce_scatter_and_all_gather_in_shared_memory(nprocs):
    for rank, (scattered, gathered, same_as_gloo, mismatch) in enumerate(run_ranks(_primitives, nprocs, env=ON)):
        assert scattered and gathered
        assert same_as_gloo in (True, None)
        assert "reduce_scatter of" in mismatch and "the ranks called different shared-memory collectives" in mismatch


def _train(rank, shm=None):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, dim=16, depth=3, heads=2, max_len=8)
    fsdp = FSDP(copy.deepcopy(model), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), shm=shm)
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        opt.zero_grad()
        fsdp(torch.randint(0, 32, (2, 8), generator=gen)).logsumexp(-1).mean().backward()
        opt.step()
    state = fsdp.full_state_dict()
    return fsdp._shm is not None, {k: v.clone() for k, v in state.items()}


def test_fsdp_uses_shared_memory_on_one_node_and_trains_bitwise_like_gloo():
    on = run_ranks(_train, 2, env=ON)
    off = run_ranks(_train, 2, env={"DPTRAIN_SHM": "0"})
    assert [used for used, _ in on] == [True, True]
    assert [used for used, _ in off] == [False, False]
    ours, gloo = on[0][1], off[0][1]
    assert list(ours) == list(gloo) and len(ours) > 0
    assert all(torch.equal(ours[k], gloo[k]) for k in ours)


def test_the_shm_argument_turns_it_off_or_requires_it():
    assert [used for used, _ in run_ranks(_train, 2, False, env=ON)] == [False, False]
    assert [used for used, _ in run_ranks(_train, 2, True, env={"DPTRAIN_SHM": "0"})] == [True, True]
    with pytest.raises(TypeError, match="shm=...\\) takes None, True or False"):
        FSDP(torch.nn.Linear(2, 2), shm="yes")


def _nested(rank):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, dim=16, depth=2, heads=2, max_len=8)
    inner = [FSDP(block) for block in model.blocks]
    had = [m._shm is not None for m in inner]
    for i, m in enumerate(inner):
        model.blocks[i] = m
    outer = FSDP(model)
    loss = outer(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))).logsumexp(-1).mean()
    loss.backward()
    return had, [m._shm for m in inner], {id(u.shm) for u in outer._units} == {id(outer._shm)}


def test_nested_fsdp_keeps_one_segment_for_all_units():
    for had, inner_groups, one in run_ranks(_nested, 2, env=ON):
        assert had == [True, True]  # each inner wrapper made its own before it was nested...
        assert inner_groups == [None, None]  # ...and the outer closed them: its own serves every unit
        assert one
