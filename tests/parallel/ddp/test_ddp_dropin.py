"""What a PyTorch DDP user writes, run on our DDP and on PyTorch's in the same processes.

Constructor signature and arguments, pickling and deep copies, gradient penalties and
``backward(create_graph=True)``, ignored parameters, the module surface (``module``,
``state_dict``, hooks, ``train``/``eval``) and the error types and texts. Compile, bucket
rebuild and a whole training script have their own files.
"""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import dptrain
from tests._dist import run_ranks
from tests.parallel.ddp._torch_args import TORCH_DDP_ARGS, torch_accepts
from tests.parallel.ddp._ddp_models import MODELS, BNNet, build_pair, make_batch, make_optimizer, snapshot, train_step

TorchDDP = nn.parallel.DistributedDataParallel
BOTH = (("ours", dptrain.DDP), ("torch", TorchDDP))


def _same(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys(), label
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, f"{label}: {k}"
        else:
            assert torch.equal(a[k], b[k]), f"{label}: {k} differs by {(a[k].float() - b[k].float()).abs().max()}"


def _steps(model, opt, rank, first, n):
    for step in range(first, first + n):
        train_step(model, opt, *make_batch("mlp", rank, step, batch=6))


# ---------------------------------------------------------------------------- signature
# dptrain's own constructor arguments: keyword only, after all of PyTorch's, so no call
# written for PyTorch can reach them.
_EXTENSIONS = {"shm", "compression", "overlap_optimizer"}


def test_constructor_signature_is_the_installed_torchs():
    """Names, order, kinds and defaults of the installed PyTorch's constructor, exactly, then ours."""
    ours = list(inspect.signature(dptrain.DDP.__init__).parameters.values())
    theirs = list(inspect.signature(TorchDDP.__init__).parameters.values())
    shared = [(p.name, p.kind, p.default) for p in ours[: len(theirs)]]
    assert shared == [(p.name, p.kind, p.default) for p in theirs]
    extra = ours[len(theirs):]
    assert {p.name for p in extra} <= _EXTENSIONS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


def _warnings(rank):
    out = {}
    for kw in ({"broadcast_buffers": False}, {"broadcast_buffers": True, "forward_sync_buffers": False},
               {"forward_sync_buffers": False}, {"check_reduction": True}, {}):
        if not torch_accepts(kw):
            continue
        for name, cls in BOTH:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cls(nn.Linear(3, 3), **kw)
            mine = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
            out[(str(kw), name)] = [(w.category.__name__, str(w.message).split(".")[0]) for w in mine]
    return out


def test_deprecation_warnings_like_torch():
    got = run_ranks(_warnings, 2)[0]
    for key in {k for k, _ in got}:
        assert got[(key, "ours")] == got[(key, "torch")], key
    if "forward_sync_buffers" in TORCH_DDP_ARGS:  # deprecated since torch 2.13
        assert got[(str({"broadcast_buffers": False}), "ours")] == [("FutureWarning", "`broadcast_buffers` is deprecated")]
    else:
        assert got[(str({"broadcast_buffers": False}), "ours")] == []


def _init_options(rank):
    """init_sync / broadcast_buffers / forward_sync_buffers at construction: what gets broadcast."""
    out = {}
    for kw in ({"init_sync": False}, {"broadcast_buffers": False}, {"forward_sync_buffers": False}, {}):
        if not torch_accepts(kw):
            continue
        for name, cls in BOTH:
            torch.manual_seed(rank)  # different weights and statistics on every rank
            model = BNNet()
            model.bn.running_mean.fill_(float(rank))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = cls(model, **kw)
            out[(str(kw), name)] = {k: v.clone() for k, v in ddp.state_dict().items()}
    return out


def test_init_sync_and_buffer_flags_like_torch():
    r0, r1 = run_ranks(_init_options, 2)
    for key in {k for k, _ in r0}:
        for r in (r0, r1):
            _same(r[(key, "ours")], r[(key, "torch")], key)
    no_sync = str({"init_sync": False})
    if "init_sync" in TORCH_DDP_ARGS:
        assert not torch.equal(r0[(no_sync, "ours")]["module.a.weight"], r1[(no_sync, "ours")]["module.a.weight"])
    no_bufs = str({"broadcast_buffers": False})  # parameters broadcast, buffers kept per rank
    assert torch.equal(r0[(no_bufs, "ours")]["module.a.weight"], r1[(no_bufs, "ours")]["module.a.weight"])
    assert r1[(no_bufs, "ours")]["module.bn.running_mean"][0] == 1.0
    if "forward_sync_buffers" in TORCH_DDP_ARGS:
        assert r1[(str({"forward_sync_buffers": False}), "ours")]["module.bn.running_mean"][0] == 0.0


# ---------------------------------------------------------------------------- copies
def _copies(rank):
    out = {}
    for name, cls in BOTH:
        torch.manual_seed(7 + rank)
        ddp = cls(BNNet())
        opt = make_optimizer("sgd", ddp.parameters())
        _steps(ddp, opt, rank, 0, 1)
        twin = copy.deepcopy(ddp)  # e.g. a teacher that keeps training on its own
        twin_opt = make_optimizer("sgd", twin.parameters())
        twin_opt.load_state_dict(opt.state_dict())
        opt.zero_grad(set_to_none=True)
        _steps(twin, twin_opt, rank, 1, 3)
        untouched = all(p.grad is None for p in ddp.parameters())  # the copy's hooks are its own
        _steps(ddp, opt, rank, 1, 2)
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        loaded_opt = make_optimizer("sgd", loaded.parameters())
        _steps(loaded, loaded_opt, rank, 3, 2)
        out[name] = (snapshot(twin), snapshot(ddp), snapshot(loaded), untouched)
    # An EMA copy made by one rank alone: copying runs no collective, so nobody hangs. (Its
    # forward would broadcast buffers, as with PyTorch: one rank alone evaluates ema.module.)
    ddp = dptrain.DDP(BNNet())
    ema = copy.deepcopy(ddp) if rank == 0 else None
    opt = make_optimizer("sgd", ddp.parameters())
    _steps(ddp, opt, rank, 0, 2)
    if ema is not None:
        with torch.no_grad():
            for e, p in zip(ema.parameters(), ddp.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            ema.eval()
            ema.module(torch.randn(2, 6))
    return out


def test_deepcopy_and_torch_save_train_like_torch():
    for out in run_ranks(_copies, 2):
        for ours, theirs, label in zip(out["ours"][:3], out["torch"][:3], ("deepcopy", "original", "torch.load")):
            _same(ours, theirs, label)
        assert out["ours"][3] and out["torch"][3]


def _pickle_other_group(rank):
    group = dist.new_group([0, 1])
    errors = []
    for _, cls in BOTH:
        try:
            copy.deepcopy(cls(nn.Linear(2, 2), process_group=group))
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_pickling_on_another_group_raises_runtime_error_like_torch():
    for errors in run_ranks(_pickle_other_group, 2):
        assert len(errors) == 2 and "default process group" in errors[0]


# ---------------------------------------------------------------------------- higher order
def _penalty_step(model, opt, rank, step, kind):
    g = torch.Generator().manual_seed(100 * step + rank)
    real, fake = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
    opt.zero_grad()
    if kind == "wgan_gp":  # critic loss with a gradient penalty on interpolates
        alpha = torch.rand(6, 1, generator=g)
        mix = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grad_x,) = torch.autograd.grad(model(mix).sum(), mix, create_graph=True)
        penalty = ((grad_x.norm(2, dim=1) - 1) ** 2).mean()
        loss = model(fake).mean() - model(real).mean() + 10 * penalty
        loss.backward()
    elif kind == "grad_norm":  # penalise the norm of the parameter gradients
        loss = F.mse_loss(model(real), fake[:, :3])
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        (loss + 0.1 * sum(gr.pow(2).sum() for gr in grads)).backward()
    else:  # backward(create_graph=True), as higher-order methods call it
        F.mse_loss(model(real), fake[:, :3]).backward(create_graph=True)
    with torch.no_grad():
        opt.step()


def _higher_order(rank):
    out = {}
    for kind, make in (
        ("wgan_gp", lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))),
        ("grad_norm", lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))),
        ("create_graph_one_param", lambda: nn.Linear(6, 3, bias=False)),
        ("create_graph", lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))),
    ):
        for name, cls in BOTH:
            torch.manual_seed(3 + rank)
            model = cls(make())
            opt = make_optimizer("sgd", model.parameters())
            try:
                for step in range(3):
                    _penalty_step(model, opt, rank, step, kind)
                grads = [(p.grad.requires_grad, type(p.grad.grad_fn).__name__) for p in model.parameters()]
                out[(kind, name)] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, grads)
            except RuntimeError as exc:
                out[(kind, name)] = str(exc)
    # The averaged gradient of a multi-parameter model, where PyTorch's reducer fails: equal to
    # the plain backward's (the value does not depend on create_graph).
    for create_graph in (True, False):
        torch.manual_seed(3)
        model = dptrain.DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
        x, y = make_batch("mlp", rank, 0)
        F.cross_entropy(model(x), y).backward(create_graph=create_graph)
        out[("values", create_graph)] = [p.grad.detach().clone() for p in model.parameters()]
    return out


