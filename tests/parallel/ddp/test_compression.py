"""Gradient compression: PowerSGD against PyTorch's, ordering of the pipelined hooks, DDP(compression=...)."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F

import dptrain
from dptrain.parallel.ddp import _compression, comm_hooks
from tests._dist import run_ranks
from tests.parallel.ddp._torch_args import needs_torch_args


def _layers():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))


def _train(model, opt, rank, steps, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :16].flip(1)).backward()
        opt.step()


def _against_torch(rank):
    torch.manual_seed(0)
    base = _layers()
    out = {}
    for r in (1, 2, 4):
        params = {}
        for name, state, hook in (
            ("ours", comm_hooks.PowerSGDState(None, r, start_powerSGD_iter=2), comm_hooks.powerSGD_hook),
            ("torch", torch_powersgd.PowerSGDState(None, r, start_powerSGD_iter=2), torch_powersgd.powerSGD_hook),
        ):
            # One bucket: PyTorch's hook issues its Q all-reduce from a callback, which is only
            # safe on gloo when no other bucket's collective can be issued meanwhile.
            model = dptrain.DDP(copy.deepcopy(base), bucket_cap_mb=100)
            model.register_comm_hook(state, hook)
            _train(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, 5)
            params[name] = [p.detach().clone() for p in model.parameters()]
        out[r] = params
    # Ours on PyTorch's DDP, several buckets: the replicas stay identical.
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004)
    theirs.register_comm_hook(comm_hooks.PowerSGDState(None, 2, start_powerSGD_iter=2), comm_hooks.powerSGD_hook)
    _train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.05), rank, 5)
    out["on_torch_ddp"] = [p.detach().clone() for p in theirs.parameters()]
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "PyTorch's powerSGD_hook synchronizes CUDA whenever CUDA exists, so it fails on CPU tensors on a GPU "
    "machine; tests/gpu/test_gpu_paths.py compares ours with it on CUDA tensors there"))
def test_powersgd_matches_pytorchs_hook():
    """Same seeds, same algorithm: rank 1 bitwise, higher ranks to fp32 rounding (other matmul orders)."""
    results = run_ranks(_against_torch, 2)
    for out in results:
        for a, b in zip(out[1]["ours"], out[1]["torch"]):
            assert torch.equal(a, b)
        for r in (2, 4):
            for a, b in zip(out[r]["ours"], out[r]["torch"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0]["on_torch_ddp"], results[1]["on_torch_ddp"]):
        assert torch.equal(a, b)


def _convergence(rank):
    # A linear teacher of rank 16: rank-1 compression cannot represent one step's gradient;
    # error feedback carries what it dropped into the next steps.
    torch.manual_seed(0)
    teacher = torch.randn(64, 16) @ torch.randn(16, 64) / 32
    base = nn.Linear(64, 64, bias=False)
    finals = {}
    for name, feedback in (("fp32", None), ("powersgd", True), ("no_feedback", False)):
        model = dptrain.DDP(copy.deepcopy(base))
        if feedback is not None:
            state = comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=0, use_error_feedback=feedback)
            model.register_comm_hook(state, comm_hooks.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        g = torch.Generator().manual_seed(rank)
        for _ in range(200):
            x = torch.randn(32, 64, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), x @ teacher.t()).backward()
            opt.step()
        with torch.no_grad():
            x = torch.randn(512, 64, generator=torch.Generator().manual_seed(99))
            finals[name] = F.mse_loss(model(x), x @ teacher.t()).item()
    return finals


def test_powersgd_with_error_feedback_converges_like_fp32():
    """Stated tolerance: held-out loss within 0.05 of fp32's, from 3.4 at the start (fp32 reaches ~0.03)."""
    finals = run_ranks(_convergence, 2)[0]
    assert finals["fp32"] < 0.1, finals
    assert finals["powersgd"] < finals["fp32"] + 0.05, finals
    assert finals["no_feedback"] > 10 * finals["powersgd"], finals  # error feedback is what makes it work


