"""DistributedDataParallel against PyTorch's DDP and against single-process training.

Every rank function builds our DDP and PyTorch's on identical copies of one model and
trains both on the same per-rank data, one after the other in the same process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain.parallel import comm_hooks
from tests._dist import run_ranks
from tests.parallel.ddp._ddp_models import (
    EXTRA_MODELS,
    MODELS,
    build_pair,
    make_batch,
    make_optimizer,
    snapshot,
    train_step,
)

STEPS = 3

# (model, optimizer, DDP kwargs): every model with momentum SGD and default buckets, with
# Adam and tiny buckets (one parameter per bucket), and with gradient_as_bucket_view.
_KW = {"unused": {"find_unused_parameters": True}}
PARITY_CONFIGS = [
    (m, opt, {**_KW.get(m, {}), **extra})
    for m in MODELS
    for opt, extra in (
        ("sgd", {}),
        ("adam", {"bucket_cap_mb": 0.001}),
        ("sgd", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0002}),
    )
]


def _parity(rank, configs, steps):
    results = []
    for model, opt_name, kw in configs:
        ours, theirs = build_pair(model, rank, kw)
        opt_o = make_optimizer(opt_name, ours.parameters())
        opt_t = make_optimizer(opt_name, theirs.parameters())
        for step in range(steps):
            x, y = make_batch(model, rank, step)
            train_step(ours, opt_o, x, y)
            train_step(theirs, opt_t, x, y)
        results.append((snapshot(ours), snapshot(theirs)))
    return results


def _assert_same(ours: dict, theirs: dict, exact: bool, label: str) -> None:
    assert ours.keys() == theirs.keys(), label
    for k in ours:
        a, b = ours[k], theirs[k]
        if a is None or b is None:
            assert a is None and b is None, f"{label}: {k} is {a} vs {b}"
            continue
        if exact:
            assert torch.equal(a, b), f"{label}: {k} differs by {(a.float() - b.float()).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{label}: {k}")


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_parity_bitwise_two_ranks(shm):
    # One node: the shared-memory all-reduce is the default; DPTRAIN_SHM=0 is gloo's.
    results = run_ranks(_parity, 2, PARITY_CONFIGS, STEPS, env={"DPTRAIN_SHM": shm})
    for rank_results in results:
        for cfg, (ours, theirs) in zip(PARITY_CONFIGS, rank_results):
            _assert_same(ours, theirs, exact=True, label=str(cfg))
    # Ranks agree with each other too (the broadcast at construction + averaged grads);
    # BatchNorm statistics are not compared: the last forward updated them locally.
    for (o0, _), (o1, _) in zip(results[0], results[1]):
        for k in o0:
            if "running_" in k or "num_batches" in k:
                continue
            assert (o0[k] is None and o1[k] is None) or torch.equal(o0[k], o1[k]), k


@pytest.mark.parametrize("nprocs", [3, 4])
def test_parity_close_more_ranks(nprocs):
    configs = [
        # Adam is not used on the ConvNet: its conv bias (cancelled by BatchNorm) has
        # gradients of pure rounding noise, which Adam's normalisation blows up to lr-sized steps.
        ("mlp", "sgd", {}),
        ("convbn", "sgd", {"bucket_cap_mb": 0.001}),
        ("lstm", "adam", {"gradient_as_bucket_view": True}),
        ("unused", "adam", {"find_unused_parameters": True}),
        ("tied", "sgd", {}),
    ]
    results = run_ranks(_parity, nprocs, configs, 2)
    for cfg, (ours, theirs) in zip(configs, results[0]):
        _assert_same(ours, theirs, exact=False, label=str(cfg))


def _global_batch(rank):
    """DDP grads vs one process on the concatenated global batch (mean loss, equal shards)."""
    import torch.distributed as dist

    ws = dist.get_world_size()
    out = []
    for model in ("mlp", "convbn", "lstm"):
        torch.manual_seed(3)
        base = MODELS[model]()
        ref = copy.deepcopy(base)
        ddp = dptrain.DDP(base, broadcast_buffers=True)
        x, y = make_batch(model, rank, 0)
        F.cross_entropy(ddp(x), y).backward()
        xs, ys = zip(*(make_batch(model, r, 0) for r in range(ws)))
        if model == "convbn":
            # BatchNorm statistics are per rank; compare against per-shard forwards.
            loss = sum(F.cross_entropy(ref(a), b) for a, b in zip(xs, ys)) / ws
        else:
            loss = F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        out.append(([p.grad for p in ddp.module.parameters()], [p.grad for p in ref.parameters()]))
    return out


def test_grads_equal_single_process_global_batch():
    for rank_out in run_ranks(_global_batch, 2):
        for ours, ref in rank_out:
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _no_sync(rank, micro):
    import torch.distributed as dist

    ws = dist.get_world_size()
    ours, theirs = build_pair("mlp", rank, {})
    ref = copy.deepcopy(ours.module)
    for model in (ours, theirs):
        with model.no_sync():
            for m in range(micro - 1):
                x, y = make_batch("mlp", rank, m)
                F.cross_entropy(model(x), y).backward()
        x, y = make_batch("mlp", rank, micro - 1)
        F.cross_entropy(model(x), y).backward()
    # Reference: the sum of every rank's micro-batch gradients, averaged over ranks.
    for r in range(ws):
        for m in range(micro):
            x, y = make_batch("mlp", r, m)
            (F.cross_entropy(ref(x), y) / ws).backward()
    grads = lambda mod: [p.grad.clone() for p in mod.parameters()]  # noqa: E731
    return grads(ours.module), grads(theirs.module), grads(ref)


def test_no_sync_accumulation_equals_large_batch():
    for ours, theirs, ref in run_ranks(_no_sync, 2, 3):
        for a, b, c in zip(ours, theirs, ref):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _join(rank, configs):
    num_batches = 3 if rank == 0 else 5
    results = []
    for model_name, kw, divide, hook in configs:
        ours, theirs = build_pair(model_name, rank, kw)
        out = []
        for model in (ours, theirs):
            if hook is not None:  # joined ranks shadow through the hook too
                model.register_comm_hook(None, hook)
            opt = make_optimizer("sgd", model.parameters())
            with model.join(divide_by_initial_world_size=divide):
                for step in range(num_batches):
                    x, y = make_batch(model_name, rank, step)
                    train_step(model, opt, x, y)
            out.append({k: v.clone() for k, v in model.module.state_dict().items()})
        results.append(out)
    return results


JOIN_CONFIGS = [
    ("convbn", {}, True, None),  # buffers come from the highest rank still training
    ("convbn", {"bucket_cap_mb": 0.0005}, False, None),  # divide by the ranks still training
    ("unused", {"find_unused_parameters": True}, True, None),
    ("mlp", {"bucket_cap_mb": 0.0005}, True, comm_hooks.fp16_compress_hook),
]


def test_join_uneven_inputs_matches_torch():
    results = run_ranks(_join, 2, JOIN_CONFIGS)
    for cfg, r0, r1 in zip(JOIN_CONFIGS, results[0], results[1]):
        for ours, theirs in (r0, r1):
            _assert_same(ours, theirs, exact=True, label=f"join {cfg}")
        # The model ends identical on both ranks (copied from the last joiner).
        _assert_same(r0[0], r1[0], exact=True, label=f"ranks agree {cfg}")


def _static_graph(rank):
    out = []
    for model, kw in (
        ("mlp", {"static_graph": True}),
        ("unused", {"static_graph": True}),
        ("ckpt", {}),  # reentrant checkpointing: hooks fire inside a nested backward
        ("ckpt_twice", {"static_graph": True}),  # 'b' receives its gradient twice per backward
    ):
        ours, theirs = build_pair(model, rank, kw)
        opt_o, opt_t = make_optimizer("sgd", ours.parameters()), make_optimizer("sgd", theirs.parameters())
        for step in range(3):
            # The static-graph contract: the same parameters are used every step.
            x, y = make_batch(model, 0, step)
            x = x.abs()
            train_step(ours, opt_o, x, y)
            train_step(theirs, opt_t, x, y)
        out.append((snapshot(ours), snapshot(theirs)))
    return out


def test_static_graph_and_checkpointing_match_torch():
    for rank_out in run_ranks(_static_graph, 2):
        for ours, theirs in rank_out:
            _assert_same(ours, theirs, exact=True, label="static_graph")
        # 'never' stays without a gradient, as with PyTorch.
        assert rank_out[1][0]["grad:never.weight"] is None


def _unused_grads(rank):
    res = []
    for name in ("unused", "two_heads"):
        ours, theirs = build_pair(name, rank, {"find_unused_parameters": True})
        for model in (ours, theirs):
            x, y = make_batch(name, rank, 0)
            x[0, 0] = 1.0 if rank == 0 else -1.0  # 'sometimes' used on rank 0 only
            out = model(x)
            F.cross_entropy(out[0] if name == "two_heads" else out, y).backward()  # 'aux' output unused
            res.append(snapshot(model))
    return res


def test_find_unused_globally_and_locally_unused():
    results = run_ranks(_unused_grads, 2)
    for ours, theirs, ours_heads, theirs_heads in results:
        _assert_same(ours, theirs, exact=True, label="unused")
        assert ours["grad:never.weight"] is None  # unused everywhere: untouched
        assert ours["grad:sometimes.weight"] is not None  # used on rank 0: averaged everywhere
        _assert_same(ours_heads, theirs_heads, exact=True, label="output left out of the loss")
        assert ours_heads["grad:aux.weight"] is None
    assert torch.equal(results[0][0]["grad:sometimes.weight"], results[1][0]["grad:sometimes.weight"])


def _mismatch(rank, kind):
    import torch.distributed as dist

    if kind == "shape":
        model = nn.Sequential(nn.Linear(4, 8 if rank != 1 else 9), nn.Linear(8 if rank != 1 else 9, 2))
    elif kind == "count":
        layers = [nn.Linear(4, 4) for _ in range(3 if rank == dist.get_world_size() - 1 else 2)]
        model = nn.Sequential(*layers)
    elif kind == "dtype":
        model = nn.Linear(4, 4).to(torch.float64 if rank == 2 else torch.float32)
    else:
        model = nn.Linear(4, 4)
    try:
        dptrain.DDP(model, bucket_cap_mb=1 if (kind == "setting" and rank == 1) else None)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "kind,nprocs,expect",
    [
        ("shape", 2, ["rank 1", "'0.weight'", "(9, 4)", "(8, 4)"]),
        ("count", 3, ["rank 2", "'2.weight'"]),
        ("dtype", 3, ["rank 2", "'weight'", "torch.float64"]),
        ("setting", 2, ["rank 1 passed bucket_cap_mb=1", "rank 0 passed bucket_cap_mb=None"]),
    ],
)
def test_mismatched_models_fail_on_every_rank(kind, nprocs, expect):
    messages = run_ranks(_mismatch, nprocs, kind, timeout=30)
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} did not raise"
        assert f"on rank {rank}" in msg
        for piece in expect:
            assert piece in msg, (piece, msg)


def _next_forward_error(ddp, x):
    """The error the forward after a faulty backward raises (None if it does not)."""
    try:
        ddp(x)
    except RuntimeError as exc:
        return str(exc)
    return None


def _unused_without_flag(rank):
    torch.manual_seed(0)
    ddp = dptrain.DDP(MODELS["unused"]())
    x, y = make_batch("unused", rank, 1)
    F.cross_entropy(ddp(x), y).backward()
    return _next_forward_error(ddp, x)


def test_unused_parameter_without_flag_raises_on_every_rank():
    for rank, msg in enumerate(run_ranks(_unused_without_flag, 2, timeout=30)):
        assert msg is not None
        assert f"rank {rank}" in msg and f"did not receive grad for rank {rank}: never.weight, never.bias" in msg
        assert "find_unused_parameters=True" in msg


def _single_process():
    """World of one (no process group): DDP is a transparent wrapper."""
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ref = copy.deepcopy(model)
    ddp = dptrain.DDP(model)
    x, y = make_batch("mlp", 0, 0)
    F.cross_entropy(ddp(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    return ddp, ref


def test_world_of_one_and_state_dict_prefix():
    ddp, ref = _single_process()
    for a, b in zip(ddp.module.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert ddp.module is not ref and isinstance(ddp.module, nn.Sequential)
    keys = list(ddp.state_dict())
    assert keys == ["module." + k for k in ref.state_dict()]
    with ddp.no_sync(), ddp.join():
        ddp(torch.randn(2, 6))


def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match="requires grad"):
        dptrain.DDP(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="device_ids"):
        dptrain.DDP(nn.Linear(2, 2), device_ids=[0])


def _unused_on_one_rank(rank):
    torch.manual_seed(0)
    model = MODELS["unused"]()
    model.never.requires_grad_(False)
    ddp = dptrain.DDP(model)
    x, y = make_batch("unused", rank, 0)
    x[0, 0] = 1.0 if rank == 0 else -1.0  # 'sometimes' used on rank 0 only
    F.cross_entropy(ddp(x), y).backward()
    return _next_forward_error(ddp, x)


def test_parameter_unused_on_one_rank_without_flag_fails_everywhere():
    msg0, msg1 = run_ranks(_unused_on_one_rank, 2, timeout=30)
    assert msg1 is not None and "on rank 1" in msg1 and "did not receive grad for rank 1: sometimes.weight" in msg1
    assert msg0 is not None and "on rank 0" in msg0 and "1 other rank(s)" in msg0
    assert "find_unused_parameters=True" in msg0


def _twice_without_static(rank):
    torch.manual_seed(0)
    ddp = dptrain.DDP(EXTRA_MODELS["ckpt_twice"]())
    x, y = make_batch("mlp", rank, 0)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_gradient_twice_without_static_graph_is_a_clear_error():
    for rank, msg in enumerate(run_ranks(_twice_without_static, 2, timeout=30)):
        assert msg is not None and f"rank {rank}" in msg and "parameter 'b." in msg and "static_graph=True" in msg


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("local", torch.zeros(3))
        self.register_buffer("gone", torch.zeros(3))

    def forward(self, x):
        return self.linear(x) * self.scale


def _reassigned_buffers(rank):
    torch.manual_seed(0)
    m = _Scaled()
    dptrain.DDP._set_params_and_buffers_to_ignore_for_model(m, ["local"])
    ddp = dptrain.DDP(m)
    ddp(torch.randn(2, 3)).sum().backward()
    # After construction and a first step: a buffer replaced by a new tensor, one removed,
    # and one the user asked DDP to leave alone.
    m.scale = torch.full((3,), float(rank + 2))
    m.local = torch.full((3,), float(rank + 2))
    del m.gone
    ddp(torch.randn(2, 3)).sum().backward()
    return m.scale.tolist(), m.local.tolist()


def test_forward_broadcasts_the_buffers_a_module_holds_now():
    out = run_ranks(_reassigned_buffers, 2)
    assert [o[0] for o in out] == [[2.0] * 3, [2.0] * 3]  # rank 0's new buffer, on every rank
    assert [o[1] for o in out] == [[2.0] * 3, [3.0] * 3]  # an ignored buffer stays each rank's own