def test_gradient_penalties_and_create_graph_like_torch():
    for out in run_ranks(_higher_order, 2):
        for kind in ("wgan_gp", "grad_norm", "create_graph_one_param"):
            ours, theirs = out[(kind, "ours")], out[(kind, "torch")]
            assert not isinstance(ours, str), ours
            _same(ours[0], theirs[0], kind)
            if kind == "create_graph_one_param":  # .grad keeps requiring grad, as PyTorch leaves it
                assert ours[1] == theirs[1] == [(True, "CopyBackwards")]
        # PyTorch's reducer cannot copy a graph-carrying gradient into a shared bucket:
        assert "in-place operation" in out[("create_graph", "torch")]
        assert not isinstance(out[("create_graph", "ours")], str), out[("create_graph", "ours")]
        for a, b in zip(out[("values", True)], out[("values", False)]):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------- a user's gradient hooks
def _user_hook_drops_a_grad(rank):
    # A hook of the user's, registered after wrapping, sets the first-ready gradient (the last
    # layer's bias) to None before its bucket is full: PyTorch's reducer then sends zeros for
    # it and writes the average back into .grad; so must ours, not fail on the missing tensor.
    out = {}
    for flag in (False, True):
        ours, theirs = build_pair("mlp", rank, {"gradient_as_bucket_view": flag})
        for name, ddp in (("ours", ours), ("torch", theirs)):
            last = list(ddp.module.parameters())[-1]
            last.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            opt = make_optimizer("sgd", ddp.parameters())
            _steps(ddp, opt, rank, 0, 3)
            out[(name, flag)] = snapshot(ddp)
        # Dropped after its bucket left (the first layer's weight, the last gradient to arrive,
        # whose own hook sends the bucket): the average is written back as without the hook.
        for name, drop in (("plain", False), ("dropped late", True)):
            ddp = build_pair("mlp", rank, {"gradient_as_bucket_view": flag})[0]
            if drop:
                next(ddp.module.parameters()).register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            _steps(ddp, make_optimizer("sgd", ddp.parameters()), rank, 0, 3)
            out[(name, flag)] = snapshot(ddp)
    return out