class _Mixed(nn.Module):
    """Compressed matrices of two shapes, small matrices and vectors sent whole, in several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(40, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.small, self.norm = nn.Linear(64, 3), nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.small(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))))


def _as_plain_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return comm_hooks.powerSGD_hook(state, bucket)  # no reads_gradients: the reducer copies in and out


def _direct_against_copies(rank):
    """Ours on our DDP, where PowerSGD reads and writes .grad itself, against the same hook given
    the bucket's copies (wrapped, so the reducer does not know it): the parameters after each
    step, bit for bit, for several settings; and how many buckets went each way."""
    out = {}
    for key, kwargs in (("r1", dict(matrix_approximation_rank=1)), ("r4", dict(matrix_approximation_rank=4)),
                        ("no_feedback", dict(matrix_approximation_rank=2, use_error_feedback=False)),
                        ("cold", dict(matrix_approximation_rank=2, warm_start=False))):
        torch.manual_seed(0)
        base = _Mixed()
        runs = {}
        for way, hook in (("direct", comm_hooks.powerSGD_hook), ("copies", _as_plain_hook)):
            model = dptrain.DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
            model.register_comm_hook(comm_hooks.PowerSGDState(None, start_powerSGD_iter=2, **kwargs), hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(rank)
            steps, direct = [], 0
            for step in range(6):
                opt.zero_grad(set_to_none=step % 2 == 0)  # both: fresh gradients, and gradients kept
                model(torch.randn(8, 40, generator=g)).pow(2).mean().backward()
                direct += sum(model.reducer._direct)
                opt.step()
                steps.append([p.detach().clone() for p in model.parameters()])
            runs[way] = (steps, direct, len(model.reducer.buckets))
        (mine, direct, buckets), (theirs, copied, _) = runs["direct"], runs["copies"]
        out[key] = (all(torch.equal(a, b) for sa, sb in zip(mine, theirs) for a, b in zip(sa, sb)), direct, copied,
                    buckets)
    return out


def test_powersgd_reading_the_gradients_itself_gives_the_bits_of_the_copied_buckets():
    """The reducer's two copies skipped for PowerSGD (see [Note: a hook that reads the gradients
    itself]): the same parameters, bit for bit, on every step, and it did go that way."""
    for out in run_ranks(_direct_against_copies, 2):
        for key, (same, direct, copied, buckets) in out.items():
            assert buckets >= 3, key
            assert same, key
            # Steps 3-6 compress (start_powerSGD_iter=2): every bucket goes direct, never a wrapped one's;
            # without error feedback none (the products would read other memory: see _reads_gradients).
            assert direct == (0 if key == "no_feedback" else 4 * buckets) and copied == 0, (key, direct, copied)


def _sixteen_bits_against_copies(rank):
    """The same for the 16-bit hooks: cast from .grad and back into it, against the copied bucket."""
    out = {}
    for name, hook in (("bf16", comm_hooks.bf16_compress_hook), ("fp16", comm_hooks.fp16_compress_hook)):
        torch.manual_seed(0)
        base = _Mixed()
        runs = {}
        for way, registered in (("direct", hook), ("copies", lambda state, bucket, hook=hook: hook(state, bucket))):
            model = dptrain.DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
            model.register_comm_hook(None, registered)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(rank)
            direct = 0
            for step in range(4):
                opt.zero_grad(set_to_none=step % 2 == 0)
                model(torch.randn(8, 40, generator=g)).pow(2).mean().backward()
                direct += sum(model.reducer._direct)
                opt.step()
            runs[way] = ([p.detach().clone() for p in model.parameters()], direct, len(model.reducer.buckets))
        (mine, direct, buckets), (theirs, copied, _) = runs["direct"], runs["copies"]
        out[name] = (all(torch.equal(a, b) for a, b in zip(mine, theirs)), direct, copied, buckets)
    return out


def test_sixteen_bit_hooks_reading_the_gradients_themselves_give_the_bits_of_the_copied_buckets():
    for out in run_ranks(_sixteen_bits_against_copies, 2):
        for name, (same, direct, copied, buckets) in out.items():
            assert same, name
            # Every bucket of the 3 steps after the first (whose recording backward is not plain).
            assert buckets >= 3 and direct == 3 * buckets and copied == 0, (name, direct, copied, buckets)


def _direct_refused(rank):
    """Buckets that must keep the copies: gradient_as_bucket_view, and a backward with a parameter unused."""
    torch.manual_seed(0)
    out = {}
    views = dptrain.DDP(_Mixed(), bucket_cap_mb=0.02, gradient_as_bucket_view=True)
    views.register_comm_hook(comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=0), comm_hooks.powerSGD_hook)
    views(torch.randn(8, 40)).sum().backward()
    out["views"] = (sum(views.reducer._direct), all(
        p.grad.data_ptr() == v.data_ptr() for p, v in zip(views.reducer.params, views.reducer._views)))
    unused = dptrain.DDP(_TwoHeads(), bucket_cap_mb=0.0005, find_unused_parameters=True)
    unused.register_comm_hook(comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=0), comm_hooks.powerSGD_hook)
    unused(torch.randn(4, 16)).sum().backward()
    out["unused"] = (sum(unused.reducer._direct), unused.module.never.weight.grad, unused.module.first.weight.grad)
    return out


def test_powersgd_keeps_the_copies_where_the_gradients_are_not_plain():
    a, b = run_ranks(_direct_refused, 2)
    for out in (a, b):
        assert out["views"] == (0, True)  # .grad stays the bucket's view, as gradient_as_bucket_view asks
        assert out["unused"][0] == 0 and out["unused"][1] is None
    assert torch.equal(a["unused"][2], b["unused"][2])


class _Jittery(nn.Module):
    """Sleeps a random, rank-dependent moment in backward: buckets become ready at different times."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rng = random.Random(rank)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if x.requires_grad:
                x.register_hook(lambda g: time.sleep(self.rng.random() * 0.003))
        return x


