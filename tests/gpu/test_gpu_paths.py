"""Every CUDA path on one GPU: DDP and FSDP (with and without ``cpu_offload``) against plain
training, a checkpoint written on the GPU read by a CPU-only process, ``torch.compile`` over
our DDP, and the compression hooks on CUDA tensors. Skipped, saying why, without a GPU
(``benchmarks/gpu.sh`` runs this tier wherever GPUs exist).

A world of one under ``run_ranks`` has its NCCL process group (see ``dptrain.init``), so
the wrappers run the communication path they run at N ranks. SGD, not Adam, is compared:
Adam divides each update by the gradient's own size, so the last bit of a near-zero gradient
can flip an update by ``2 * lr`` between two correct implementations (a CPU and a CUDA Adam
among them); SGD keeps every difference at the size of the rounding that caused it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dptrain
from dptrain.models import TinyTransformer, TransformerBlock
from tests._dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device (this machine has {GPUS})")


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(vocab=32, dim=16, depth=2, heads=2, max_len=8)


def _batches(device, n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 32, (4, 8), generator=g).to(device) for _ in range(n)]


def _train(model, params, device):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for x in _batches(device):
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.step()


def _state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _wrapped_vs_plain(rank, kind):
    device = dptrain.device()
    assert device.type == "cuda", device
    plain = _transformer().to(device)
    _train(plain, plain.parameters(), device)
    if kind == "ddp":
        model = dptrain.DDP(_transformer().to(device), device_ids=[device.index])
        assert model.reducer is not None  # the world of one reduces through NCCL, as N ranks do
        _train(model, model.parameters(), device)
        return _state(plain), _state(model.module), None
    from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy

    offload = kind == "fsdp_offload"
    model = FSDP(_transformer(), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), device_id=device,
                 cpu_offload=offload)
    devices = {p.device.type for p in model.parameters()}
    _train(model, model.parameters(), device)
    grads = {p.grad.device.type for p in model.parameters() if p.grad is not None}
    return _state(plain), model.full_state_dict(), (devices, grads)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_offload"])
def test_wrappers_on_one_gpu_match_plain_training(kind):
    plain, wrapped, where = run_ranks(_wrapped_vs_plain, 1, kind, backend="nccl", timeout=300)[0]
    if kind == "fsdp_offload":
        assert where == ({"cpu"}, {"cpu"})  # shards, their gradients and the optimizer step on the CPU
    elif kind == "fsdp":
        assert where == ({"cuda"}, {"cuda"})
    assert plain.keys() == wrapped.keys()
    for k, v in plain.items():
        # The same CUDA kernels on the same inputs; only the order of a few sums may differ.
        torch.testing.assert_close(wrapped[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {k}: {m}")


def _save_on_gpu(rank, path):
    model = dptrain.DDP(_transformer().to(dptrain.device()), device_ids=[dptrain.device().index])
    _train(model, model.parameters(), dptrain.device())
    dptrain.checkpoint.save({"model": model.state_dict()}, path)
    return _state(model.module)


_LOAD_ON_CPU = """
import sys, torch, dptrain
from dptrain.models import TinyTransformer
assert not torch.cuda.is_available()
state = dptrain.checkpoint.load(sys.argv[1])
model = TinyTransformer(vocab=32, dim=16, depth=2, heads=2, max_len=8)
dptrain.checkpoint.load_model_state(model, state["model"])  # DDP's "module." prefix or not
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""


def test_a_checkpoint_saved_on_the_gpu_loads_in_a_cpu_only_process(tmp_path):
    path = str(tmp_path / "gpu.pt")
    trained = run_ranks(_save_on_gpu, 1, path, backend="nccl", timeout=300)[0]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _LOAD_ON_CPU, path, str(tmp_path / "cpu.pt")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = torch.load(tmp_path / "cpu.pt")
    for k, v in trained.items():
        assert loaded[k].device.type == "cpu" and torch.equal(loaded[k], v), k


def _compiled(rank):
    device = dptrain.device()
    results = {}
    for name in ("eager", "compiled"):
        model = dptrain.DDP(_transformer().to(device), device_ids=[device.index])
        run = torch.compile(model) if name == "compiled" else model
        _train(run, model.parameters(), device)
        results[name] = _state(model.module)
    return results


def test_torch_compile_over_our_ddp_trains_like_eager():
    out = run_ranks(_compiled, 1, backend="nccl", timeout=600)[0]
    for k, v in out["eager"].items():
        # Inductor fuses kernels: the same arithmetic in another order.
        torch.testing.assert_close(out["compiled"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _hooks_on_cuda(rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as torch_powersgd

    from dptrain.parallel import comm_hooks

    device = dptrain.device()
    out = {}
    for name, ours, theirs in (
        ("fp16", (None, comm_hooks.fp16_compress_hook), (None, default_hooks.fp16_compress_hook)),
        ("bf16", (None, comm_hooks.bf16_compress_hook), (None, default_hooks.bf16_compress_hook)),
        ("powersgd", (comm_hooks.PowerSGDState(None, 2, start_powerSGD_iter=2), comm_hooks.powerSGD_hook),
         (torch_powersgd.PowerSGDState(None, 2, start_powerSGD_iter=2), torch_powersgd.powerSGD_hook)),
    ):
        for who, (state, hook) in (("ours", ours), ("torch", theirs)):
            # One bucket, as the CPU comparison in tests/parallel/ddp/test_compression.py.
            model = dptrain.DDP(_transformer().to(device), device_ids=[device.index], bucket_cap_mb=100)
            model.register_comm_hook(state, hook)
            _train(model, model.parameters(), device)
            out[(name, who)] = _state(model.module)
    return out


@pytest.mark.parametrize("name", ["fp16", "bf16", "powersgd"])
def test_compression_hooks_on_cuda_tensors_match_pytorchs(name):
    # The CUDA counterpart of the CPU comparison, which PyTorch's own PowerSGD hook cannot run
    # on a GPU machine (it synchronizes CUDA whenever CUDA exists, even for CPU tensors).
    out = run_ranks(_hooks_on_cuda, 1, backend="nccl", timeout=300)[0]
    ours, theirs = out[(name, "ours")], out[(name, "torch")]
    for k, v in theirs.items():
        torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")


def test_fsdp_cpu_offload_in_one_process_without_a_process_group_matches_plain():
    # One process, no launcher: FSDP on the GPU with its shards in CPU memory.
    device = torch.device("cuda", 0)
    from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy

    plain = _transformer().to(device)
    fsdp = FSDP(_transformer(), auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), cpu_offload=True, device_id=0)
    assert all(p.device.type == "cpu" for p in fsdp.parameters())
    _train(plain, plain.parameters(), device)
    _train(fsdp, fsdp.parameters(), device)
    assert all(p.grad.device.type == "cpu" for p in fsdp.parameters())
    full = fsdp.full_state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(full[k], v.cpu(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