def test_a_gradient_set_to_none_by_a_later_hook_still_gets_the_average():
    for out in run_ranks(_user_hook_drops_a_grad, 2):
        for flag in (False, True):
            _same(out[("ours", flag)], out[("torch", flag)], f"gradient_as_bucket_view={flag}")
            _same(out[("dropped late", flag)], out[("plain", flag)], f"late, gradient_as_bucket_view={flag}")


# ---------------------------------------------------------------------------- ignored parameters
def _ignored(rank):
    out = {}
    for name, cls in BOTH:
        torch.manual_seed(11 + rank)  # rank-dependent: ignored tensors stay different
        model = BNNet()
        cls._set_params_and_buffers_to_ignore_for_model(model, ["b.bias", "bn.running_mean"])
        ddp = cls(model)
        opt = make_optimizer("sgd", ddp.parameters())
        _steps(ddp, opt, rank, 0, 3)
        out[name] = snapshot(ddp)
    # Marked with PyTorch's function, wrapped by ours (libraries mark models for torch).
    torch.manual_seed(11 + rank)
    model = BNNet()
    TorchDDP._set_params_and_buffers_to_ignore_for_model(model, ["b.bias", "bn.running_mean"])
    ddp = dptrain.DDP(model)
    _steps(ddp, make_optimizer("sgd", ddp.parameters()), rank, 0, 3)
    out["torch-marked"] = snapshot(ddp)
    return out


