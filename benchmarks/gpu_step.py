"""Step time and memory on GPUs (NCCL): our DDP against PyTorch's, our FSDP against FSDP2.

One rank per visible GPU, through ``dptrain.spawn`` (one GPU too: a world of one has its
process group, so our DDP runs the reducer and all-reduce path of N ranks, not a shortcut).
Each wrapper trains its own identical copy; steps alternate between the two in the same
processes (ours, theirs, ours, ...) so both see the same machine, and the table gives median
step times (the slowest rank's, with ``torch.cuda.synchronize``), the ratio ours/theirs and
the peak memory each allocated. The default workload is a GPT-2-small-sized transformer
(12 layers of width 768, 12 heads, vocabulary 8192, batch 8x512 tokens, bf16 autocast, AdamW).

    .venv/bin/python benchmarks/gpu_step.py [--model gpt|mlp] [--steps 30] [--nproc N]
    .venv/bin/python benchmarks/gpu_step.py --cpu --width 64 --depth 2 --heads 2 --vocab 128 --context 16 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import dptrain
from dptrain.runtime import torch_version as _torch_version


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class _GPT(nn.Module):
    """A GPT-2-small-shaped decoder: token and position embeddings, pre-norm blocks with a
    causal mask, and a head over the vocabulary (issue 20's workload)."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                               norm_first=True, activation="gelu") for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def _workload(args: argparse.Namespace, device: torch.device):
    """(a function making a fresh identical model, the batch, the loss, the unit FSDP wraps)."""
    if args.model == "gpt":
        def make():
            torch.manual_seed(0)
            return _GPT(args.vocab, args.width, args.depth, args.heads, args.context)
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)

        def loss(model):
            logits = model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        return make, loss, nn.TransformerEncoderLayer
    batch = torch.randn(args.batch, args.width, device=device)
    return (lambda: _mlp(args.width, args.depth)), (lambda model: model(batch).float().pow(2).mean()), nn.Linear


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(models: dict, loss, steps: int, device: torch.device, amp: bool) -> dict[str, list[float]]:
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for step in range(steps + 2):
        for name in names if step % 2 == 0 else names[::-1]:
            model, opt = models[name], opts[name]
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                value = loss(model)
            value.backward()
            opt.step()
            _sync(device)
            took = torch.tensor([time.perf_counter() - t0], device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= 2:
                times[name].append(float(took))
    return times


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def _rank(rank: int, args: argparse.Namespace) -> dict:
    # Under dptrain.spawn every rank, one GPU's included, has its process group (a world of
    # one too), so PyTorch's DDP works beside ours and ours runs the reducer path of N ranks.
    dptrain.init(backend="gloo" if args.cpu else "nccl")
    device = dptrain.device()
    make, loss, unit = _workload(args, device)
    amp = not args.cpu and args.model == "gpt"
    ids = [device.index] if device.type == "cuda" else None
    out = {}
    ddp = {"ours": dptrain.DDP(make().to(device), device_ids=ids),
           "torch": nn.parallel.DistributedDataParallel(make().to(device), device_ids=ids)}
    out["ddp"] = {k: statistics.median(v) for k, v in _time_steps(ddp, loss, args.steps, device, amp).items()}
    del ddp
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6: FSDP2 is not public yet
        from torch.distributed._composable.fsdp import fully_shard

    from dptrain.parallel.fsdp import ModuleTypePolicy

    peak = {}
    # FSDP2 runs on a CPU from torch 2.6 on; before, only on CUDA: ours is then timed alone.
    fsdp2_runs = device.type == "cuda" or not _torch_version.older_than((2, 6))
    for name in ("ours", "fsdp2") if fsdp2_runs else ("ours",):
        _peak_reset(device)
        if name == "ours":
            model = dptrain.FSDP(make(), auto_wrap_policy=ModuleTypePolicy({unit}), device_id=device)
        else:
            model = make().to(device)
            for layer in model.modules():
                if isinstance(layer, unit):
                    fully_shard(layer)
            fully_shard(model)
        t = _time_steps({name: model}, loss, args.steps, device, amp)[name]
        peak[name] = (statistics.median(t), _peak(device))
        del model
    out["fsdp"] = peak
    dptrain.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                   help="gpt (default): 12 layers of width 768, 12 heads, vocabulary 8192, bf16 autocast; "
                        "mlp: --depth Linear layers of --width")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="sequences (gpt) or rows (mlp) per rank")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU over gloo (a smoke run of this script)")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.cpu and gpus < 1:
        print("no CUDA device: nothing to measure (--cpu runs this script on the CPU)")
        return
    nproc = args.nproc or (1 if args.cpu else gpus)
    res = dptrain.spawn(_rank, nproc, args=(args,), timeout=1800)[0]
    where = "CPU (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} (NCCL)"
    shape = (f"GPT {args.depth}x{args.width}, {args.heads} heads, vocab {args.vocab}, batch {args.batch}x{args.context}"
             f"{'' if args.cpu else ', bf16 autocast'}" if args.model == "gpt"
             else f"MLP {args.depth}x{args.width}, batch {args.batch}/rank")
    print(f"{nproc} rank(s) on {where}, torch {torch.__version__}, {shape}, AdamW, {args.steps} alternating steps")
    print()
    print("| wrapper | median step (ms) | ours / theirs | peak memory (MiB) |")
    print("| --- | --- | --- | --- |")
    d = res["ddp"]
    print(f"| dptrain DDP | {1000 * d['ours']:.2f} | {d['ours'] / d['torch']:.3f} | |")
    print(f"| torch DDP | {1000 * d['torch']:.2f} | | |")
    f = res["fsdp"]
    if "fsdp2" not in f:
        print(f"| dptrain FSDP | {1000 * f['ours'][0]:.2f} | n/a: torch {torch.__version__}'s FSDP2 needs CUDA | "
              f"{f['ours'][1]:.0f} |")
        return
    print(f"| dptrain FSDP | {1000 * f['ours'][0]:.2f} | {f['ours'][0] / f['fsdp2'][0]:.3f} | {f['ours'][1]:.0f} |")
    print(f"| torch FSDP2 | {1000 * f['fsdp2'][0]:.2f} | | {f['fsdp2'][1]:.0f} |")


if __name__ == "__main__":
    main()
