"""The GPU tier: NCCL, CUDA devices, AMP and pinned memory. Every test skips, saying why,
where the machine has too few CUDA devices; ``benchmarks/gpu.sh`` runs this tier and the
GPU benchmarks wherever GPUs exist.

With one GPU the single-process tests run (AMP with the gradient scaler, bf16, pinned
loading, a launched example on one rank); with two or more, the multi-rank parity tests
(ours against PyTorch's DDP, and FSDP against DDP) run on NCCL with one GPU per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from tests._dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device (this machine has {GPUS})")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA devices, one per rank (this machine has {GPUS})")


def _model():
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))


def _batches(rank, n=6):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(n)]


def _parity_nccl(rank):
    device = dptrain.device()
    assert device.type == "cuda" and device.index == rank
    results = {}
    for name, cls in (("ours", dptrain.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        model = cls(_model().to(device), device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in _batches(rank):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
        results[name] = {k: v.detach().cpu() for k, v in model.module.named_parameters()}
    return results


@two_gpus
def test_our_ddp_equals_torch_ddp_on_nccl():
    out = run_ranks(_parity_nccl, 2, backend="nccl", timeout=300)
    for r in out:
        for k, v in r["ours"].items():
            # Two ranks: each element is a + b either way; NCCL's kernels may still differ from
            # gloo's in rounding, so this is fp32-close and usually bitwise.
            torch.testing.assert_close(v, r["torch"][k], rtol=1e-6, atol=1e-7)


def _fsdp_vs_ddp(rank):
    from dptrain.parallel.fsdp import ParamCountPolicy

    device = dptrain.device()
    out = {}
    for name in ("ddp", "fsdp"):
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        if name == "ddp":
            model = dptrain.DDP(plain.to(device), device_ids=[rank])
        else:
            model = dptrain.FSDP(plain, auto_wrap_policy=ParamCountPolicy(1000), device_id=device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for x, y in _batches(rank):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
        out[name] = model.full_state_dict() if name == "fsdp" else checkpoint.strip_prefix(
            {k: v.detach().cpu() for k, v in model.state_dict().items()})
    return out


@two_gpus
def test_fsdp_matches_ddp_on_nccl():
    out = run_ranks(_fsdp_vs_ddp, 2, backend="nccl", timeout=300)[0]
    for k, v in out["ddp"].items():
        torch.testing.assert_close(out["fsdp"][k].cpu(), v, rtol=1e-5, atol=1e-6)


@one_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_trainer_amp_on_cuda_trains_and_resumes(tmp_path, dtype):
    from dptrain.data import prepare_dataloader
    from dptrain.train import Trainer, TrainerConfig

    def make(resume):
        dptrain.seed_everything(0)
        model = _model()
        data = torch.utils.data.TensorDataset(torch.randn(96, 32), torch.randint(0, 8, (96,)))
        cfg = TrainerConfig(amp=True, amp_dtype=dtype, checkpoint_dir=str(tmp_path), save_every_steps=3, keep_last=0,
                            verbose=False)
        return Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), prepare_dataloader(data, 16), nn.CrossEntropyLoss(),
                       cfg, device="cuda:0", resume=resume)

    t = make(False)
    assert t.amp and (t.scaler is not None) == (dtype == "float16")
    summary = t.fit(2)
    assert t.global_step == 12 and all(torch.isfinite(torch.tensor(h["train_loss"])) for h in summary["history"])
    uninterrupted = {k: v.detach().cpu().clone() for k, v in t.model_state_dict().items()}
    path = str(checkpoint.checkpoint_path(tmp_path, 0, 3))
    state = checkpoint.load(path)
    if dtype == "float16":  # the gradient scaler's state is part of the checkpoint
        assert state["scaler"]["scale"] > 0
    else:
        assert state.get("scaler") is None
    again = make(path)
    assert again.resumed_from == path and again.global_step == 3
    if dtype == "float16":
        assert again.scaler.get_scale() == state["scaler"]["scale"]
    again.fit(2)
    assert again.global_step == 12
    resumed = {k: v.detach().cpu() for k, v in again.model_state_dict().items()}
    # Bitwise on CPU (tests/test_trainer.py); CUDA kernels may use atomics, so fp32-close here.
    # A resume that lost the scaler, the progress or the weights differs by far more.
    for k, v in uninterrupted.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _mixed_precision_against_torch(rank):
    from torch.nn.parallel.distributed import _MixedPrecision

    from tests.parallel.ddp._ddp_models import BNNet, make_batch

    device = dptrain.device()
    out = {}
    for name, cls in (("ours", dptrain.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(4)
        mp = _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
        model = cls(BNNet().to(device), device_ids=[rank], mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = make_batch("mlp", rank, step, batch=6)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.to(device)).float(), y.to(device)).backward()
            opt.step()
        out[name] = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return out


@one_gpu
def test_mixed_precision_against_torchs_on_cuda():
    """PyTorch's DDP mixed precision runs only on CUDA (it needs CUDA events); here it is the
    reference itself, and checks the recipe that tests/parallel/ddp/test_ddp_dropin.py writes out
    by hand for CPU."""
    for r in run_ranks(_mixed_precision_against_torch, min(GPUS, 2), backend="nccl", timeout=300):
        assert r["ours"].keys() == r["torch"].keys()
        for k, v in r["torch"].items():
            assert r["ours"][k].dtype == v.dtype, k
            if "num_batches" not in k:
                torch.testing.assert_close(r["ours"][k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


@one_gpu
def test_prepare_dataloader_pins_memory_on_cuda():
    from dptrain.data import prepare_dataloader

    loader = prepare_dataloader(torch.utils.data.TensorDataset(torch.randn(8, 4)), 4, num_replicas=1, rank=0)
    assert loader.pin_memory
    (x,) = next(iter(loader))
    assert x.is_pinned()


@one_gpu
def test_image_classification_example_on_the_gpus(tmp_path):
    nproc = min(GPUS, 2)
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "examples", "image_classification.py"), "--num_epochs", "2", "--width", "8",
           "--model_dir", str(tmp_path / "m")]
    done = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    last = [line for line in done.stdout.splitlines() if "test accuracy" in line][-1]
    assert float(last.rsplit(" ", 1)[1]) > 0.5