def _ordering(rank):
    out = {}
    for name, make_state, hook in (
        ("powersgd", lambda: comm_hooks.PowerSGDState(None, 2, start_powerSGD_iter=1), comm_hooks.powerSGD_hook),
        ("bf16", lambda: None, comm_hooks.bf16_compress_hook),
    ):
        torch.manual_seed(0)
        model = _Jittery(rank)
        model = dptrain.DDP(model, bucket_cap_mb=0.002)  # one bucket per layer: many collectives in flight
        assert len(model.reducer.buckets) >= 6
        model.register_comm_hook(make_state(), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(8, 24, generator=g)).pow(2).mean().backward()
            opt.step()
        out[name] = [p.detach().clone() for p in model.parameters()]
    # Uneven inputs: rank 1 joins early and shadows the backward of rank 0 with PowerSGD.
    torch.manual_seed(0)
    model = dptrain.DDP(nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 24)), bucket_cap_mb=0.002)
    model.register_comm_hook(comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=0), comm_hooks.powerSGD_hook)
    with model.join():
        for _ in range(5 if rank == 0 else 2):
            model(torch.randn(4, 24)).sum().backward()
    out["joined"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_pipelined_hooks_issue_collectives_in_the_same_order_on_every_rank():
    """DPTRAIN_DEBUG=1 compares every collective of the hooks across ranks before it runs:
    a different order on one rank raises CollectiveMismatchError instead of passing."""
    results = run_ranks(_ordering, 2, env={"DPTRAIN_DEBUG": "1"})
    for key in ("powersgd", "bf16", "joined"):
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b), key


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        # With find_unused_parameters the buckets are filled in registration order and
        # launched in reverse: the first parameter registered forms the last bucket.
        self.never = nn.Linear(16, 16)
        self.first = nn.Linear(16, 16)

    def forward(self, x):
        return self.first(x)


def _skip_last(rank):
    # The last bucket is never launched (all its parameters unused), so PowerSGD never sees
    # is_last(): the reducer drains the pipeline itself instead of waiting forever.
    torch.manual_seed(0)
    ddp = dptrain.DDP(_TwoHeads(), bucket_cap_mb=0.0005, find_unused_parameters=True,
                      skip_all_reduce_unused_params=True)
    ddp.register_comm_hook(comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=0), comm_hooks.powerSGD_hook)
    for _ in range(3):
        ddp(torch.randn(4, 16)).sum().backward()
    return ddp.module.first.weight.grad.clone()


@needs_torch_args("skip_all_reduce_unused_params")
def test_powersgd_finishes_when_the_last_bucket_is_skipped():
    a, b = run_ranks(_skip_last, 2, timeout=60)
    assert torch.equal(a, b)


