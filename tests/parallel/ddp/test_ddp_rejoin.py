"""DDP across a re-formed process group: ``_recovery_layout``, ``_rejoin`` and ``joining_job``.

Each rank trains, then every rank destroys the default process group and creates the next
one on the same store under a new prefix (what in-place recovery does when a rank died); the
last rank plays the replacement: it throws its model, optimizer and DDP away and builds new
ones inside ``joining_job()`` from rank 0's state (sent over the new group, as the Trainer
sends it). Every rank calls ``_rejoin`` with rank 0's layout and training goes on. The final
parameters and buffers must be bitwise those of an uninterrupted run on the same ranks and
data. The model is defined in the reverse of its use (so the one-time bucket rebuild changes
the buckets) and has BatchNorm and Dropout; the optimizer is SGD with momentum.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel.distributed import _MixedPrecision

import dptrain
from dptrain.runtime import exit as _exit, env
from dptrain.parallel import comm_hooks
from dptrain.parallel.ddp import joining_job
from tests._dist import run_ranks

STEPS = 5
SMALL = 0.001  # MiB: several buckets for this model

# (DDP arguments, the step after which the group is re-formed). After 1 step the bucket
# rebuild is agreed but not done yet (the layout carries the order); after 3 it is done; a
# static graph has learnt its hook counts after 1.
CONFIGS = [
    ({"bucket_cap_mb": SMALL}, 1),
    ({"bucket_cap_mb": SMALL}, 3),
    ({}, 2),
    ({"static_graph": True, "bucket_cap_mb": SMALL}, 1),
    ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 2),
    ({"compression": "bf16", "bucket_cap_mb": SMALL}, 2),
    ({"mixed_precision": "bf16", "bucket_cap_mb": SMALL}, 1),
    ({"comm_hook": True, "bucket_cap_mb": SMALL}, 1),  # register_comm_hook(None, allreduce_hook)
]


class Net(nn.Module):
    """Defined head first, used stem first (gradients arrive in registration order)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.mid = nn.Linear(32, 16)
        self.bn = nn.BatchNorm1d(32)
        self.stem = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        return self.head(self.drop(torch.relu(self.mid(h))))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _step(ddp, opt, rank: int, step: int) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()


def _ddp(model, kw: dict):
    """The DDP of a config, as a script would build it (the test's own keys turned into arguments)."""
    kw = dict(kw)
    hook = kw.pop("comm_hook", False)
    if kw.get("mixed_precision") == "bf16":
        kw["mixed_precision"] = _MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    ddp = dptrain.DDP(model, **kw)
    if hook:
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
    return ddp


def _build(kw: dict):
    torch.manual_seed(0)
    model = Net()
    ddp = _ddp(model, kw)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reform(rank: int, generation: list) -> None:
    """Destroy the default group and create the next one on the same store, under a new prefix."""
    generation[0] += 1
    _exit.settle_before_destroy()
    dist.destroy_process_group()
    store = dist.PrefixStore(f"test_rejoin/gen{generation[0]}/", env._STATE.store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=env.world_size())


