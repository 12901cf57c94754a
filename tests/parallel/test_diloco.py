"""DiLoCo against DDP and against the arithmetic by hand: H = 1 is DDP, replicas part between
syncs and meet bitwise at each, a state_dict resumes bit for bit, Streaming DiLoCo's delayed
and mixed fragments equal a reference computed by hand, and the quantised forms stay within
half a step of their block."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP
from dptrain.parallel.diloco import _codec, _fragments
from tests._dist import run_ranks

SIZES = (8, 16, 16, 4)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(list(SIZES))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, SIZES[0], generator=g), torch.randn(6, SIZES[-1], generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _inner_step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# ---------------------------------------------------------------- H = 1 is DDP
def _h1_vs_ddp(rank):
    model = _model(seed=rank)  # unequal on purpose: DiLoCo starts every replica from rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = dptrain.DiLoCo(model, opt, sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    ddp = dptrain.DDP(_model(seed=0))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(6):
        _inner_step(model, opt, rank, step)
        diloco.step()
        _inner_step(ddp, ddp_opt, rank, step)
    return _flat(model), _flat(ddp.module), diloco.num_syncs


@pytest.mark.parametrize("nprocs", [2, 3])
def test_h1_without_momentum_equals_ddp_with_the_same_sgd(nprocs):
    for ours, ddp, syncs in run_ranks(_h1_vs_ddp, nprocs):
        assert syncs == 6
        torch.testing.assert_close(ours, ddp, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- replicas between and at syncs
def _h4_rounds(rank, compression):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = dptrain.DiLoCo(model, opt, sync_every=4, compression=compression)
    seen = []
    for step in range(1, 13):
        _inner_step(model, opt, rank, step)
        diloco.step()
        seen.append((step, _flat(model).clone()))
    return seen, diloco.bytes_sent, diloco.num_syncs


@pytest.mark.parametrize("nprocs,compression", [(2, "fp32"), (3, "fp32"), (3, "int8"), (2, "int4"), (2, "bf16")])
def test_h4_replicas_differ_between_syncs_and_are_bitwise_equal_after_each(nprocs, compression):
    results = run_ranks(_h4_rounds, nprocs, compression)
    first, bytes_sent, syncs = results[0]
    assert syncs == 3
    for other, _, _ in results[1:]:
        for (step, a), (_, b) in zip(first, other):
            if step % 4 == 0:
                assert torch.equal(a, b), f"replicas differ right after the sync at step {step}"
            else:
                assert not torch.equal(a, b), f"replicas equal at step {step}, between syncs"
    numel = sum(p.numel() for p in _model().parameters())
    n = nprocs
    per_sync = (2 * (n - 1) * 4 * numel // n if compression == "fp32"
                else (n - 1) * _codec.message_bytes(numel, compression))
    assert bytes_sent == 3 * per_sync


# ---------------------------------------------------------------- state_dict resumes bit for bit
SETTINGS = dict(sync_every=4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.25)


def _resume(rank, stop_at):
    def build():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, dptrain.DiLoCo(model, opt, **SETTINGS)

    model, opt, diloco = build()
    for step in range(1, 14):
        if step == stop_at + 1:  # rebuild everything from the saved states, mid-round, an exchange in flight
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": opt.state_dict(), "diloco": diloco.state_dict()}
            pending = len(saved["diloco"]["pending"])
            torch.manual_seed(123)  # a fresh model, other weights: only the loaded state may count
            model, opt, diloco = build()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            diloco.load_state_dict(saved["diloco"])
        _inner_step(model, opt, rank, step)
        diloco.step()
    return _flat(model), diloco.num_syncs, pending if stop_at else None


def test_a_run_rebuilt_from_state_dict_mid_round_ends_bitwise_where_the_uninterrupted_one_ends():
    # Stop after step 6: fragment 0 of 2 started its exchange at step 6 (6 % 4 == 2) and applies at 7.
    whole = run_ranks(_resume, 2, 0)
    resumed = run_ranks(_resume, 2, 6)
    for (a, syncs_a, _), (b, syncs_b, pending) in zip(whole, resumed):
        assert pending == 1
        assert syncs_a == syncs_b
        assert torch.equal(a, b)


# ---------------------------------------------------------------- streaming by hand
def _streaming(rank, tau, alpha):
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) * 0.1 + i)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = dptrain.DiLoCo(model, opt, sync_every=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                            num_fragments=2, fragment_sync_delay=tau, fragment_update_alpha=alpha)
    trace = []
    for step in range(1, 11):
        for p in model.parameters():  # a known "gradient" per rank and step: the reference can redo it
            p.grad = torch.full_like(p, (rank + 1) * 0.01 * step) + p.detach() * 0.1
        opt.step()
        diloco.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    return trace, diloco._fragments


def _reference(tau, alpha, nranks=2):
    """Streaming DiLoCo written out: per rank weights, per fragment outer weights and momentum."""
    init = []
    shapes = [(2, 3), (2,), (1, 2)]
    for i, s in enumerate(shapes):
        n = torch.Size(s).numel()
        init.append(torch.arange(n, dtype=torch.float32).view(s) * 0.1 + i)
    frags = _fragments.split([torch.empty(s) for s in shapes], 2)
    offs = _fragments.offsets(4, 2)
    local = [[t.clone() for t in init] for _ in range(nranks)]
    outer = [t.clone() for t in init]
    mom = [None] * len(init)
    pending = []  # (apply_at, fragment, averaged pseudo-gradient per parameter)
    traces = [[] for _ in range(nranks)]
    for step in range(1, 11):
        for r in range(nranks):
            for i, p in enumerate(local[r]):
                local[r][i] = p - 0.05 * (torch.full_like(p, (r + 1) * 0.01 * step) + p * 0.1)

        def apply_due():
            for entry in [e for e in pending if e[0] == step]:
                pending.remove(entry)
                _, f, avg = entry
                for i in frags[f]:
                    g = avg[i]
                    mom[i] = g.clone() if mom[i] is None else 0.9 * mom[i] + g
                    outer[i] = outer[i] - 0.7 * (g + 0.9 * mom[i])
                    for r in range(nranks):
                        local[r][i] = torch.lerp(outer[i], local[r][i], alpha) if alpha else outer[i].clone()

        apply_due()
        for f, off in enumerate(offs):
            if step % 4 == off:
                avg = {i: sum(outer[i] - local[r][i] for r in range(nranks)) / nranks for i in frags[f]}
                pending.append((step + tau, f, avg))
        apply_due()
        for r in range(nranks):
            traces[r].append([p.clone() for p in local[r]])
    return traces


@pytest.mark.parametrize("tau,alpha", [(0, 0.0), (1, 0.0), (2, 0.25)])  # 0.25: not symmetric
def test_streaming_with_delay_and_mixing_equals_the_reference_by_hand(tau, alpha):
    results = run_ranks(_streaming, 2, tau, alpha)
    reference = _reference(tau, alpha)
    assert results[0][1] == [[0], [1, 2]]  # 6 elements, then 2 + 2
    for r, (trace, _) in enumerate(results):
        for step, (ours, ref) in enumerate(zip(trace, reference[r]), start=1):
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"rank {r} step {step}")


# ---------------------------------------------------------------- quantisation
@pytest.mark.parametrize("codec,qmax", [("int8", 127), ("int4", 7)])
def test_quantised_round_trip_stays_within_half_a_step_of_each_block(codec, qmax):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 1, 1000)  # blocks of very different scales
    x[256:384] = 0  # an all-zero block comes back as zeros
    message = _codec.encode(x, codec)
    assert message.numel() == _codec.message_bytes(x.numel(), codec)
    back = _codec.decode(message, x.numel(), codec)
    blocks = -(-x.numel() // _codec.BLOCK)
    padded = torch.zeros(blocks * _codec.BLOCK)
    padded[: x.numel()] = x
    bound = (padded.view(blocks, -1).abs().amax(1) / qmax / 2).repeat_interleave(_codec.BLOCK)[: x.numel()]
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    assert torch.all(back[256:384] == 0)
    assert not torch.equal(back, x)  # it is lossy: the test would see a codec that sent fp32


def test_bf16_and_fp32_forms():
    x = torch.randn(300)
    assert torch.equal(_codec.decode(_codec.encode(x, "fp32"), 300, "fp32"), x)
    assert torch.equal(_codec.decode(_codec.encode(x, "bf16"), 300, "bf16"), x.to(torch.bfloat16).float())
    assert _codec.message_bytes(300, "int4") == 3 * 64 + 3 * 4


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,words", [
    (dict(sync_every=0), "sync_every=0"),
    (dict(outer_lr=0.0), "outer_lr=0.0"),
    (dict(outer_lr=float("nan")), "outer_lr=nan"),
    (dict(outer_momentum=1.0), "outer_momentum=1.0"),
    (dict(compression="int2"), "'fp32', 'bf16', 'int8', 'int4'"),
    (dict(sync_every=4, num_fragments=5), "num_fragments=5"),
    (dict(sync_every=4, fragment_sync_delay=4), "fragment_sync_delay=4"),
    (dict(fragment_update_alpha=1.5), "fragment_update_alpha=1.5"),
    (dict(sync_every=100, num_fragments=7), "exceeds the model's 6 trainable parameters"),
])
def test_bad_settings_are_refused_with_the_value_and_the_range(kwargs, words):
    model = _model()
    with pytest.raises(ValueError, match=None) as info:
        dptrain.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert words in str(info.value)


def test_an_optimizer_of_another_model_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="not trainable parameters of the model"):
        dptrain.DiLoCo(model, torch.optim.SGD(_model().parameters(), lr=0.1))


def test_a_launcher_world_without_init_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    model = _model()
    with pytest.raises(RuntimeError, match=r"dptrain.DiLoCo.*call dptrain.init\(\)"):
        dptrain.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_state_from_other_settings_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = dptrain.DiLoCo(model, opt, sync_every=8).state_dict()
    with pytest.raises(ValueError, match="sync_every=8"):
        dptrain.DiLoCo(model, opt, sync_every=4).load_state_dict(saved)


def test_alone_the_outer_step_runs_on_the_own_pseudo_gradient():
    """A world of one: outer lr 1 without momentum leaves the inner steps' weights as they are."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = dptrain.DiLoCo(model, opt, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    plain = _model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(4):
        _inner_step(model, opt, 0, step)
        diloco.step()
        _inner_step(plain, plain_opt, 0, step)
    torch.testing.assert_close(_flat(model), _flat(plain), rtol=0, atol=1e-6)
    assert diloco.bytes_sent == 0 and diloco.num_syncs == 2