def _compression_argument(rank):
    torch.manual_seed(0)
    base = _layers()
    out = {}
    hooked = dptrain.DDP(copy.deepcopy(base))
    hooked.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    argument = dptrain.DDP(copy.deepcopy(base), compression="bf16")
    for m in (hooked, argument):
        _train(m, torch.optim.SGD(m.parameters(), lr=0.05), rank, 3)
    out["same_as_hook"] = all(torch.equal(a, b) for a, b in zip(hooked.parameters(), argument.parameters()))
    out["small_buckets"] = argument.reducer.bucket_limits == _compression.SMALL_BUCKET_LIMITS
    psgd = dptrain.DDP(copy.deepcopy(base), compression="powersgd")
    out["powersgd"] = (type(psgd.reducer.comm_hook_state).__name__, psgd.compression_choice)
    try:
        argument.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    except RuntimeError as exc:
        out["register"] = str(exc)
    try:
        dptrain.DDP(copy.deepcopy(base), compression="bf16" if rank == 0 else None)
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def test_compression_argument_installs_the_hooks():
    for out in run_ranks(_compression_argument, 2):
        assert out["same_as_hook"] and out["small_buckets"]
        assert out["powersgd"] == ("PowerSGDState", "powersgd")
        assert "DistributedDataParallel(compression='bf16') manages the communication hook" in out["register"]
        assert "compression" in out["mismatch"] and "different models" in out["mismatch"]


def test_compression_argument_rejects_bad_values():
    with pytest.raises(ValueError, match=r"compression='zstd' is not a gradient compression; use None"):
        _compression.check_compression("zstd")
    assert _compression.check_compression("BF16") == "bf16" and _compression.check_compression("none") is None
    mp = nn.parallel.distributed._MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mixed_precision cannot be combined with compression"):
        _compression.check_extensions(mp, "bf16", None)


def _auto_on_one_node(rank):
    torch.manual_seed(0)
    base = _layers()
    ours = dptrain.DDP(copy.deepcopy(base), compression="auto")
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    for m in (ours, theirs):
        _train(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), rank, 7)
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    return ours.compression_choice, ours._auto_compression.message, same


def test_auto_keeps_fp32_on_one_node_bitwise_like_pytorch():
    for choice, message, same in run_ranks(_auto_on_one_node, 2):
        assert choice is None and same
        assert message.startswith('dptrain: DDP compression="auto" chose fp32 in shared memory: all ranks on one node')


def test_auto_rule():
    fp32 = dict(window=0.03, exposed=0.3, backward=0.33, nbytes=33_600_000)
    assert _compression.decide(nodes=1, uses_shm=True, **fp32, trials={"fp32": 0.33})[0] == "fp32"
    # Several nodes, communication exposed: try bf16, then PowerSGD, then keep the fastest.
    assert _compression.decide(nodes=2, uses_shm=False, **fp32, trials={"fp32": 0.33}) == (None, "")
    assert _compression.decide(nodes=2, uses_shm=False, **fp32, trials={"fp32": 0.33, "bf16": 0.2})[0] is None
    choice, why = _compression.decide(nodes=2, uses_shm=False, **fp32,
                                      trials={"fp32": 0.33, "bf16": 0.2, "powersgd": 0.05})
    assert choice == "powersgd"
    assert why == ("PowerSGD rank 4 (2 nodes; 33.6 MB of gradients, 300 ms of communication after 30 ms of "
                   "backward; backward with communication: fp32 330 ms, bf16 200 ms, powersgd 50 ms)")
    assert _compression.decide(nodes=2, uses_shm=False, **fp32,
                               trials={"fp32": 0.33, "bf16": 0.2, "powersgd": 0.25})[0] == "bf16"
    # Compression that saves less than 5 % is not worth its rounding.
    assert _compression.decide(nodes=2, uses_shm=False, **fp32,
                               trials={"fp32": 0.33, "bf16": 0.32, "powersgd": 0.33})[0] == "fp32"
    hidden = dict(fp32, exposed=0.002)  # communication already hidden behind backward
    assert _compression.decide(nodes=2, uses_shm=False, **hidden, trials={"fp32": 0.33})[0] == "fp32"