def _replace(rank: int, kw: dict, layout, model, opt):
    """Everyone gets rank 0's layout and state over the new group; the last rank rebuilds from it."""
    sent = [layout, _state(model), opt.state_dict()] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(sent, src=0)
    layout, module_state, opt_state = sent
    if rank != dist.get_world_size() - 1:
        return layout, None
    with torch.random.fork_rng():  # the dropout stream is the caller's state: not touched here
        torch.manual_seed(1234)  # other initial weights: only the state sent may count
        model = Net()
    model.load_state_dict(module_state)
    with joining_job():
        ddp = _ddp(model, kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(opt_state)
    return layout, (model, ddp, opt)


def _rejoin_run(rank: int, configs: list) -> list:
    out, generation = [], [0]
    for kw, k in configs:
        model, ddp, opt = _build(kw)
        torch.manual_seed(100 + rank)
        for step in range(STEPS):
            _step(ddp, opt, rank, step)
        reference = _state(model)

        model, ddp, opt = _build(kw)
        torch.manual_seed(100 + rank)
        for step in range(k):
            _step(ddp, opt, rank, step)
        layout = ddp._recovery_layout() if rank == 0 else None
        used_shm = ddp._shm is not None
        _reform(rank, generation)
        layout, fresh = _replace(rank, kw, layout, model, opt)
        if fresh is not None:
            del ddp
            model, ddp, opt = fresh
            assert ddp._shm is None  # joining_job: no vote on shared memory at construction
        ddp._rejoin(layout)
        assert (ddp._shm is not None) == used_shm
        assert all(p.grad is None for p in model.parameters())
        assert ddp.reducer.assignment == layout["reducer"]["assignment"]
        assert (ddp.reducer.comm_hook is not None) == bool(kw.get("comm_hook") or kw.get("compression")
                                                          or kw.get("mixed_precision"))
        for step in range(k, STEPS):
            _step(ddp, opt, rank, step)
        out.append((reference, _state(model), used_shm))
    return out


def _check(results: list, shm: str) -> None:
    for rank, per_config in enumerate(results):
        for (kw, k), (reference, recovered, used_shm) in zip(CONFIGS, per_config):
            assert used_shm == (shm == "1"), (kw, used_shm)
            for name, value in reference.items():
                assert torch.equal(value, recovered[name]), f"rank {rank}, {kw}, re-formed after {k}: {name} differs"


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_rejoin_bitwise_equal_to_uninterrupted(nprocs, shm):
    _check(run_ranks(_rejoin_run, nprocs, CONFIGS, env={"DPTRAIN_SHM": shm}), shm)


class _Abandon(Exception):
    """The failure this test injects in the middle of a backward."""


def _fail_backward(rank: int, where: str, ddp, model, x, y) -> None:
    """Make this step's backward raise _Abandon, at ``where``.

    "hook": rank 0 late, after the reducer launched buckets (whose collectives no other rank
    ever joins: with shared memory its worker waits in them), the others before any gradient
    reached the reducer. "finalize": every rank at the end of backward, after the all-reduces
    completed and some buckets were written back into ``.grad``, as when a peer dies there.
    """
    out = ddp(x)
    handles = []
    if where == "finalize":
        reducer, real_wait = ddp.reducer, ddp.reducer._wait

        def wait(bucket, work):
            source = real_wait(bucket, work)
            if bucket.index == len(reducer.buckets) - 1:
                raise _Abandon
            return source

        reducer._wait = wait
    elif rank == 0:
        def fail(p):
            raise _Abandon

        handles.append(model.stem.weight.register_post_accumulate_grad_hook(fail))  # the last gradient
    else:
        out.register_hook(lambda g: (_ for _ in ()).throw(_Abandon()))
    with pytest.raises(_Abandon):
        F.cross_entropy(out, y).backward()
    for h in handles:
        h.remove()
    ddp.reducer.__dict__.pop("_wait", None)


def _failed_backward_run(rank: int, where: str, k: int) -> dict:
    kw = {"bucket_cap_mb": SMALL}
    model, ddp, opt = _build(kw)
    torch.manual_seed(100 + rank)
    for step in range(STEPS):
        _step(ddp, opt, rank, step)
    reference = _state(model)

    generation = [0]
    model, ddp, opt = _build(kw)
    torch.manual_seed(100 + rank)
    for step in range(k):
        _step(ddp, opt, rank, step)
    # What the Trainer keeps of the step it may have to redo: the model's state (BatchNorm's
    # statistics move in forward) and the random stream (Dropout).
    before = (_state(model), torch.get_rng_state())
    layout_before = ddp._recovery_layout()
    opt.zero_grad(set_to_none=True)
    x, y = _batch(rank, k)
    _fail_backward(rank, where, ddp, model, x, y)
    old = ddp.reducer
    pending = [w for w in old._works if w is not None]
    info = {"phase": old.phase.value, "pending": len(pending), "iterations": old.num_iterations,
            "grads": sum(p.grad is not None for p in model.parameters())}
    layout = ddp._recovery_layout() if rank == 0 else None
    if rank == 0:
        info["layout_is_before"] = layout == layout_before
    old_shm = ddp._shm
    _reform(rank, generation)
    layout, fresh = _replace(rank, kw, layout, model, opt)
    if fresh is not None:
        del ddp, old
        model, ddp, opt = fresh
    t0 = time.monotonic()
    ddp._rejoin(layout)
    info["rejoin_s"] = time.monotonic() - t0
    info["grads_after"] = sum(p.grad is not None for p in model.parameters())
    info["phase_after"] = ddp.reducer.phase.value
    info["iterations_after"] = ddp.reducer.num_iterations
    if rank == 0 and old_shm is not None:
        # The abandoned collectives failed instead of waiting for the peers.
        info["old_worker_alive"] = old_shm._runner.thread.is_alive()
        info["pending_failed"] = all(w.is_completed() for w in pending)
    # The caller restores the step's state (from rank 0, as the Trainer would) and redoes it.
    state, rng = before
    sent = [state if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    model.load_state_dict(sent[0])
    torch.set_rng_state(rng)
    for step in range(k, STEPS):
        _step(ddp, opt, rank, step)
    info["differ"] = [n for n, v in reference.items() if not torch.equal(v, model.state_dict()[n])]
    return info


# "hook" after 2 steps: the bucket rebuild is behind; "finalize" in the very first backward,
# the one that records the gradient order: the rebuild must not be decided by it.
@pytest.mark.parametrize("where,k", [("hook", 2), ("finalize", 0)], ids=["in-backward", "in-finalize"])
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_rejoin_discards_a_failed_backward(shm, where, k):
    results = run_ranks(_failed_backward_run, 3, where, k, env={"DPTRAIN_SHM": shm})
    r0 = results[0]
    assert r0["grads"] > 0 and r0["pending"] > 0, r0  # a backward half done: gradients and collectives
    if where == "hook":
        assert r0["phase"] == "running", r0
    else:
        assert r0["iterations"] == k + 1, r0  # the failed backward counted itself before it failed
    assert r0["layout_is_before"], "the layout must be the one the failed backward started with"
    if shm == "1":
        assert r0["old_worker_alive"] is False and r0["pending_failed"], r0
    for rank, info in enumerate(results):
        assert info["grads_after"] == 0 and info["phase_after"] == "idle", (rank, info)
        assert info["iterations_after"] == k, (rank, info)
        assert info["rejoin_s"] < 5, (rank, info)
        assert info["differ"] == [], f"rank {rank}: differs from the uninterrupted run in {info['differ']}"


def _abort_run(rank: int) -> float | None:
    from dptrain._shm import ShmGroup, ShmPeerError

    group = ShmGroup.create(None, nbytes=1 << 16, what="test abort")
    assert group is not None
    waited = None
    if rank == 0:
        # A collective the peer, alive and holding its group open, never issues.
        work, later = group.all_reduce(group.zeros(64, torch.float32)), group.zeros(64, torch.float32)
        time.sleep(0.2)
        assert not work.is_completed()
        t0 = time.monotonic()
        assert group.abort("test") is True
        with pytest.raises(ShmPeerError, match="abandoned"):
            work.wait()
        waited = time.monotonic() - t0
        # A later collective is not started, with the error of a peer's failure: what aborts a group is
        # one (in-place recovery recovers from this type, not from a group closed by shutdown()).
        with pytest.raises(ShmPeerError, match=r"not started: the shared-memory group was aborted \(test\)"):
            group.all_reduce(later)
    dist.barrier()  # the peer keeps its group open until rank 0 is done
    group.close()
    return waited


def test_shm_abort_does_not_wait_for_a_live_peer():
    waited = run_ranks(_abort_run, 2, env={"DPTRAIN_SHM": "1"})[0]
    assert waited < 1.0, waited  # the collective timeout is 600 s; the wait slice 0.1 s


def _unsupported_run(rank: int) -> list:
    out = []
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw in ({"overlap_optimizer": opt}, {"compression": "powersgd"}, {"compression": "auto"}):
        ddp = dptrain.DDP(copy.deepcopy(model) if "overlap_optimizer" not in kw else model, **kw)
        with pytest.raises(NotImplementedError) as layout_error:
            ddp._recovery_layout()
        with pytest.raises(NotImplementedError) as rejoin_error:
            ddp._rejoin({"version": 1, "reducer": None, "compression_choice": None})
        assert ddp._recovery_obstacle() is not None
        out.append((str(layout_error.value), str(rejoin_error.value)))
    # A layout of another model is refused before the DDP is touched.
    ddp, other = dptrain.DDP(copy.deepcopy(model)), dptrain.DDP(nn.Linear(3, 3))
    reducer = ddp.reducer
    with pytest.raises(ValueError, match="same model"):
        ddp._rejoin(other._recovery_layout())
    assert ddp.reducer is reducer and reducer._handles
    return out


def test_rejoin_refuses_what_it_cannot_carry_over():
    results = run_ranks(_unsupported_run, 2)
    (overlap, _), (powersgd, _), (auto, auto_rejoin) = results[0]
    assert "overlap_optimizer" in overlap
    assert "powersgd" in powersgd
    assert "compression='auto'" in auto and "measuring" in auto_rejoin


def _pairs() -> tuple:
    """A group per pair of ranks ({0, 1}, {2, 3}), made on every rank in the same order; this rank's."""
    made = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return made[dist.get_rank() // 2]


def _subgroup_run(rank: int) -> tuple:
    """DDP over pairs of ranks (as DiLoCo's replica='node' builds it): re-formed after 2 steps, the pairs'
    groups made again, the last rank replaced from its pair's first rank, every rank rejoining its new pair."""
    kw = {"bucket_cap_mb": SMALL}
    torch.manual_seed(0)
    model = Net()
    ddp = dptrain.DDP(model, process_group=_pairs(), **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(100 + rank)
    for step in range(STEPS):
        _step(ddp, opt, rank, step)
    reference = _state(model)

    generation = [0]
    torch.manual_seed(0)
    model = Net()
    ddp = dptrain.DDP(model, process_group=_pairs(), **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(100 + rank)
    for step in range(2):
        _step(ddp, opt, rank, step)
    with pytest.raises(NotImplementedError, match="process_group=") as refused:
        ddp._recovery_layout()  # a group of its own that the caller does not say it makes again
    layout = ddp._recovery_layout(group_rebuilt=True)
    _reform(rank, generation)
    pair = _pairs()  # the caller makes the pairs' groups again, on every rank
    sent = [layout, _state(model), opt.state_dict()]
    dist.broadcast_object_list(sent, src=2)  # the last rank's pair: rank 2 holds what rank 3 held
    if rank == 3:
        _, module_state, opt_state = sent
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            model = Net()
        model.load_state_dict(module_state)
        with joining_job():
            ddp = dptrain.DDP(model, process_group=pair, **kw)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(opt_state)
        layout = sent[0]
    with pytest.raises(NotImplementedError, match="default process group"):
        ddp._rejoin(layout)  # without the new group it cannot follow
    ddp._rejoin(layout, process_group=pair)
    assert ddp.process_group is pair and ddp.reducer.assignment == layout["reducer"]["assignment"]
    for step in range(2, STEPS):
        _step(ddp, opt, rank, step)
    return reference, _state(model), str(refused.value)


def test_rejoin_onto_a_subgroup_the_caller_makes_again_is_bitwise_equal_to_uninterrupted():
    for rank, (reference, recovered, refused) in enumerate(run_ranks(_subgroup_run, 4)):
        assert "_rejoin(layout, process_group=...)" in refused
        for name, value in reference.items():
            assert torch.equal(value, recovered[name]), f"rank {rank}: {name} differs"
