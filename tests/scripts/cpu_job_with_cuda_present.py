"""A CPU job on a machine where CUDA is present: every rank says CPU (``backend="gloo"``), and
nothing of dptrain's may then pick CUDA because it exists. Run under
``PYTHONPATH=tests/fake_cuda``, where CUDA claims one device and every real CUDA call fails.
Prints "ok" per rank."""
import torch
from torch import nn

import dptrain
from dptrain.models import TinyTransformer, TransformerBlock
from dptrain.parallel import comm_hooks
from dptrain.parallel.fsdp import FSDP, ModuleTypePolicy


def _steps(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.step()


def rank_main(rank: int) -> str:
    assert torch.cuda.is_available(), "run under PYTHONPATH=tests/fake_cuda"
    dptrain.init(backend="gloo")
    assert dptrain.device().type == "cpu", dptrain.device()
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (16, 8)))
    loader = dptrain.prepare_dataloader(data, batch_size=4)
    assert not loader.pin_memory  # nothing to copy to a GPU
    batches = [x for (x,) in loader]
    for state, hook in ((None, comm_hooks.fp16_compress_hook), (None, comm_hooks.bf16_compress_hook),
                        (comm_hooks.PowerSGDState(None, 1, start_powerSGD_iter=1), comm_hooks.powerSGD_hook)):
        torch.manual_seed(0)
        model = dptrain.DDP(TinyTransformer(vocab=32, dim=16, depth=1, heads=2, max_len=8))
        model.register_comm_hook(state, hook)
        _steps(model, batches)
    for compression in ("bf16", "powersgd"):
        _steps(dptrain.DDP(TinyTransformer(vocab=32, dim=16, depth=1, heads=2, max_len=8), compression=compression),
               batches)
    for offload in (False, True):
        fsdp = FSDP(TinyTransformer(vocab=32, dim=16, depth=1, heads=2, max_len=8),
                    auto_wrap_policy=ModuleTypePolicy({TransformerBlock}), cpu_offload=offload)
        _steps(fsdp, batches)
        assert all(p.device.type == "cpu" for p in fsdp.parameters())
    replicas = dptrain.DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    replicas(torch.randn(4, 4)).sum().backward()
    dptrain.shutdown()
    return "ok"


if __name__ == "__main__":
    # Forked: the ranks are this process's copies, fake CUDA and all (fresh interpreters would
    # each import torch again, for 3.5 s of CPU, and test the same).
    print(" ".join(dptrain.spawn(rank_main, 2, timeout=300, start_method="fork")))