# ---------------------------------------------------------------- sync_now twice changes nothing
def _sync_now_twice(rank):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = dptrain.DiLoCo(model, opt, sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    for step in range(7):  # two outer steps: the momentum is built up
        _inner_step(model, opt, rank, step)
        diloco.step()
    diloco.sync_now()
    after_first = _flat(model).clone()
    diloco.sync_now()  # nothing moved since: the weights stand (momentum alone moved them before)
    return after_first, _flat(model)


def test_sync_now_right_after_a_sync_leaves_the_weights_as_they_are():
    for first, second in run_ranks(_sync_now_twice, 2):
        assert torch.equal(first, second), (first - second).abs().max()


def _groups_after_a_re_form(rank: int) -> tuple:
    """The groups node_group() and the rails come from, made, the world re-formed, made again -- also when
    the new default group lands at the old one's id (as it may, its memory reused)."""
    import torch.distributed as dist

    from dptrain.runtime import env, exit as _exit
    from dptrain.parallel.diloco import _groups

    old = _groups._made([[0], [1]])
    _exit.settle_before_destroy()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("re-formed/", env._STATE.store), rank=rank, world_size=2)
    dead = [_groups._alive(pg) for pg in old]
    # The old world's groups filed under the new default group's id: what an id reused looks like.
    _groups._MADE[(id(dist.distributed_c10d._get_default_group()), ((0,), (1,)))] = old
    new = _groups._made([[0], [1]])
    again = _groups._made([[0], [1]])  # nothing destroyed since: the same groups, no new_group call
    return dead, new[rank] is not old[rank], dist.get_process_group_ranks(new[rank]), again is new


def test_groups_of_a_destroyed_world_are_made_anew_even_under_a_reused_default_group_id():
    for rank, (dead, made_anew, ranks, cached) in enumerate(run_ranks(_groups_after_a_re_form, 2)):
        assert dead[rank] is False  # its own group, destroyed with its world (size() still answers)
        assert made_anew and ranks == [rank] and cached
