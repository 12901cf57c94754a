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
    assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in summary["history"])
    state = checkpoint.load(checkpoint.latest_checkpoint(tmp_path))
    assert ("scaler" in state and state["scaler"]) if dtype == "float16" else True
    again = make(str(checkpoint.checkpoint_path(tmp_path, 0, 3)))
    assert again.global_step == 3
    again.fit(2)


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
