"""``torch.compile(dptrain.DDP(model))`` trains like ``torch.compile(torch DDP(model))``.

On CPU PyTorch's compiled DDP is not bitwise equal to its eager DDP (inductor fuses the
model's kernels differently, about 1e-7 apart), so the reference is PyTorch's compiled DDP:
the same inductor graphs, the same dynamo bucket splits, and bitwise the same parameters.
Compiling is slow, so there is one small test; it is skipped without inductor's C++
toolchain.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dptrain
from tests._dist import run_ranks
from tests.parallel.ddp._ddp_models import BNNet

TorchDDP = nn.parallel.DistributedDataParallel


def _inductor_available() -> bool:
    try:
        import torch._inductor  # noqa: F401
    except ImportError:
        return False
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


pytestmark = pytest.mark.skipif(not _inductor_available(), reason="torch inductor needs a C++ compiler")


def _compiled(rank):
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for static in (False, True):
        for name, cls in (("torch", TorchDDP), ("ours", dptrain.DDP)):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            inner = BNNet()
            model = torch.compile(cls(inner, static_graph=static))
            opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            out[(static, name)] = {k: v.detach().clone() for k, v in inner.state_dict().items()}
            out[(static, name, "graphs")] = counters["stats"]["unique_graphs"]
    return out


def test_compiled_ddp_matches_torchs_compiled_ddp_bitwise():
    for out in run_ranks(_compiled, 2, timeout=600):
        for static in (False, True):
            ours, theirs = out[(static, "ours")], out[(static, "torch")]
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), (static, k)
            assert out[(static, "ours", "graphs")] == out[(static, "torch", "graphs")] == 1