def test_ignored_parameters_and_buffers_like_torch():
    r0, r1 = run_ranks(_ignored, 2)
    for r in (r0, r1):
        _same(r["ours"], r["torch"], "ignored")
        _same(r["torch-marked"], r["torch"], "marked with torch's function")
    # Ignored: neither broadcast nor averaged, so they differ between ranks; the rest agrees.
    assert not torch.equal(r0["ours"]["b.bias"], r1["ours"]["b.bias"])
    assert not torch.equal(r0["ours"]["bn.running_mean"], r1["ours"]["bn.running_mean"])
    assert torch.equal(r0["ours"]["b.weight"], r1["ours"]["b.weight"])


# ---------------------------------------------------------------------------- the module surface
def _surface(rank):
    out = {}
    for name, cls in BOTH:
        torch.manual_seed(5)
        inner = BNNet()
        ddp = cls(inner)
        calls = []
        inner.a.register_forward_hook(lambda mod, args, res: calls.append("inner"))
        ddp.register_forward_pre_hook(lambda mod, args: calls.append("outer"))
        ddp(torch.randn(4, 6)).sum().backward()
        plain = {k[len("module."):]: v.clone() for k, v in ddp.state_dict().items()}
        try:
            ddp.load_state_dict(plain)  # no "module." prefix: PyTorch refuses, so do we
            unprefixed = "loaded"
        except RuntimeError as exc:
            unprefixed = str(exc)
        ddp.load_state_dict({"module." + k: v for k, v in plain.items()})
        ddp.module.load_state_dict(plain)
        modes = [ddp.eval() is ddp, ddp.training, inner.bn.training, ddp.train() is ddp, inner.bn.training]
        out[name] = {
            "module_is_inner": ddp.module is inner,
            "keys": list(ddp.state_dict()),
            "named_parameters": [n for n, _ in ddp.named_parameters()],
            "parameters_are_inner": [p is q for p, q in zip(ddp.parameters(), inner.parameters())],
            "named_buffers": [n for n, _ in ddp.named_buffers()],
            "named_modules": [n for n, _ in ddp.named_modules()],
            "hooks": calls,
            "unprefixed": unprefixed,
            "modes": modes,
            "broadcast_buffers": ddp.broadcast_buffers,
            "will_sync": ddp.will_sync_module_buffers(),
        }
    return out


def test_module_surface_like_torch():
    for out in run_ranks(_surface, 2):
        assert out["ours"] == out["torch"]
        assert out["ours"]["module_is_inner"] and out["ours"]["hooks"] == ["outer", "inner"]


