"""FSDP: parity with our DDP, sharded storage, freeing, prefetch and clear errors.

State-dict round trips live in test_fsdp_state_dict.py.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import dptrain
from dptrain.models import MLP, TinyTransformer, TransformerBlock
from dptrain.parallel.fsdp import FSDP, FullyShardedDataParallel, ModuleTypePolicy, ParamCountPolicy
from tests._dist import run_ranks

# Plain SGD is the sharp comparison: its update is proportional to the gradient, so a gradient
# off by any factor (e.g. not divided by the world size) moves the weights far beyond fp32
# rounding, the only difference allowed (rtol 1e-5, atol 1e-6, the contract's "up to fp32
# rounding"). Adam ignores the gradient's scale: it is kept as a second case, with a looser
# bound -- it normalises each update, so rounding differences of near-zero gradients can move
# a weight by up to ~lr per step (lr=1e-3 over 3 steps).
SGD_LR = 0.5
ATOL = 2e-4  # Adam only
LR = 1e-3


def _transformer():
    return TinyTransformer(vocab=32, dim=16, depth=2, heads=2, max_len=8)


def _mlp():
    return MLP([12, 24, 24, 6])


def _batch(kind, gen):
    if kind == "transformer":
        return torch.randint(0, 32, (2, 8), generator=gen)
    return torch.randn(4, 12, generator=gen)


def _loss(out):
    return out.logsumexp(-1).mean()


# (sharding_strategy, cpu_offload, micro-batches per step (no_sync for all but the last), clip)
CONFIGS = [
    ("full_shard", False, 1, False),
    ("full_shard", True, 2, True),
    ("shard_grad_op", False, 2, True),
    ("no_shard", False, 2, True),
    ("no_shard", True, 1, False),
]


def _parity_rank(rank, configs, optimizer="adam"):
    """Train FSDP (each config, both models) and our DDP side by side for 3 steps; diffs on rank 0."""
    results = []
    for (strategy, offload, accum, clip), kind in [(c, k) for c in configs for k in ("transformer", "mlp")]:
        torch.manual_seed(0)
        model = _transformer() if kind == "transformer" else _mlp()
        init = copy.deepcopy(model.state_dict())
        policy = ModuleTypePolicy({TransformerBlock}) if kind == "transformer" else ParamCountPolicy(300)
        fsdp = FSDP(copy.deepcopy(model), auto_wrap_policy=policy, sharding_strategy=strategy, cpu_offload=offload)
        ddp = dptrain.DistributedDataParallel(model)
        if optimizer == "sgd":
            opts = [torch.optim.SGD(m.parameters(), lr=SGD_LR) for m in (fsdp, ddp)]
        else:
            opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in (fsdp, ddp)]
        gen = torch.Generator().manual_seed(100 + rank)
        norms = []
        for _ in range(3):
            xs = [_batch(kind, gen) for _ in range(accum)]
            for m, opt in zip((fsdp, ddp), opts):
                opt.zero_grad()
                for i, x in enumerate(xs):
                    if i < accum - 1:
                        with m.no_sync():
                            _loss(m(x)).backward()
                    else:
                        _loss(m(x)).backward()
                if clip:
                    if m is fsdp:
                        norms.append(float(m.clip_grad_norm_(0.05)))
                    else:
                        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
                opt.step()
        full = fsdp.full_state_dict()
        if rank == 0:
            ref = ddp.module.state_dict()
            assert list(full) == list(ref), (list(full), list(ref))
            diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
            moved = min((ref[k] - init[k]).abs().max().item() for k in ref if k.endswith("weight"))
            beyond_rounding = [k for k in ref if not torch.allclose(full[k], ref[k], rtol=1e-5, atol=1e-6)]
            results.append((strategy, offload, diff, moved, norms, beyond_rounding))
        else:
            assert full == {}
    return results


def _check_norms(norms):
    fsdp_norms, ddp_norms = norms[0::2], norms[1::2]
    assert fsdp_norms == pytest.approx(ddp_norms, rel=1e-5)
    if norms:
        assert max(fsdp_norms) > 0.05  # clipping really clipped


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_ddp_under_sgd_up_to_fp32_rounding(world):
    # 4 ranks on 2 cores is slow: there, one config per strategy (with offload, no_sync, clip).
    configs = CONFIGS if world == 2 else CONFIGS[1:4]
    results = run_ranks(_parity_rank, world, configs, "sgd")[0]
    assert len(results) == 2 * len(configs)
    for strategy, offload, diff, moved, norms, beyond_rounding in results:
        assert beyond_rounding == [], (strategy, offload, diff, beyond_rounding)
        assert moved > 1e-4, (strategy, offload, moved)  # training really happened, 100x the tolerance
        _check_norms(norms)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_ddp_under_adam(world):
    configs = CONFIGS[:2] if world == 2 else CONFIGS[2:3]
    results = run_ranks(_parity_rank, world, configs, "adam")[0]
    assert len(results) == 2 * len(configs)
    for strategy, offload, diff, moved, norms, _ in results:
        assert diff < ATOL, (strategy, offload, diff)
        assert moved > 5 * ATOL, (strategy, offload, moved)  # training really happened
        _check_norms(norms)


def _storage_rank(rank, world, strategy):
    torch.manual_seed(0)
    model = _transformer()
    total = sum(p.numel() for p in model.parameters())
    originals = list(model.parameters())
    fsdp = FSDP(model, auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), sharding_strategy=strategy)
    units = fsdp._units
    stored = sum(p.numel() for p in fsdp.parameters())
    expected = sum(math.ceil(u.numel / world) for u in units)
    names = [n for n, _ in fsdp.named_parameters()]
    freed_originals = all(p.numel() == 0 for p in originals)
    x = torch.randint(0, 32, (2, 8))
    out = fsdp(x)
    after_forward = {type(u.module).__name__ + str(i): u.full_param.untyped_storage().size() for i, u in enumerate(units)}
    _loss(out).backward()
    after_backward = [u.full_param.untyped_storage().size() for u in units]
    return total, sum(u.numel for u in units), stored, expected, names, freed_originals, after_forward, after_backward


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_stores_one_shard_and_frees_gathered_params(world):
    for strategy in ("full_shard", "shard_grad_op"):
        results = run_ranks(_storage_rank, world, world, strategy)
        for total, unit_total, stored, expected, names, freed, after_forward, after_backward in results:
            assert unit_total == total
            assert stored == expected  # 1/world of each unit, padded up
            assert stored * world - total < world * 3  # padding is less than one element per rank per unit
            assert names == ["module._flat_param", "module.blocks.0._flat_param", "module.blocks.1._flat_param"]
            assert freed
            blocks = [v for k, v in after_forward.items() if k.startswith("TransformerBlock")]
            root = after_forward["TinyTransformer2"]
            if strategy == "full_shard":
                assert blocks == [0, 0]  # freed right after each block's forward
            else:
                assert all(b > 0 for b in blocks)  # kept for backward
            assert root > 0  # the root stays gathered: backward needs it at once
            assert after_backward == [0, 0, 0]


def _prefetch_rank(rank, prefetch):
    torch.manual_seed(0)
    fsdp = FSDP(_transformer(), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), backward_prefetch=prefetch)
    events = []
    for i, u in enumerate(fsdp._units):
        orig = u.unshard

        def spy(async_op=False, _u=u, _i=i, _orig=orig):
            if not _u.unsharded:
                events.append((_i, async_op))
            return _orig(async_op)

        u.unshard = spy
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = fsdp(x)
    events.clear()
    _loss(out).backward()
    return events, [p.grad.clone() for p in fsdp.parameters()]


def test_backward_prefetch_overlaps_next_unit_gather():
    with_prefetch = run_ranks(_prefetch_rank, 2, True)
    without = run_ranks(_prefetch_rank, 2, False)
    # Backward runs the root (already gathered), block 1, block 0. With prefetch, the root's
    # pre-backward starts block 1's gather asynchronously and block 1's starts block 0's;
    # without, each block gathers synchronously when backward reaches it.
    assert with_prefetch[0][0] == [(1, True), (0, True)]
    assert without[0][0] == [(1, False), (0, False)]
    for (_, g1), (_, g2) in zip(with_prefetch, without):
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_single_process_matches_plain_training():
    torch.manual_seed(0)
    plain = _mlp()
    fsdp = FSDP(copy.deepcopy(plain), auto_wrap_policy=ParamCountPolicy(300))
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in (fsdp, plain)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 12, generator=gen)
        for m, opt in zip((fsdp, plain), opts):
            opt.zero_grad()
            _loss(m(x)).backward()
            opt.step()
    full = fsdp.full_state_dict()
    assert list(full) == list(plain.state_dict())
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)


def test_param_count_policy_and_nested_units():
    model = MLP([12, 24, 24, 6])  # layers: 312, 600, 150 params
    fsdp = FSDP(model, auto_wrap_policy=ParamCountPolicy(300))
    assert [type(u.module).__name__ for u in fsdp._units] == ["Linear", "Linear", "MLP"]
    assert [u.numel for u in fsdp._units] == [312, 600, 150]
    with pytest.raises(ValueError, match="min_num_params"):
        ParamCountPolicy(0)
    with pytest.raises(ValueError, match="nn.Module subclasses"):
        ModuleTypePolicy({int})
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDP(_mlp(), sharding_strategy="zero2")


def test_manual_nesting_becomes_units_and_keeps_plain_keys():
    torch.manual_seed(0)
    plain = _transformer()
    ref_keys = list(plain.state_dict())
    model = copy.deepcopy(plain)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block)
    fsdp = FSDP(model)
    assert len(fsdp._units) == 3
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(fsdp(x), plain(x), rtol=0, atol=1e-6)
    full = fsdp.full_state_dict()
    assert list(full) == ref_keys
    assert fsdp.head is model.head  # attributes the wrapper lacks come from the model
    with pytest.raises(RuntimeError, match="outermost"):
        model.blocks[0].full_state_dict()
    with pytest.raises(ValueError, match="already flattened"):
        FSDP(fsdp.module)  # the model again, without its wrapper


def test_parameter_shared_across_units_raises():
    model = _transformer()
    model.head.weight = model.tok.weight  # tie: the head lives in the root unit
    policy = ModuleTypePolicy({nn.Embedding})
    with pytest.raises(ValueError, match=r"'head.weight' is shared between FSDP units 'tok' and '<root>'"):
        FSDP(model, auto_wrap_policy=policy)
    # the error came before any flattening: the model is intact and still wraps another way
    assert "weight" in model.tok._parameters and "_flat_param" not in model.blocks[0]._parameters
    assert len(FSDP(model, auto_wrap_policy=ModuleTypePolicy({TransformerBlock}))._units) == 3


def test_tied_weights_inside_one_unit_stay_tied():
    torch.manual_seed(0)
    plain = _transformer()
    plain.head.weight = plain.tok.weight
    fsdp = FSDP(copy.deepcopy(plain), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}))
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(fsdp(x), plain(x), rtol=0, atol=1e-6)
    full = fsdp.full_state_dict()
    assert torch.equal(full["head.weight"], full["tok.weight"])
    assert list(full) == list(plain.state_dict())


def test_optimizer_built_before_wrapping_raises_at_step():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp = FSDP(model)
    _loss(fsdp(torch.randn(2, 12))).backward()
    with pytest.raises(ValueError, match="build the optimizer after wrapping"):
        opt.step()
    good = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    before = [p.detach().clone() for p in fsdp.parameters()]
    good.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, fsdp.parameters()))


def _mismatch_rank(rank):
    torch.manual_seed(0)
    model = MLP([12, 24, 6] if rank == 0 else [12, 25, 6])
    try:
        FSDP(model)
    except ValueError as err:
        return str(err)
    return None


def test_model_mismatch_across_ranks_raises_on_every_rank():
    messages = run_ranks(_mismatch_rank, 2)
    for rank, msg in enumerate(messages):
        assert msg is not None and msg.startswith(f"rank {rank}:"), msg
        assert "rank 1 holds '0.weight' of shape (25, 12)" in msg and "(24, 12)" in msg
        assert "build the same model on every rank" in msg


def _root_only_rank(rank):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(_mlp())
        FSDP(_mlp())
    return [str(w.message) for w in caught if "only the root" in str(w.message)]


def test_root_only_wrap_warns_once_from_rank_0():
    messages = run_ranks(_root_only_rank, 2)
    assert len(messages[0]) == 1 and "no memory is saved" in messages[0][0]
    assert messages[1] == []


def test_eval_forward_without_grad_frees_everything():
    fsdp = FSDP(_transformer(), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), sharding_strategy="shard_grad_op")
    with torch.no_grad():
        out = fsdp(torch.randint(0, 32, (2, 8)))
    assert out.shape == (2, 8, 32)
    # world 1 pads nothing, but the gathered copy is still a separate buffer that must be freed
    assert all(u.full_param.untyped_storage().size() == 0 for u in fsdp._units)
    assert isinstance(fsdp, FullyShardedDataParallel) and dptrain.FSDP is FullyShardedDataParallel


def test_frozen_units_train_around_them_and_mixed_units_raise():
    torch.manual_seed(0)
    model = _transformer()
    for emb in (model.tok, model.pos):
        emb.weight.requires_grad_(False)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("tok.", "pos."))}
    fsdp = FSDP(model, auto_wrap_policy=ModuleTypePolicy({nn.Embedding, TransformerBlock}))
    opt = torch.optim.Adam([p for p in fsdp.parameters() if p.requires_grad], lr=LR)
    before = fsdp.full_state_dict()
    _loss(fsdp(torch.randint(0, 32, (2, 8)))).backward()
    opt.step()
    after = fsdp.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert not torch.equal(after["head.weight"], before["head.weight"])

    mixed = _mlp()
    mixed[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="mixes frozen and trainable"):
        FSDP(mixed)
