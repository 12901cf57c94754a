"""FSDP state dicts: full -> plain model, sharded save/load on 2 ranks, bitwise resume, checks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import dptrain
from dptrain.models import TinyTransformer, TransformerBlock
from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy
from tests._dist import run_ranks


class _NormNet(nn.Module):
    """A transformer plus a BatchNorm, so buffers travel through the state dicts too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TinyTransformer(vocab=32, dim=16, depth=2, heads=2, max_len=8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.body(x))


def _wrap(model, strategy="full_shard"):
    return FSDP(model, auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), sharding_strategy=strategy)


def _step(model, opt, gen):
    x = torch.randint(0, 32, (4, 8), generator=gen)
    opt.zero_grad()
    model(x).logsumexp(-1).mean().backward()
    opt.step()


def _full_rank(rank):
    torch.manual_seed(0)
    fsdp = _wrap(_NormNet())
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        _step(fsdp, opt, gen)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(7))
    fsdp.eval()
    with torch.no_grad():
        out = fsdp(x)
    full = fsdp.full_state_dict()
    everywhere = fsdp.full_state_dict(rank0_only=False)
    # load_full_state_dict on a freshly initialised wrapped model restores the same outputs
    torch.manual_seed(123)
    other = _wrap(_NormNet())
    other.load_full_state_dict(everywhere)
    other.eval()
    with torch.no_grad():
        out2 = other(x)
    return full, everywhere, out, out2


def test_full_state_dict_loads_into_plain_model():
    results = run_ranks(_full_rank, 2)
    full, everywhere0, out, out2 = results[0]
    assert results[1][0] == {}
    torch.manual_seed(5)
    plain = _NormNet()
    assert list(full) == list(plain.state_dict())
    plain.load_state_dict(full)  # strict: same keys, same shapes
    plain.eval()
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), out, rtol=0, atol=1e-5)
    assert full["bn.num_batches_tracked"].item() == 2
    for rank_result in results:
        torch.testing.assert_close(rank_result[3], rank_result[2], rtol=0, atol=0)
        # parameters are the same everywhere; buffers (BatchNorm stats) are each rank's own
        assert all(torch.equal(everywhere0[k], rank_result[1][k]) for k in full if not k.startswith("bn."))
    assert not torch.equal(results[0][1]["bn.running_mean"], results[1][1]["bn.running_mean"])


def test_load_full_state_dict_errors():
    fsdp = _wrap(_NormNet())
    good = fsdp.full_state_dict()
    bad = dict(good)
    del bad["body.head.bias"]
    with pytest.raises(ValueError, match=r"missing \['body.head.bias'\]"):
        fsdp.load_full_state_dict(bad)
    prefixed = {"module." + k: v for k, v in good.items()}
    with pytest.raises(ValueError, match="strip_prefix"):
        fsdp.load_full_state_dict(prefixed)
    wrong = dict(good)
    wrong["body.head.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'body.head.bias' has shape \(3,\)"):
        fsdp.load_full_state_dict(wrong)


def _sharded_rank(rank, path, phase):
    gen = torch.Generator().manual_seed(10 + rank)
    torch.manual_seed(0 if phase == "save" else 99)  # the loader starts from other weights
    fsdp = _wrap(_NormNet())
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    file = os.path.join(path, f"shard{rank}.pt")
    if phase == "save":
        for _ in range(2):
            _step(fsdp, opt, gen)
        state = {"model": fsdp.sharded_state_dict(), "optim": opt.state_dict(), "rng": gen.get_state()}
        torch.save(state, file)
        for _ in range(2):
            _step(fsdp, opt, gen)
        return fsdp.full_state_dict(), None
    state = torch.load(file, weights_only=True)
    other = torch.load(os.path.join(path, f"shard{1 - rank}.pt"), weights_only=True)
    try:
        fsdp.load_sharded_state_dict(other["model"])
        wrong_rank = None
    except ValueError as err:
        wrong_rank = str(err)
    fsdp.load_sharded_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    gen.set_state(state["rng"])
    for _ in range(2):
        _step(fsdp, opt, gen)
    return fsdp.full_state_dict(), wrong_rank


def test_sharded_save_load_resumes_bitwise(tmp_path):
    continued = run_ranks(_sharded_rank, 2, str(tmp_path), "save")
    resumed = run_ranks(_sharded_rank, 2, str(tmp_path), "load")
    a, b = continued[0][0], resumed[0][0]
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bitwise on CPU
    for rank, (_, msg) in enumerate(resumed):
        assert msg is not None and msg.startswith(f"rank {rank}:") and "rank=" in msg


def _meta_mismatch_rank(rank, path):
    torch.manual_seed(0)
    state = _wrap(_NormNet()).sharded_state_dict()
    errors = []
    other = _wrap(_NormNet(), strategy="shard_grad_op")
    try:
        other.load_sharded_state_dict(state)
    except ValueError as err:
        errors.append(str(err))
    torch.manual_seed(0)
    flat = FSDP(_NormNet())  # no policy: one unit instead of three
    try:
        flat.load_sharded_state_dict(state)
    except ValueError as err:
        errors.append(str(err))
    if rank == 0:
        torch.save(state, os.path.join(path, "two_rank.pt"))
    return errors


def test_sharded_load_checks_metadata(tmp_path):
    errors = run_ranks(_meta_mismatch_rank, 2, str(tmp_path))[0]
    assert len(errors) == 2
    assert "sharding_strategy='full_shard'" in errors[0]
    assert "units" in errors[1] or "unit" in errors[1]
    # a shard saved in a world of 2, loaded in a single process (world 1)
    state = torch.load(tmp_path / "two_rank.pt", weights_only=True)
    single = _wrap(_NormNet())
    with pytest.raises(ValueError, match="world_size=2 but this model has world_size=1"):
        single.load_sharded_state_dict(state)
    with pytest.raises(ValueError, match="load_full_state_dict"):
        single.load_sharded_state_dict(single.full_state_dict())
    assert dptrain.FSDP is FSDP