# ---------------------------------------------------------------------------- errors
class _Grows(nn.Module):
    """Uses 'extra' from the second call on: a graph that changes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.relu(self.a(x))
        if self.calls > 1:
            h = h + self.extra(h)
        return self.b(h)


def _error(fn):
    try:
        fn()
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return None


def _errors(rank):
    out = {}
    x, y = make_batch("mlp", rank, 0)
    for name, cls in BOTH:
        out[("frozen", name)] = _error(lambda: cls(nn.Linear(3, 3).requires_grad_(False)))
        unused = cls(_Grows())  # 'extra' unused, without find_unused_parameters
        F.cross_entropy(unused(x), y).backward()
        unused.module.calls = -5
        out[("unused", name)] = _error(lambda: unused(x))
        static = cls(_Grows(), static_graph=True)
        out[("static", name)] = _error(lambda: [F.cross_entropy(static(x), y).backward() for _ in range(3)])
        if name == "torch":
            # PyTorch's C++ reducer is left mid-backward; let the pending all-reduces finish
            # on both ranks before the process group goes away.
            dist.barrier()
    # A gradient twice in one backward (reentrant checkpointing reuses 'b'), no static_graph.
    ours, theirs = build_pair("ckpt_twice", rank, {})
    for name, model in (("ours", ours), ("torch", theirs)):
        xc, yc = make_batch("ckpt_twice", rank, 0)
        out[("twice", name)] = _error(lambda: F.cross_entropy(model(xc), yc).backward())
        dist.barrier()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, cls in BOTH:
        out[("group_and_mesh", name)] = _error(lambda: cls(nn.Linear(3, 3), process_group=dist.group.WORLD,
                                                           device_mesh=mesh))
    mismatch = nn.Linear(3, 3 + rank)
    out[("mismatch", "ours")] = _error(lambda: dptrain.DDP(mismatch))
    return out


def test_errors_have_torchs_types_and_say_what_is_wrong():
    from dptrain.parallel.ddp import DDPSetupError

    for rank, out in enumerate(run_ranks(_errors, 2)):
        for kind in ("frozen", "unused", "static", "group_and_mesh"):
            assert out[(kind, "torch")] is not None and out[(kind, "ours")] is not None, kind
        assert out[("frozen", "ours")][0] == DDPSetupError.__name__
        assert issubclass(DDPSetupError, RuntimeError) and issubclass(DDPSetupError, ValueError)
        # The parameter indices, as PyTorch gives them, beside the names.
        torch_unused, ours_unused = out[("unused", "torch")][1], out[("unused", "ours")][1]
        indices = f"Parameter indices which did not receive grad for rank {rank}: 2 3"
        assert indices in torch_unused and indices in ours_unused
        names = f"Parameters which did not receive grad for rank {rank}: extra.weight, extra.bias\n"
        assert names in ours_unused and "find_unused_parameters=True" in ours_unused
        # PyTorch's wording first, so that searches for PyTorch's message find ours (issue 21).
        torch_phrase = "Expected to have finished reduction in the prior iteration before starting a new one."
        assert torch_phrase in torch_unused and torch_phrase in ours_unused
        assert "`forward` function outputs participate in calculating loss" in ours_unused
        # A static graph that changes: what changed, not "pass static_graph=True".
        static = out[("static", "ours")][1]
        torch_phrase = "Your training graph has changed in this iteration"
        assert torch_phrase in out[("static", "torch")][1] and torch_phrase in static
        assert "graph changed although static_graph=True" in static and "parameter 'extra.bias' (index 3)" in static
        assert "it was unused then" in static and "Pass static_graph=True" not in static
        assert out[("mismatch", "ours")][0] == DDPSetupError.__name__ and "rank 1" in out[("mismatch", "ours")][1]
        assert out[("mismatch", "ours")][1].startswith("DDP expects same model across all ranks, but rank ")
        for phrase in ("Expected to mark a variable ready only once", "has been marked as ready twice"):
            assert phrase in out[("twice", "torch")][1] and phrase in out[("twice", "ours")][1], phrase
        assert "static_graph=True" in out[("twice", "ours")][1]


# ---------------------------------------------------------------------------- PyTorch 2.13's newer arguments
class _Never(nn.Module):
    """'never' is unused on every rank: its own bucket is skipped with skip_all_reduce_unused_params."""

    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(6, 6)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _waiting_delayed_hook(self, grad):
    # Why the reference is altered here, and only here: PyTorch's delayed all-reduce hook
    # launches its all-reduce and never waits for it -- on a GPU the stream orders it before
    # the optimizer, on CPU nothing does, so the optimizer races with gloo's thread (a barrier
    # between backward and step did not make it deterministic: 2 of 3 runs differed). This copy
    # is the shipped hook plus the wait; test_the_delayed_reference_is_torchs_hook_plus_a_wait
    # checks the shipped hook still does exactly that (divide, then one async all-reduce).
    self._delay_grad_buffer.div_(dist.get_world_size(self.process_group))
    dist.all_reduce(self._delay_grad_buffer, group=self.process_group)
    return grad


def _new_arguments(rank):
    from torch.distributed.device_mesh import init_device_mesh

    TorchDDP._delayed_all_reduce_hook = _waiting_delayed_hook

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    configs = {
        "batched": lambda m: {"batched_grad_copy": True},
        "batched_view": lambda m: {"batched_grad_copy": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.0002},
        "skip_unused": lambda m: {"skip_all_reduce_unused_params": True, "find_unused_parameters": True,
                                  "bucket_cap_mb": 0.0001},
        "device_mesh": lambda m: {"device_mesh": mesh},
        "delayed": lambda m: {"delay_all_reduce_named_params": [("b.weight", m.b.weight), ("b.bias", m.b.bias)],
                              "param_to_hook_all_reduce": m.a.weight},
    }
    out = {}
    for label, kwargs in configs.items():
        if not torch_accepts(kwargs(_Never())):
            continue  # an argument of a later torch than the installed one
        for name, cls in BOTH:
            torch.manual_seed(21 + rank)
            model = _Never()
            if label != "skip_unused":
                model.never.requires_grad_(False)
            ddp = cls(model, **kwargs(model))
            opt = make_optimizer("sgd", ddp.parameters())
            for step in range(3):
                if step == 1:
                    with ddp.no_sync():
                        x, y = make_batch("mlp", rank, 10 + step)
                        F.cross_entropy(ddp(x), y).backward()
                train_step(ddp, opt, *make_batch("mlp", rank, step))
            out[(label, name)] = snapshot(ddp)
            if name == "ours" and label == "skip_unused":
                out["skipped buckets"] = sum(w is None for w in ddp.reducer._works)
    return out


def test_newer_constructor_arguments_like_torch():
    for out in run_ranks(_new_arguments, 2):
        for label in {k[0] for k in out if isinstance(k, tuple)}:
            _same(out[(label, "ours")], out[(label, "torch")], label)
        if ("skip_unused", "ours") in out:
            assert out[("skip_unused", "ours")]["grad:never.weight"] is None
            assert out["skipped buckets"] == 1  # 'never.weight' alone in its bucket: not all-reduced


def test_the_delayed_reference_is_torchs_hook_plus_a_wait():
    import inspect

    source = inspect.getsource(TorchDDP._delayed_all_reduce_hook)
    body = [line.strip() for line in source.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    assert body == [
        "world_size = dist.get_world_size(self.process_group)",
        "self._delay_grad_buffer.div_(world_size)  # type: ignore[union-attr]",
        "_ = dist.all_reduce(",
        "self._delay_grad_buffer, group=self.process_group, async_op=True",
        ")",
        "return grad",
    ], "PyTorch's delayed all-reduce hook changed: update _waiting_delayed_hook to match it\n" + source


def _mixed_precision(rank):
    from torch.nn.parallel.distributed import _MixedPrecision

    low, ws = torch.bfloat16, dist.get_world_size()
    torch.manual_seed(4)
    base = BNNet()
    ddp = dptrain.DDP(copy.deepcopy(base), mixed_precision=_MixedPrecision(low, torch.float32, low))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # By hand: a bf16 replica for forward/backward, fp32 masters stepped by SGD, gradients
    # summed in fp32 and divided after the sum, bf16 buffers broadcast from rank 0.
    masters = copy.deepcopy(base)
    replica = copy.deepcopy(base).to(low)
    ref_opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    dtypes = []
    for step in range(3):
        x, y = make_batch("mlp", rank, step, batch=6)
        out = ddp(x)
        F.cross_entropy(out.float(), y).backward()
        dtypes.append((out.dtype, [p.dtype for p in ddp.parameters()], [p.grad.dtype for p in ddp.parameters()]))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for r, m in zip(replica.parameters(), masters.parameters()):
                r.copy_(m)
        for b in replica.buffers():
            dist.broadcast(b, 0)
        F.cross_entropy(replica(x.to(low)).float(), y).backward()
        for r, m in zip(replica.parameters(), masters.parameters()):
            m.grad = r.grad.float()
            dist.all_reduce(m.grad)
            m.grad.div_(ws)
            r.grad = None
        ref_opt.step()
    with torch.no_grad():
        ddp.eval()
        ddp(torch.randn(2, 6))  # a forward without backward leaves full precision behind
    for b in replica.buffers():
        dist.broadcast(b, 0)  # that forward's buffer broadcast
    ours = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    ref = dict(masters.named_parameters(), **dict(replica.named_buffers()))
    return ours, {k: v.detach().clone() for k, v in ref.items()}, dtypes


def test_mixed_precision_reduces_like_torchs_recipe():
    # PyTorch's own DDP mixed precision needs CUDA events (it fails on CPU), so on CPU the
    # reference is its recipe written out by hand: bf16 replica, fp32 masters, gradients summed
    # in fp32 and divided after. That copy is checked against PyTorch's real implementation on
    # CUDA by tests/gpu/test_gpu.py::test_mixed_precision_against_torchs_on_cuda (GPU tier).
    for ours, ref, dtypes in run_ranks(_mixed_precision, 2):
        for k in ref:
            if "num_batches" not in k:
                assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k
        assert ours["a.weight"].dtype == torch.float32 and ours["bn.running_mean"].dtype == torch.bfloat16
        for out_dtype, param_dtypes, grad_dtypes in dtypes:
            assert out_dtype == torch.bfloat16
            assert set(param_dtypes) == set(grad_dtypes) == {torch.float32}


# ---------------------------------------------------------------------------- torch's names rebound
def _trained(rank, build, flag):
    torch.manual_seed(7 + rank)  # rank-dependent init: the constructor must broadcast rank 0's weights
    model = build(MODELS["mlp"](), device_ids=None, bucket_cap_mb=1, gradient_as_bucket_view=flag)
    _steps(model, make_optimizer("sgd", model.parameters()), rank, 0, 3)
    return model


def _rebound(rank):
    """Code one cannot edit, put on dptrain by rebinding both of torch's names to ours."""
    from torch.nn.parallel import distributed as torch_distributed

    from dptrain.train.config import TrainerConfig
    from dptrain.train.strategy import make_strategy

    original = (nn.parallel.DistributedDataParallel, torch_distributed.DistributedDataParallel)
    out = {}
    try:
        nn.parallel.DistributedDataParallel = dptrain.DDP
        torch_distributed.DistributedDataParallel = dptrain.DDP
        for flag in (False, True):
            ours = _trained(rank, lambda *a, **k: nn.parallel.DistributedDataParallel(*a, **k), flag)
            assert type(ours) is dptrain.DDP and isinstance(ours, torch_distributed.DistributedDataParallel)
            out[("rebound", flag)] = snapshot(ours)
        # The Trainer's "torch-ddp" strategy still means PyTorch's own class.
        strategy = make_strategy("torch-ddp", 2, torch.device("cpu"), TrainerConfig())
        out["strategy wraps in"] = type(strategy.wrap(nn.Linear(2, 2), 2))
    finally:
        nn.parallel.DistributedDataParallel, torch_distributed.DistributedDataParallel = original
    for flag in (False, True):
        out[("torch", flag)] = snapshot(_trained(rank, TorchDDP, flag))
    return out


def test_torchs_names_rebound_to_ours_train_bitwise_like_torch():
    """`torch.nn.parallel.DistributedDataParallel = dptrain.DDP` (both names): constructs and trains as torch's."""
    for out in run_ranks(_rebound, 2):
        for flag in (False, True):
            _same(out[("rebound", flag)], out[("torch", flag)], f"rebound, gradient_as_bucket_view={flag}")
        assert out["strategy wraps in"] is TorchDDP
